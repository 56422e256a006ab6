"""A plain transcription of Alg. 2 + Alg. 3, kept as the reference for tests and benchmarks.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q -k reference

No bounds, no snapshots, no pruning: ``ShrtUp`` computes ``t_en`` of every remaining update
on every step, ``DetAgg`` replays the ``n`` direct reservations from the initial network for
every split ``n = 0..|U|`` and walks it to the end. It uses the same network model
(:class:`~mlfabric.ps.scheduler.netstate.NetState`) and the same documented decisions as the
fast code (docs/mlfabric_scheduler.md), so both must return the same decisions, bit for bit;
it is O(|U|^2) walks for the ordering and O(|U|^2) reservations for the aggregation.
MLfabric-S (``objective="sync"``, no deadlines) partitions two lists, shortest-first and
longest-first, and keeps the smaller makespan (docs/mlfabric_scheduler.md).
"""

from __future__ import annotations

from typing import Sequence

from mlfabric.ps.scheduler.aggregation import AggregationResult, GroupPlan, Objective, objectives
from mlfabric.ps.scheduler.netstate import INF, NetState
from mlfabric.ps.scheduler.ordering import Batch, OrderDecision, OrderResult
from mlfabric.ps.scheduler.scheduler import Plan

__all__ = ["reference_aggregate", "reference_list", "reference_longest_first", "reference_order", "reference_plan"]


def _t_en(batch: Batch, net: NetState, g: int, start: float) -> float:
    return net.job_t_en(batch.job(g), start)


def _argmin(batch: Batch, net: NetState, candidates: Sequence[int], start: float) -> tuple[float, int]:
    best, best_g = INF, -1
    for g in sorted(candidates):
        e = _t_en(batch, net, g, start)
        if best_g < 0 or e < best:
            best, best_g = e, g
    return best, best_g


def reference_order(batch: Batch, net: NetState, *, start: float = 0.0) -> OrderResult:
    dl = batch.deadlines
    net = net.fork()
    remaining = list(range(batch.n))
    decisions: list[OrderDecision] = []
    order: list[int] = []
    snapshots = [net]
    p = 1
    while remaining:
        # doomed: applied at position p or later, the delay would exceed tau_max
        if dl is not None:
            for g in [g for g in remaining if dl[g] < p]:
                remaining.remove(g)
                decisions.append(OrderDecision(index=g, dropped=True, reason="doomed"))
            if not remaining:
                break
        # ShrtDLine(p): a due update if there is one, else ShrtUp
        due = [g for g in remaining if dl is not None and dl[g] == p]
        e_star, g_star = _argmin(batch, net, due if due else remaining, start)
        remaining.remove(g_star)
        if e_star == INF:
            decisions.append(OrderDecision(index=g_star, dropped=True, reason="no-capacity"))
            continue
        after = net.fork()
        transfers = after.reserve_job(batch.job(g_star), start)
        # look-ahead: ShrtDLine(p + 1) on NetUp(NW, g*); the other updates due at p are doomed at p + 1
        if due and remaining:
            alive_next = [g for g in remaining if not (dl is not None and dl[g] < p + 1)]
            due_next = [g for g in alive_next if dl is not None and dl[g] == p + 1]
            pool = due_next if due_next else alive_next
            if pool:
                e_next, _ = _argmin(batch, after, pool, start)
                if e_star > e_next:
                    decisions.append(OrderDecision(index=g_star, dropped=True, reason="look-ahead"))
                    continue
        decisions.append(OrderDecision(index=g_star, dropped=False, position=p,
                                       start=min((t.begin for t in transfers), default=start), end=e_star,
                                       transfers=transfers))
        order.append(g_star)
        net = after
        snapshots.append(net)
        p += 1
    return OrderResult(decisions=tuple(decisions), order=tuple(order), snapshots=tuple(snapshots))


def _det_agg(batch: Batch, initial: NetState, ordered: OrderResult, group_hosts: Sequence[Sequence[int]], n: int,
             start: float) -> AggregationResult | None:
    order = list(ordered.order)
    N = len(order)
    net = initial.fork()
    commit: dict[int, float] = {}
    member_tr = {}
    t_max: float | None = None
    for g in order[:n]:  # lines 3-7: the first n straight to the server
        member_tr[g] = net.reserve_job(batch.job(g), start)
        end = max((t.end for t in member_tr[g]), default=start)
        t_max = end if t_max is None else max(t_max, end)
        commit[g] = t_max
    groups: list[GroupPlan] = []
    members: list[int] = []
    ready = start
    aid = 0
    i = n
    while True:
        closing = i >= N
        if not closing:
            if aid >= len(group_hosts):
                return None
            g = order[i]
            comps = batch.job_to(g, group_hosts[aid])
            e = net.job_t_en(comps, start)
            closing = t_max is not None and e > t_max
        if closing:  # lines 10-14 (and the last group, after the loop)
            if members:
                hosts = group_hosts[aid]
                agg = tuple((hosts[s], srv, float(max(batch.sizes[m, s] for m in members)))
                            for s, srv in enumerate(batch.servers))
                trs = net.reserve_job(agg, ready)
                arrival = max((t.end for t in trs), default=ready)
                c = arrival if t_max is None else max(t_max, arrival)
                groups.append(GroupPlan(slot=aid + 1, hosts=tuple(hosts), members=tuple(members), ready=ready,
                                        transfers=trs, arrival=arrival, commit=c))
                for m in members:
                    commit[m] = c
                t_max = c
            if i >= N:
                break
            aid += 1
            members = []
            ready = start
            continue
        if e == INF:
            return None
        member_tr[g] = net.reserve_job(comps, start)  # lines 16-18
        members.append(g)
        ready = max(ready, e)
        i += 1
    oa, osy = objectives([commit[g] for g in order])
    return AggregationResult(split=n, direct=tuple(order[:n]), groups=tuple(groups), member_transfers=member_tr,
                             commit=commit, obj_async=oa, obj_sync=osy)


def reference_aggregate(batch: Batch, initial: NetState, ordered: OrderResult, group_hosts: Sequence[Sequence[int]], *,
                        objective: Objective = "async", start: float = 0.0) -> AggregationResult:
    best: AggregationResult | None = None
    best_val = INF
    cases = range(len(ordered.order) + 1) if group_hosts else [len(ordered.order)]
    for n in cases:  # lines 21-24: every split, the smallest objective (first on ties)
        res = _det_agg(batch, initial, ordered, group_hosts, n, start)
        if res is None:
            continue
        val = res.obj_async if objective == "async" else res.obj_sync
        if best is None or val < best_val:
            best, best_val = res, val
    assert best is not None
    return AggregationResult(split=best.split, direct=best.direct, groups=best.groups,
                             member_transfers=best.member_transfers, commit=best.commit, obj_async=best.obj_async,
                             obj_sync=best.obj_sync, splits_tried=len(cases))


def reference_list(batch: Batch, net: NetState, order: Sequence[int], *, start: float = 0.0) -> OrderResult:
    """Reserve the updates of ``order`` in that order (an unreachable one is dropped)."""
    net = net.fork()
    decisions: list[OrderDecision] = []
    kept: list[int] = []
    snapshots = [net]
    for g in order:
        end = _t_en(batch, net, g, start)
        if end == INF:
            decisions.append(OrderDecision(index=g, dropped=True, reason="no-capacity"))
            continue
        net = net.fork()
        transfers = net.reserve_job(batch.job(g), start)
        kept.append(g)
        decisions.append(OrderDecision(index=g, dropped=False, position=len(kept),
                                       start=min((t.begin for t in transfers), default=start), end=end,
                                       transfers=transfers))
        snapshots.append(net)
    return OrderResult(decisions=tuple(decisions), order=tuple(kept), snapshots=tuple(snapshots))


def reference_longest_first(batch: Batch, net: NetState) -> list[int]:
    """Updates by their transfer time on the empty path, longest first (ties: smaller index)."""
    def key(g: int) -> float:
        worst = 0.0
        for src, dst, size in batch.job(g):
            if src == dst or size <= 0:
                continue
            rate = min(float(net.peak[2 * src]), float(net.peak[2 * dst + 1]))
            worst = max(worst, size / rate if rate > 0 else INF)
        return worst
    return sorted(range(batch.n), key=lambda g: (-key(g), g))


def reference_plan(batch: Batch, net: NetState, group_hosts: Sequence[Sequence[int]], *, objective: Objective,
                   start: float = 0.0) -> Plan:
    ordered = reference_order(batch, net, start=start)
    plan = Plan(ordered=ordered, aggregated=reference_aggregate(batch, net, ordered, group_hosts, objective=objective,
                                                                start=start))
    if objective == "sync" and batch.deadlines is None:  # MLfabric-S: a second list, longest first
        listed = reference_list(batch, net, reference_longest_first(batch, net), start=start)
        alt = reference_aggregate(batch, net, listed, group_hosts, objective=objective, start=start)
        if alt.obj_sync < plan.aggregated.obj_sync:
            plan = Plan(ordered=listed, aggregated=alt)
    return plan
