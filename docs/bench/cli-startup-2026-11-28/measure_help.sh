#!/bin/bash
# Median wall time of `mlfabric ARGS --help` before (c4794b1) and after (HEAD), interleaved rounds.
cd "$(git rev-parse --show-toplevel)"
for round in 1 2; do
  for state in before after; do
    if [ $state = before ]; then git checkout -q c4794b1 -- mlfabric; rm -f mlfabric/_lazy.py; else git checkout -q HEAD -- mlfabric; fi
    for args in "" "simulate collective" "bench allreduce" "train"; do
      echo "$round $state [mlfabric $args --help] $(docs/bench/cli-startup-2026-11-28/cli_help_median.sh 7 .venv/bin/mlfabric $args --help)"
    done
  done
done
git checkout -q HEAD -- mlfabric  # back to the branch
git status --short
