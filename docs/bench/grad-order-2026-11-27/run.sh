#!/bin/bash
# TicTac's priorities on allreduce training (issue #25, "where it helps"): 4 ranks on an
# emulated star at 1 Gbit/s, ring allreduce, the three models, every gradient ordering, at
# the partition size best for DDP here (512 KiB, credit 2) and at a fine one (128 KiB,
# credit 4) that lets a first layer overtake sooner; the orderings take turns, 20 iterations
# at a time (--rounds 5), so that a drift of the shared machine falls on all. Writes
# <model>-<partition>.json beside this script (or into OUT_DIR); from the repository root:
#   sudo docs/bench/grad-order-2026-11-27/run.sh [OUT_DIR]
out=${1:-$(dirname "$0")}
mkdir -p "$out"
for model in alexnet vgg inception; do
  width=(); [ "$model" = vgg ] && width=(--width 2); [ "$model" = inception ] && width=(--width 4)
  for pc in "512KiB 2" "128KiB 4"; do
    set -- $pc
    .venv/bin/mlfabric bench grad-order --model "$model" "${width[@]}" --workers 4 --emulate --rate 1gbit \
        --partition "$1" --credit "$2" --iterations 100 --rounds 5 --warmup 5 -q --json "$out/$model-$1.json" \
        || echo "$model $1 failed" >&2
  done
done
