#!/bin/bash
# Issue #24 check 1 again on the emulator with per-priority queues in every shaper (root):
# BINARY and RACK vs direct push/pull, mlp (hidden 1024, 8.6 MB), 8 workers, 2 servers,
# racks r=2 h=5 1:4, 500 Mbit/s. 3 rounds; from the repository root.
out=$(dirname "$0")
for rep in 1 2 3; do
  timeout 600 .venv/bin/mlfabric train --workload mlp --hidden 1024 --workers 8 --servers 2 \
      --sync ps-bsp,mlnet-binary,mlnet-rack --epochs 2 --train-samples 4096 --emulate \
      --topology racks:r=2,h=5,oversub=4 --rate 500mbit --transport tcp --no-plot -q \
      --out "/tmp/mlfabric-mlnet-emu-$rep" --json "$out/big$rep.json" || echo "round $rep failed" >&2
  rm -rf "/tmp/mlfabric-mlnet-emu-$rep"
done
