"""The compiled scheduler loops (``_sched.c``): conversion to and from the Python results.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler_native.py -q

``ordering.order_updates``, ``ordering.list_order`` and ``aggregation.aggregate`` call
into here when the kernel is built and the batch has one server (``native=None``, the
default), or always (``native=True``: an error if that is impossible); ``native=False``
keeps the Python loops. Both paths make the same float operations in the same order, so
their results are identical (tests/unit/test_ps_scheduler_native.py checks it on random
instances, and the bench checks both against the plain reference).

Why the loops are in C: the timelines the scheduler walks hold ~2-20 segments, so a walk
is a few hundred nanoseconds of arithmetic but 5-20 us of interpreter; a batch of 1,000
updates costs ~50k of them (docs/mlfabric_scheduler.md). What stays in Python is building
the result objects (one :class:`~mlfabric.ps.scheduler.netstate.Transfer` per reservation
kept), ~1 us each.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Sequence

import numpy as np

from mlfabric.ps.scheduler.netstate import NetState, Transfer

if TYPE_CHECKING:
    from mlfabric.ps.scheduler.aggregation import AggregationResult, Objective
    from mlfabric.ps.scheduler.ordering import Batch, OrderResult

try:  # built by setup.py when a C compiler is there (optional)
    from mlfabric.ps.scheduler import _sched
except ImportError:  # pragma: no cover - exercised where the kernel is not built
    _sched = None

__all__ = ["available", "list_order", "order_updates", "aggregate", "use"]

_REASONS = {1: "doomed", 2: "look-ahead", 3: "no-capacity"}


def available() -> bool:
    return _sched is not None


def use(batch: "Batch", native: bool | None) -> bool:
    """Whether to run the compiled loop for ``batch`` (see the module docstring)."""
    if native is False:
        return False
    ok = _sched is not None and len(batch.servers) == 1
    if native and not ok:
        why = "is not built (reinstall with a C compiler)" if _sched is None else "handles one server only"
        raise RuntimeError(f"native=True but the compiled scheduler (mlfabric.ps.scheduler._sched) {why}")
    return ok


def _inputs(batch: "Batch", net: NetState) -> tuple:
    ptr, times, rates = net.to_csr()
    src = np.asarray(batch.src, dtype=np.int64)
    sizes = np.ascontiguousarray(batch.sizes[:, 0], dtype=float)
    return ptr, times, rates, src, sizes, int(batch.servers[0])


def _result(batch: "Batch", net: NetState, raw: list, start: float) -> "OrderResult":
    from mlfabric.ps.scheduler.ordering import OrderDecision, OrderResult, ReplayedSnapshots

    server = batch.servers[0]
    src = batch.src
    sizes = batch.sizes[:, 0].tolist()
    decisions = []
    order = []
    kept = []
    for g, kind, pos, end, begin, pt, pr in raw:
        if kind:
            decisions.append(OrderDecision(index=g, dropped=True, reason=_REASONS[kind]))
            continue
        # NetState.reserve's Transfer: a local or empty one ends at its start with no segments
        tr = Transfer(src[g], server, sizes[g], start, end if pt else start, pt, pr)
        d = OrderDecision(index=g, dropped=False, position=pos, start=begin, end=end, transfers=(tr,))
        decisions.append(d)
        kept.append(d)
        order.append(g)
    return OrderResult(decisions=tuple(decisions), order=tuple(order),
                       snapshots=ReplayedSnapshots(net.fork(), kept))


def order_updates(batch: "Batch", net: NetState, *, start: float) -> "OrderResult":
    """``ordering.order_updates`` (Alg. 2 / Alg. 1), compiled."""
    ptr, times, rates, src, sizes, server = _inputs(batch, net)
    dl = None if batch.deadlines is None else np.asarray(batch.deadlines, dtype=np.int64)
    raw = _sched.order(ptr, times, rates, src, sizes, server, dl, float(start))
    return _result(batch, net, raw, float(start))


def list_order(batch: "Batch", net: NetState, order: Sequence[int], *, start: float) -> "OrderResult":
    """``ordering.list_order``, compiled."""
    ptr, times, rates, src, sizes, server = _inputs(batch, net)
    raw = _sched.order_list(ptr, times, rates, src, sizes, server, np.asarray(order, dtype=np.int64), float(start))
    return _result(batch, net, raw, float(start))


def aggregate(batch: "Batch", ordered: "OrderResult", hosts: Sequence[int], *, objective: "Objective",
              start: float) -> "AggregationResult":
    """``aggregation.aggregate`` (Alg. 3) for one server, compiled; ``hosts[j]`` is group
    ``j + 1``'s aggregator."""
    from mlfabric.ps.scheduler.aggregation import AggregationResult, GroupPlan

    start = float(start)
    ptr, times, rates, src, sizes, server = _inputs(batch, ordered.snapshots[0])
    by_index = {d.index: d for d in ordered.decisions if not d.dropped}
    order = list(ordered.order)
    kept = [by_index[g] for g in order]
    direct_tr = [d.transfers[0] for d in kept]
    ends = np.fromiter((d.end for d in kept), dtype=float, count=len(kept))
    lens = np.fromiter((len(t.times) for t in direct_tr), dtype=np.int64, count=len(kept))
    prof_ptr = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum(lens, out=prof_ptr[1:])
    total = int(prof_ptr[-1])
    prof_t = np.fromiter(chain.from_iterable(t.times for t in direct_tr), dtype=float, count=total)
    prof_r = np.fromiter(chain.from_iterable(t.rates for t in direct_tr), dtype=float, count=total)
    split, tried, obj_async, obj_sync, members, groups = _sched.aggregate(
        ptr, times, rates, src, sizes, server, np.asarray(order, dtype=np.int64), ends, prof_ptr, prof_t, prof_r,
        np.asarray(hosts, dtype=np.int64), objective == "sync", start)
    # group 0 (direct): the ordering's own schedules, committed at the running maximum of ends
    commit: dict[int, float] = {}
    member_transfers: dict[int, tuple[Transfer, ...]] = {}
    running = start
    for g, d in zip(order[:split], kept):
        running = max(running, d.end)
        commit[g] = running
        member_transfers[g] = d.transfers
    size_of = batch.sizes[:, 0].tolist()
    src_of = batch.src
    for g, host, end, pt, pr in members:
        member_transfers[g] = (Transfer(src_of[g], host, size_of[g], start, end, pt, pr),)
    plans = []
    for slot, host, first, last, ready, big, arrival, c, pt, pr in groups:
        mem = tuple(order[first:last])
        plans.append(GroupPlan(slot=slot, hosts=(host,), members=mem, ready=ready,
                               transfers=(Transfer(host, server, big, ready, arrival, pt, pr),), arrival=arrival,
                               commit=c))
        for g in mem:
            commit[g] = c
    return AggregationResult(split=split, direct=tuple(order[:split]), groups=tuple(plans),
                             member_transfers=member_transfers, commit=commit, obj_async=obj_async,
                             obj_sync=obj_sync, splits_tried=tried)
