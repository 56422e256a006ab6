#!/bin/sh
# Issue #24 check 4 (root): 4 PS jobs on one emulated star (1 + 3 hosts, 100 Mbit/s NICs),
# fair sharing vs distinct priorities vs the top job alone; three priority draws.
set -e
cd "$(dirname "$0")/../../.."
for seed in 0 1 2; do
    .venv/bin/mlfabric bench mlnet-priorities --jobs 4 --workers 3 --model-size 1MB --rate 100mbit \
        --iterations 8 --seed "$seed" --quiet --json "docs/bench/mlnet-priorities-emu-2026-11-27/seed$seed.json"
done
