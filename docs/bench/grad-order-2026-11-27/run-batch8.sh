#!/bin/bash
# The same as run.sh at 512 KiB / credit 2 with vgg and alexnet at batch 8 (the batch bench
# tictac runs them at, docs/tictac.md decision 14) instead of 1: heavier host compute on the
# shared cores. Writes <model>-512KiB-batch8.json beside this script (or into OUT_DIR); from
# the repository root: sudo docs/bench/grad-order-2026-11-27/run-batch8.sh [OUT_DIR]
out=${1:-$(dirname "$0")}
mkdir -p "$out"
for model in alexnet vgg; do
  width=(); [ "$model" = vgg ] && width=(--width 2)
  .venv/bin/mlfabric bench grad-order --model "$model" "${width[@]}" --workers 4 --emulate --rate 1gbit \
      --partition 512KiB --credit 2 --batch 8 --iterations 100 --rounds 5 --warmup 5 -q \
      --json "$out/$model-512KiB-batch8.json" || echo "$model failed" >&2
done
