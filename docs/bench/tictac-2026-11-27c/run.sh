#!/bin/bash
# Issue #25 checks 2-4 on the emulator (root): 1 server + 4 workers at 1 Gbit/s, the three
# models, forward only (220 iterations, 10 warm-up, three runs: the p95/p50 ratio is compared
# run by run) and training (60, 5), every ordering; the pacing ablation of docs/tictac.md
# decision 16. Each worker's clock rides with its next pull (PSWorker.pull_in_order(clock=True)).
# Writes <model>-forward-<run>.json, <model>-training.json beside this script (or into
# OUT_DIR); from the repository root: sudo docs/bench/tictac-2026-11-27c/run.sh [OUT_DIR]
out=${1:-$(dirname "$0")}
mkdir -p "$out"
bench() { .venv/bin/mlfabric bench tictac --workers 4 --emulate --rate 1gbit -q "$@" || echo "failed: $*" >&2; }
for model in inception vgg alexnet; do
  width=(); [ "$model" = inception ] && width=(--width 4)
  bench --model "$model" "${width[@]}" --forward-only --iterations 220 --warmup 10 --json "$out/$model-forward-1.json"
  bench --model "$model" "${width[@]}" --iterations 60 --warmup 5 --json "$out/$model-training.json"
done
for run in 2 3; do
  for model in inception vgg alexnet; do
    width=(); [ "$model" = inception ] && width=(--width 4)
    bench --model "$model" "${width[@]}" --forward-only --iterations 220 --warmup 10 --ordering none,tio,tao \
        --json "$out/$model-forward-$run.json"
  done
done
bench --model inception --width 4 --forward-only --iterations 220 --warmup 10 --pace off \
    --json "$out/inception-forward-unpaced.json"
bench --model inception --width 4 --iterations 60 --warmup 5 --pace on --json "$out/inception-training-paced.json"
