#!/bin/bash
# issue #38 checks 1 and 3 on the committed snapshot /tmp/elsnap (the worktree may change meanwhile)
export PYTHONPATH=/tmp/elsnap
cd /tmp/elchk3
M=/work/wt-elastic/.venv/bin/mlfabric
COMMON="--workload hyperplane --workers 4 --sync allreduce --elastic --dim 1024 --train-samples 8192 --compute-time 20ms --epochs 96 --seed 0 --quiet"
for i in 1 2 3 4 5; do
  uptime > load$i.txt
  $M train $COMMON --fail worker:2@3 --rejoin 2 --json run$i.json > run$i.log 2>&1
  uptime >> load$i.txt
done
uptime > loadbase.txt
$M train $COMMON --json base.json > base.log 2>&1
uptime >> loadbase.txt
echo check1 > progress
for i in 1 2 3 4 5; do
  uptime > churnload$i.txt
  timeout 400 $M train --workload hyperplane --workers 4 --sync allreduce --elastic --dim 256 --train-samples 4096 --batch-size 64 --compute-time 10ms --epochs 200 --seed $i --quiet --fail churn:15x5 --rejoin 1 --json churn$i.json > churn$i.log 2>&1
  echo "rc=$?" >> churn$i.log
  uptime >> churnload$i.txt
done
echo done > progress
