#!/bin/bash
# Issue #25 checks 2-4 on the emulator (root): 1 server + 4 workers at 1 Gbit/s, the three
# models, forward only (220 iterations, 10 warm-up) and training (60, 5), every ordering.
# Writes <model>-<forward|training>.json beside this script (or into OUT_DIR); from the
# repository root: sudo docs/bench/tictac-2026-11-27b/run.sh [OUT_DIR]
out=${1:-$(dirname "$0")}
mkdir -p "$out"
for model in inception vgg alexnet; do
  width=(); [ "$model" = inception ] && width=(--width 4)
  .venv/bin/mlfabric bench tictac --model "$model" "${width[@]}" --workers 4 --emulate --rate 1gbit \
      --forward-only --iterations 220 --warmup 10 -q --json "$out/$model-forward.json" \
      || echo "$model forward failed" >&2
  .venv/bin/mlfabric bench tictac --model "$model" "${width[@]}" --workers 4 --emulate --rate 1gbit \
      --iterations 60 --warmup 5 -q --json "$out/$model-training.json" \
      || echo "$model training failed" >&2
done
# The ablation of docs/tictac.md decision 16: inception with the other pacing.
.venv/bin/mlfabric bench tictac --model inception --width 4 --workers 4 --emulate --rate 1gbit \
    --forward-only --iterations 220 --warmup 10 --pace off -q --json "$out/inception-forward-unpaced.json" \
    || echo "inception forward unpaced failed" >&2
.venv/bin/mlfabric bench tictac --model inception --width 4 --workers 4 --emulate --rate 1gbit \
    --iterations 60 --warmup 5 --pace on -q --json "$out/inception-training-paced.json" \
    || echo "inception training paced failed" >&2
