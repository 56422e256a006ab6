#!/bin/bash
# MLfabric failover on the emulator (issue #23, check 3): the mlp workload (accuracy), 8 workers,
# 1 server, 1 Gbit/s emulated star, MLfabric-A (tau 8) with network replication (Div_max 8u);
# server 0 SIGKILLed 12 s into training (about 40 % of it); the unfailed run beside it; two
# replicas; vanilla Async (delay bound 8) with chain replication. 3 rounds. As root, from the repository root:
# docs/bench/failover-emu-2026-11-26/run.sh (writes the JSON beside it).
out=$(dirname "$0")
common="--workload mlp --workers 8 --servers 1 --emulate --rate 1gbit --target 0.74 --timeout 300 --no-plot -q"
net="--sync mlfabric-a:8 --replication network --div-max 8u"
for rep in 1 2 3; do
  for cfg in base fail fail2 chainfail; do
    case $cfg in
      base) extra="$net --replicas 1";;
      fail) extra="$net --replicas 1 --fail server:12";;
      fail2) extra="$net --replicas 2 --fail server:12";;
      chainfail) extra="--sync ps-async --delay-bound 8 --replicas 1 --fail server:12";;
    esac
    timeout 400 .venv/bin/mlfabric train $common $extra --out "/tmp/mlfabric-failover-$cfg-$rep" \
        --json "$out/${cfg}_$rep.json" || echo "$cfg round $rep failed" >&2
    rm -rf "/tmp/mlfabric-failover-$cfg-$rep"
  done
done
