#!/bin/bash
# MLfabric replication's cost in time (issue #23, check 2) where the server's NIC is the
# bottleneck: 8 workers, 1 server, 250 Mbit/s emulated star, MLfabric-A (tau 8), 256 KB updates;
# no replication, network replication at Div_max 8u and 32u, chain replication; 5 rounds of
# the four runs interleaved. As root, from the repository root:
# docs/bench/replication-time-emu-2026-11-26/run.sh (writes the JSON beside it).
out=$(dirname "$0")
common="--workload hyperplane --workers 8 --sync mlfabric-a:8 --servers 1 --emulate --rate 250mbit --epochs 4
        --dim 65536 --train-samples 16384 --batch-size 64 --lr 0.001 --timeout 300 --no-plot -q --no-measure-divergence"
for rep in 1 2 3 4 5; do
  for cfg in base net8u net32u chain; do
    case $cfg in
      base) extra="";;
      net8u) extra="--replicas 1 --replication network --div-max 8u";;
      net32u) extra="--replicas 1 --replication network --div-max 32u";;
      chain) extra="--replicas 1";;
    esac
    timeout 400 .venv/bin/mlfabric train $common $extra --out "/tmp/mlfabric-replication-time-$cfg-$rep" \
        --json "$out/${cfg}_$rep.json" || echo "$cfg round $rep failed" >&2
    rm -rf "/tmp/mlfabric-replication-time-$cfg-$rep"
  done
done
