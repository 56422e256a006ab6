#!/bin/bash
# MLfabric replication overhead (issue #23, check 2): 8 workers, 1 server, 1 Gbit/s emulated
# star, MLfabric-A (tau 8): no replication, network replication at Div_max 2u / 8u / 32u, chain
# replication, checkpoints every 8 versions; 6 rounds of the six runs. As root, from the
# repository root: docs/bench/replication-emu-2026-11-26/run.sh (writes the JSON beside it).
out=$(dirname "$0")
common="--workload hyperplane --workers 8 --sync mlfabric-a:8 --servers 1 --emulate --rate 1gbit --epochs 4
        --dim 65536 --train-samples 16384 --batch-size 64 --lr 0.001 --timeout 300 --no-plot -q --no-measure-divergence"
for rep in 1 2 3 4 5 6; do
  for cfg in base net2u net8u net32u chain ckpt; do
    case $cfg in
      base) extra="";;
      net2u) extra="--replicas 1 --replication network --div-max 2u";;
      net8u) extra="--replicas 1 --replication network --div-max 8u";;
      net32u) extra="--replicas 1 --replication network --div-max 32u";;
      chain) extra="--replicas 1";;
      ckpt) extra="--checkpoint-every 8";;
    esac
    timeout 400 .venv/bin/mlfabric train $common $extra --out "/tmp/mlfabric-replication-$cfg-$rep" \
        --json "$out/${cfg}_$rep.json" || echo "$cfg round $rep failed" >&2
    rm -rf "/tmp/mlfabric-replication-$cfg-$rep"
  done
done
