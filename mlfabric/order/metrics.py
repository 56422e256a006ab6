"""Makespan bounds, ordering efficiency E (eq. 3), speedup S (eq. 4) and the iteration simulator.

    .venv/bin/python -m pytest tests/unit/test_order.py -q -k "efficiency or simulate or par or seq"

The simulator executes one worker iteration the way §2.1 and §3 describe it, under an
oracle and a transfer order:

* one channel: the recvs are transferred back to back from t = 0 in the given order (the
  PS activates all sends at the start of the iteration, §2.4, so the channel never idles
  while a transfer is outstanding);
* one compute resource: whenever it is free it runs a ready op (every input, compute or
  recv, complete), non-preemptively; among ready ops the first in DAG (program) order.
  That is a deterministic stand-in for "chooses from the ready-to-execute list";
* makespan = the end of the last op or transfer.

Bounds (§3.1) ignore the DAG: eq. 1 the sum of all times (everything serialised), eq. 2
the busiest resource's total. From a measured :class:`~mlfabric.order.trace.Trace` the
same metric uses the measured durations as ``Time`` and the trace's span as ``t``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from mlfabric.order.dag import Dag
from mlfabric.order.heuristics import Priorities
from mlfabric.order.oracle import TimeOracle
from mlfabric.order.trace import Trace

__all__ = ["Bounds", "Evaluation", "Exhaustive", "bounds", "efficiency", "evaluate", "exhaustive", "makespan", "simulate",
           "speedup", "trace_bounds", "trace_efficiency"]


@dataclass(frozen=True)
class Bounds:
    """Eq. 1 (``upper``: all ops one after another) and eq. 2 (``lower``: busiest resource)."""

    lower: float
    upper: float
    compute: float  # sum of compute times
    transfer: float  # sum of transfer times (the single channel)


def bounds(dag: Dag, time: TimeOracle) -> Bounds:
    time.covers(dag)
    comp = math.fsum(time(n) for n in dag.computes)
    comm = math.fsum(time(n) for n in dag.recvs)
    return Bounds(lower=max(comp, comm), upper=comp + comm, compute=comp, transfer=comm)


def efficiency(b: Bounds, t: float) -> float:
    """Eq. 3: (upper - t) / (upper - lower); 1 = the lower bound reached, 0 = fully serialised."""
    if b.upper == b.lower:
        raise ValueError("efficiency: upper == lower bound (one resource has all the work): E is undefined")
    return (b.upper - t) / (b.upper - b.lower)


def speedup(b: Bounds) -> float:
    """Eq. 4: (upper - lower) / lower, the most ordering could gain over the worst case."""
    if b.lower <= 0:
        raise ValueError("speedup: the lower bound is 0 (no work)")
    return (b.upper - b.lower) / b.lower


def simulate(dag: Dag, time: TimeOracle, order: Sequence[str] | Priorities) -> Trace:
    """Run one iteration (see the module docstring); ``order`` is the recvs' transfer order."""
    if isinstance(order, Priorities):
        order = order.order()
    time.covers(dag)
    recvs = dag.recvs
    if len(order) != len(recvs) or set(order) != set(recvs):
        raise ValueError(f"simulate: the order must list each of the {len(recvs)} recvs exactly once")
    transfers: list[tuple[str, float, float]] = []
    t = 0.0
    for r in order:
        transfers.append((r, t, t + time(r)))
        t += time(r)
    idx = {n: i for i, n in enumerate(dag.names)}
    waiting = {n: len(dag.node(n).inputs) for n in dag.computes}
    ready: list[int] = [idx[n] for n, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    names = dag.names

    def complete(n: str) -> None:
        for s in dag.succs(n):
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, idx[s])

    compute: list[tuple[str, float, float]] = []
    now = 0.0
    nxt = 0  # next transfer to complete
    while len(compute) < len(waiting):
        while nxt < len(transfers) and transfers[nxt][2] <= now:
            complete(transfers[nxt][0])
            nxt += 1
        if ready:
            n = names[heapq.heappop(ready)]
            end = now + time(n)
            compute.append((n, now, end))
            now = end
            complete(n)
        elif nxt < len(transfers):
            now = transfers[nxt][2]  # idle: wait for the next transfer
        else:
            raise RuntimeError("simulate: compute ops left that can never run (inconsistent DAG)")
    return Trace.of(compute, transfers, simulated=True)


def makespan(dag: Dag, time: TimeOracle, order: Sequence[str] | Priorities) -> float:
    tr = simulate(dag, time, order)
    return max(tr.end, 0.0)


@dataclass(frozen=True)
class Evaluation:
    """One order under one oracle: its makespan, E, and the DAG's bounds and S."""

    makespan: float
    efficiency: float
    speedup: float
    bounds: Bounds
    order: tuple[str, ...]


def evaluate(dag: Dag, time: TimeOracle, order: Sequence[str] | Priorities) -> Evaluation:
    o = order.order() if isinstance(order, Priorities) else tuple(order)
    b = bounds(dag, time)
    t = makespan(dag, time, o)
    return Evaluation(makespan=t, efficiency=efficiency(b, t), speedup=speedup(b), bounds=b, order=o)


def trace_bounds(trace: Trace) -> Bounds:
    """Eq. 1 and 2 from a measured trace's durations (compute resource vs the channel)."""
    comp = math.fsum(e - s for _, s, e in trace.compute)
    comm = math.fsum(e - s for _, s, e in trace.transfers)
    return Bounds(lower=max(comp, comm), upper=comp + comm, compute=comp, transfer=comm)


def trace_efficiency(trace: Trace) -> float:
    """E of a measured iteration: Time(op) = its measured duration, t = the trace's span."""
    return efficiency(trace_bounds(trace), trace.makespan)


@dataclass(frozen=True)
class Exhaustive:
    best: float
    worst: float
    best_orders: tuple[tuple[str, ...], ...]
    count: int


def exhaustive(dag: Dag, time: TimeOracle, *, max_recvs: int = 8,
               tol: float = 1e-12) -> Exhaustive:
    """Every transfer order's makespan (small DAGs only): the theoretical best and worst orders."""
    recvs = dag.recvs
    if len(recvs) > max_recvs:
        raise ValueError(f"exhaustive: {len(recvs)} recvs > max_recvs={max_recvs} ({len(recvs)}! orders)")
    best, worst = math.inf, -math.inf
    best_orders: list[tuple[str, ...]] = []
    count = 0
    for perm in itertools.permutations(recvs):
        t = makespan(dag, time, perm)
        count += 1
        if t < best - tol:
            best, best_orders = t, [perm]
        elif abs(t - best) <= tol:
            best_orders.append(perm)
        worst = max(worst, t)
    return Exhaustive(best=best, worst=worst, best_orders=tuple(best_orders), count=count)
