#!/bin/bash
# Issue #25 check 2's p95/p50 ratio, run twice more per model (forward only; none, tio, tao):
# is the ordered ratio's gap to none's more than run-to-run noise? Writes <model>-<run>.json
# beside this script (or into OUT_DIR); from the repository root:
#   sudo docs/bench/tictac-2026-11-27b/repeats/run.sh [OUT_DIR]
out=${1:-$(dirname "$0")}
mkdir -p "$out"
for rep in 1 2; do
  for model in inception vgg alexnet; do
    width=(); [ "$model" = inception ] && width=(--width 4)
    .venv/bin/mlfabric bench tictac --model "$model" "${width[@]}" --workers 4 --emulate --rate 1gbit \
        --ordering none,tio,tao --forward-only --iterations 220 --warmup 10 -q --json "$out/$model-$rep.json" \
        || echo "$model $rep failed" >&2
  done
done
