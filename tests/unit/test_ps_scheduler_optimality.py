"""The heuristic (Alg. 2/1 + Alg. 3) against the exhaustive §10.1 optimum on small batches.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler_optimality.py -q -s

200 random instances (2-5 updates, 0-2 aggregators, random NIC rates on a star, no binding
deadlines so both solve the same problem); for each, the exhaustive search over orders x
next hops (mlfabric/ps/scheduler/exact.py) gives the optimum of obj_async (eq. 17) and
obj_sync (eq. 16); MLfabric-A is scored on obj_async and MLfabric-S on obj_sync. The gap is
heuristic / optimum - 1; it is >= 0 by construction (the heuristic's schedule is one of the
candidates); the mean must stay <= 10% for both. ``-s`` prints mean and worst.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlfabric.ps.scheduler import Batch, NetState, plan_batch
from mlfabric.ps.scheduler.exact import solve_exact

MB = 1e6
INSTANCES = 200


def instance(seed: int):
    rng = np.random.default_rng((2024, seed))
    n = int(rng.integers(2, 6))
    k = int(rng.integers(0, 3)) if n <= 4 else int(rng.integers(0, 2))
    hosts = 1 + k + int(rng.integers(2, 5))
    rates = np.array([1.0, 2.5, 3.3, 5.0, 10.0]) * 1.25e8
    net = NetState(rng.choice(rates, hosts), rng.choice(rates, hosts))
    src = tuple(int(h) for h in rng.integers(1, hosts, n))  # aggregator hosts also push updates
    sizes = rng.uniform(10 * MB, 100 * MB, n)
    hosts_k = [(1 + j,) for j in range(k)]
    tau_deadlines = tuple([n + 1] * n)  # never binding: no drops, same problem for both
    return Batch(src=src, sizes=sizes, servers=(0,), deadlines=tau_deadlines), net, hosts_k


def gaps() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"async": [], "sync": []}
    for seed in range(INSTANCES):
        batch, net, hosts = instance(seed)
        exact = solve_exact(batch, net, hosts)
        heur_a = plan_batch(batch, net, hosts, objective="async").aggregated.obj_async
        nodl = Batch(src=batch.src, sizes=batch.sizes, servers=batch.servers)
        heur_s = plan_batch(nodl, net, hosts, objective="sync").aggregated.obj_sync
        out["async"].append(heur_a / exact.obj_async - 1)
        out["sync"].append(heur_s / exact.obj_sync - 1)
    return out


def test_heuristic_gap_to_exhaustive_optimum():
    g = gaps()
    for name, values in g.items():
        v = np.asarray(values)
        print(f"\nobj_{name}: {len(v)} instances, mean gap {v.mean():.2%}, worst {v.max():.2%}, "
              f"optimal in {np.mean(v <= 1e-9):.0%}")
        assert (v >= -1e-9).all(), f"obj_{name}: the heuristic beat the exhaustive search (bug in one of them)"
        # target: <= 10% mean (measured 4.1% for MLfabric-A; 3.3% for MLfabric-S with its
        # second, longest-first list, 12.3% with shortest-first alone: docs/mlfabric_scheduler.md)
        assert v.mean() <= 0.10, f"obj_{name}: mean gap {v.mean():.2%} > 10%"


def test_exact_finds_the_obvious_optimum():
    # two equal updates from equal hosts to a server with a slow NIC and one fast aggregator:
    # all direct takes 2 s; aggregating both at a 10x faster aggregator takes 0.2 + 1 s
    net = NetState([10 * MB, 100 * MB, 100 * MB, 100 * MB], [10 * MB, 100 * MB, 100 * MB, 100 * MB])
    batch = Batch(src=(2, 3), sizes=np.array([10 * MB, 10 * MB]), servers=(0,))
    ex = solve_exact(batch, net, [(1,)])
    assert ex.obj_sync == pytest.approx(1.2)
    assert ex.best_sync[1] == (1, 1)
    # async: one direct (1 s) and one aggregated? the aggregate arrives at 0.1 + ... the
    # best mean is 1.1 (direct g at 1 s, the other direct after it at 2 s is worse)
    assert ex.obj_async <= 1.2 + 1e-9
    with pytest.raises(ValueError):
        solve_exact(Batch(src=(1,) * 7, sizes=np.full(7, MB), servers=(0,)), net, [])
