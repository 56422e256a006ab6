#!/bin/bash
# MLNET's tree repair on the emulator (issue #24, check 2): the mlp workload, 8 workers, 2
# servers, racks topology (2 racks of 5 hosts, 1:4 oversubscribed), 500 Mbit/s NICs, BINARY
# trees with SSP (s = 1); the interior node below worker 0 in server 0's tree SIGKILLed 8 s into
# training; the unfailed run beside it. 3 rounds. As root, from the repository root:
# docs/bench/mlnet-repair-emu-2026-11-26/run.sh [OUT_DIR] (writes the JSON into OUT_DIR,
# beside the script by default).
out=${1:-$(dirname "$0")}
common="--workload mlp --workers 8 --servers 2 --sync mlnet-binary+ssp:1 --emulate --rate 500mbit
        --topology racks:r=2,h=5,oversub=4 --target 0.74 --timeout 300 --no-plot -q"
for rep in 1 2 3; do
  for cfg in base fail; do
    case $cfg in
      base) extra="";;
      fail) extra="--fail aggregator:8";;
    esac
    timeout 400 .venv/bin/mlfabric train $common $extra --out "/tmp/mlfabric-mlnet-repair-$cfg-$rep" \
        --json "$out/${cfg}_$rep.json" || echo "$cfg round $rep failed" >&2
    rm -rf "/tmp/mlfabric-mlnet-repair-$cfg-$rep"
  done
done
