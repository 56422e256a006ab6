#!/bin/bash
cd "$(dirname "$0")/../../.."  # the repository root
for mode in ps-bsp ps-async; do
  for i in 1 2 3; do
    tag=${mode#ps-}-m$i
    echo "$tag start $(date -u +%T) $(cat /proc/loadavg)"
    .venv/bin/mlfabric train --workload hyperplane --workers 4 --servers 1 --sync $mode --fail worker:2@3 --rejoin 2 --json docs/bench/ps-rejoin-2026-11-28/$tag.json 2>&1 | tail -2
    echo "$tag end $(date -u +%T) $(cat /proc/loadavg)"
  done
done
