#!/usr/bin/env bash
# Table 2 emulated (issue #22 checks 4-5) and its comparison with the simulator (issue #35 check 4):
# both network settings, then `simulate mlfabric --emulated` on the same cells, then the count of
# cells within 15%.
#
#     sudo tools/table2_emulated.sh            # from the repository root, as root; ~2 x 17 min on an idle 2-core VM
#     sudo tools/table2_emulated.sh N2         # one network setting
#
# Writes, per network setting N:
#   docs/bench/mlfabric-table2-emulated-N.json       the emulated runs (each run's churn_offset_s: where it
#                                                    started in its launch's churn)
#   docs/bench/mlfabric-table2-emulated-N/           the run directory: curves, and the launches' churn
#                                                    traces (churn-collective.csv, churn-parameter-server.csv)
#                                                    that the comparison replays per mode
#   docs/bench/mlfabric-table2-sim-vs-emu-N.json     simulated vs emulated speedups over RR-Sync, per cell
# Run it on an otherwise idle machine: the emulated scheduled modes' times move with the CPU load.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then set -- N1 N2; fi
settings=("$@")
mlfabric=.venv/bin/mlfabric
for n in "${settings[@]}"; do
    out=docs/bench/mlfabric-table2-emulated-$n
    echo "== $n: emulated ($(date -u +%H:%M) UTC, load: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$mlfabric" train --workload lenet5 --image-size 16 --compute-time 60ms --batch-size 16 --train-samples 4096 \
        --epochs 4 --lr 0.05 --momentum 0.5 --workers 8 --servers 1 \
        --sync allreduce,tree-allreduce,ps-async,mlfabric-a:8,mlfabric-s --inject C1 --inject C2 --inject C3 \
        --target 0.85 --emulate --rate 1gbit --churn "$n" --transport tcp --out "$out" --json "$out.json"
    echo "== $n: simulated on the same cells ($(date -u +%H:%M) UTC)"
    "$mlfabric" simulate mlfabric --update-size 4447784B --rate 1gbit --compute 68ms \
        --emulated "$out.json" --json "docs/bench/mlfabric-table2-sim-vs-emu-$n.json"
done
.venv/bin/python - "${settings[@]}" <<'EOF'
import json, sys
within = total = 0
for n in sys.argv[1:]:
    rows = json.load(open(f"docs/bench/mlfabric-table2-sim-vs-emu-{n}.json"))["rows"]
    for r in rows:
        if r["mode"] == "allreduce" or r["sim_over_emu"] is None:
            continue
        total += 1
        ok = abs(r["sim_over_emu"] - 1) <= 0.15
        within += ok
        print(f"{n} {r['inject']} {r['mode']:<15} sim/emu {r['sim_over_emu']:.3f}"
              f"{'' if ok else '  (outside 15%)'}{'' if r.get('replayed') else '  (churn drawn, not replayed)'}")
print(f"within 15%: {within} of {total} cells (issue #35 check 4: >= 18 of 20)")
EOF
