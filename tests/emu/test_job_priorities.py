"""Job priorities on the emulator (MLNET §3, issue #24 check 4; root): marked flows are served
in strict priority order at a shared NIC, and PS jobs marked by MLFABRIC_PRIORITY finish in
priority order with exact models.

    sudo .venv/bin/python -m pytest tests/emu/test_job_priorities.py -q
"""

from __future__ import annotations

import numpy as np

from mlfabric.emu.cluster import Cluster, new_prefix, plan_cluster
from mlfabric.emu.goodput import WARMUP_S, run_flows
from mlfabric.transport.sockets import priority_tos
from tests.emu.conftest import needs_root


def _bytes_between(samples: list[list[float]], t0: float, t1: float) -> float:
    """Bytes a receiver took between t0 and t1 (its cumulative samples, 0 before the first)."""
    times, total = np.array(samples, dtype=float).T
    return float(np.interp(t1, times, total, left=0.0) - np.interp(t0, times, total, left=0.0))


@needs_root
def test_the_higher_priority_flow_takes_the_shared_nic(no_leaks) -> None:
    rate = 100e6
    with Cluster.create(plan_cluster("star:n=3", rate, prefix=new_prefix())) as cluster:
        # hosts 1 and 2 send to host 0 at once: they meet at host 0's switch port
        low, high = run_flows(cluster.plan, [(1, 0), (2, 0)], seconds=2.5, tos=[priority_tos(1), priority_tos(6)])
    t0 = high["samples"][0][0] + WARMUP_S
    t1 = high["samples"][-1][0] - 0.2  # the high flow's own end: both were sending meanwhile
    shares = [_bytes_between(flow["samples"], t0, t1) * 8 / (t1 - t0) / rate for flow in (low, high)]
    print(f"shares of host 0's NIC while both sent, priority 1 / 6: {shares[0]:.3f} / {shares[1]:.3f}")
    assert shares[1] >= 0.85 and shares[0] <= 0.10  # strict priority above a floor (8 kbit/s)


@needs_root
def test_ps_jobs_marked_by_priority_finish_in_priority_order(no_leaks) -> None:
    from mlfabric.bench.mlnet_priorities import PriorityBenchConfig, run_priority_bench

    config = PriorityBenchConfig(jobs=2, workers=2, model_bytes=256 << 10, rate_bps=20e6, iterations=3,
                                 scenarios=("fair", "priority"), timeout_s=60)
    result = run_priority_bench(config, capture_output=True)
    assert all(j.correct for s in result.scenarios.values() for j in s.jobs)
    prio = {j.priority: j.jct_s for j in result.scenarios["priority"].jobs}
    fair = result.scenarios["fair"]
    assert sorted(prio) == [1, 2] and [j.priority for j in fair.jobs] == [0, 0]
    # alone, a job takes ~3 x 2 x 0.25 s here: the top one is not held back by the other
    assert prio[2] < prio[1] and prio[2] < 0.8 * fair.median_jct_s, (prio, fair.median_jct_s)
