"""Exhaustive solution of the §10.1 problem for small batches (|U| <= 6, <= 2 aggregators).

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler_optimality.py -q -s

The search space is every *order* of the updates times every *next hop* of each update
(a server directly, or aggregator group ``j``): the updates are reserved in that order with
the same ``t_en`` / NetUp rule as the heuristic (each transfer uses all the residual
bottleneck of its path over time, Fig. 4), and an aggregator's aggregate (as large as its
largest member) is reserved right after its last member, starting when that member has
arrived. Updates are applied in the order they reach the server (an aggregate applies all
its members at once); a candidate is valid if every update's position is within its
deadline (eq. 9). For each valid candidate both objectives are computed, ``obj_async``
(eq. 17: mean commit time, an aggregate counted once per member) and ``obj_sync`` (eq. 16:
the last commit), and the minimum of each is returned.

Why this space: it is the §10.1 problem restricted to the network model the scheduler
uses (transfers are reserved one at a time at their path's full residual rate; the ILP's
arbitrary rate functions would need a time discretisation), and it contains every
schedule the heuristic can produce (Alg. 2's order with Alg. 3's hops, an aggregate
reserved right after its group's last member), so the gap is >= 0 by construction.
The enumeration is a depth-first search over orders per hop assignment, forking the
network state at each node so a shared prefix is reserved once:
``|U|! * (k + 1)^|U|`` leaves (5,040 x ... at |U| = 6 is slow; the tests use |U| <= 5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from mlfabric.ps.scheduler.netstate import INF, NetState
from mlfabric.ps.scheduler.ordering import Batch

__all__ = ["ExactResult", "solve_exact"]

MAX_UPDATES = 6
MAX_AGGREGATORS = 2


@dataclass(frozen=True, kw_only=True)
class ExactResult:
    obj_async: float
    obj_sync: float
    best_async: tuple[tuple[int, ...], tuple[int, ...]]
    """(order, hop per batch index: 0 = direct, j = aggregator group j) reaching ``obj_async``."""
    best_sync: tuple[tuple[int, ...], tuple[int, ...]]
    candidates: int
    """Valid (deadline-respecting) candidates evaluated."""


def solve_exact(batch: Batch, net: NetState, group_hosts: Sequence[Sequence[int]], *, start: float = 0.0) -> ExactResult:
    """Minimum ``obj_async`` and ``obj_sync`` over all orders x next hops (module docstring)."""
    n, k = batch.n, len(group_hosts)
    if n > MAX_UPDATES or k > MAX_AGGREGATORS:
        raise ValueError(f"exact search is for |U| <= {MAX_UPDATES} and <= {MAX_AGGREGATORS} aggregators, "
                         f"got {n} and {k}")
    if n == 0:
        return ExactResult(obj_async=0.0, obj_sync=0.0, best_async=((), ()), best_sync=((), ()), candidates=1)
    dl = batch.deadlines
    best = {"async": (INF, ((), ())), "sync": (INF, ((), ()))}
    count = 0

    def leaf(order: tuple[int, ...], hops: tuple[int, ...], arrive: dict[int, float]) -> None:
        nonlocal count
        commits = [arrive[g] for g in range(n)]
        if dl is not None:
            # application order = arrival order (ties: sequence order); members of one
            # aggregate get consecutive positions, earliest deadline first
            seq = {g: i for i, g in enumerate(order)}
            ranked = sorted(range(n), key=lambda g: (arrive[g], hops[g] if hops[g] else 0,
                                                     dl[g] if hops[g] else 0, seq[g]))
            if any(dl[g] < pos for pos, g in enumerate(ranked, start=1)):
                return
        count += 1
        oa = sum(commits) / n
        osy = max(commits)
        if oa < best["async"][0]:
            best["async"] = (oa, (order, hops))
        if osy < best["sync"][0]:
            best["sync"] = (osy, (order, hops))

    for hops in itertools.product(range(k + 1), repeat=n):
        _dfs(batch, net, group_hosts, hops, start, leaf)
    return ExactResult(obj_async=best["async"][0], obj_sync=best["sync"][0], best_async=best["async"][1],
                       best_sync=best["sync"][1], candidates=count)


def _dfs(batch: Batch, net: NetState, group_hosts: Sequence[Sequence[int]], hops: tuple[int, ...], start: float,
         leaf) -> None:
    n = batch.n
    k = len(group_hosts)
    members_total = [0] * (k + 1)
    for h in hops:
        members_total[h] += 1

    def rec(state: NetState, order: tuple[int, ...], arrive: dict[int, float], placed: list[int],
            ready: list[float], biggest: list[list[float]]) -> None:
        if len(order) == n:
            leaf(order, hops, arrive)
            return
        for g in range(n):
            if g in arrive:
                continue
            h = hops[g]
            st = state.fork()
            if h == 0:
                trs = st.reserve_job(batch.job(g), start)
                new_arrive = dict(arrive)
                new_arrive[g] = max((t.end for t in trs), default=start)
                rec(st, order + (g,), new_arrive, placed, ready, biggest)
                continue
            trs = st.reserve_job(batch.job_to(g, group_hosts[h - 1]), start)
            end = max((t.end for t in trs), default=start)
            placed2 = list(placed)
            placed2[h] += 1
            ready2 = list(ready)
            ready2[h] = max(ready2[h], end)
            big2 = [list(b) for b in biggest]
            big2[h] = [max(a, float(batch.sizes[g, s])) for s, a in enumerate(big2[h])]
            new_arrive = dict(arrive)
            new_arrive[g] = INF  # placeholder until the aggregate arrives
            if placed2[h] == members_total[h]:
                hosts = group_hosts[h - 1]
                comps = tuple((hosts[s], srv, big2[h][s]) for s, srv in enumerate(batch.servers))
                atrs = st.reserve_job(comps, ready2[h])
                arrival = max((t.end for t in atrs), default=ready2[h])
                for m in (*order, g):
                    if hops[m] == h:
                        new_arrive[m] = arrival
            rec(st, order + (g,), new_arrive, placed2, ready2, big2)

    n_servers = len(batch.servers)
    rec(net.fork(), (), {}, [0] * (k + 1), [start] * (k + 1), [[0.0] * n_servers for _ in range(k + 1)])
