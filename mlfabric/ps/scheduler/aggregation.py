"""In-network aggregation of ordered updates (MLfabric Alg. 3) and model distribution (§10.3).

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q -k aggregation

:func:`aggregate` takes the ordering step's result (kept updates in application order and
the network snapshots after each direct reservation) and the hosts of the ``k``
aggregators, and tries every split ``n = 0..|U|`` (``DetAgg``, Alg. 3 lines 21-24):

* the first ``n`` updates go straight to the server(s) with exactly the schedules Alg. 2
  computed (the network state is the ordering step's snapshot ``n``, bit-identical);
  ``t_max`` is the time the server has received them (the running maximum of their ends:
  the server applies updates in order, so an update that arrives early waits);
* the next updates join group 1 (aggregator 1) as long as each one reaches the aggregator
  no later than ``t_max`` (*the constraint*: the aggregate is complete while the server is
  still busy with earlier groups, so the server's NIC never waits for an aggregation);
  each accepted update's transfer to the aggregator is reserved (lines 16-18);
* at the first update that would arrive later, the group is closed: its aggregate (as
  large as its largest member: a sum of dense same-shaped gradients) is reserved from the
  aggregator to the server, starting when its last member has arrived (so it is sent as soon
  as it is ready, at the path's full residual rate), and ``t_max`` becomes the time the
  server has it (lines 10-14); the next aggregator opens;
* the split is infeasible if updates remain once all ``k`` aggregators are used.

Decisions where the paper is vague (docs/mlfabric_scheduler.md): with ``n = 0`` there is
nothing for the server to be busy with, so group 1's constraint is vacuous (it takes all
updates); an aggregator whose group would be empty is skipped (nothing is sent, ``t_max``
stays); the last group is closed after the loop (Alg. 3 as printed never reserves it); the
``k`` aggregators are pre-assigned to groups by a seeded permutation (the paper's "random
pre-assignment", done by the caller); a split is chosen by the batch's objective (eq. 17
``obj_async`` for MLfabric-A, eq. 16 ``obj_sync`` = the paper's line 24 for MLfabric-S),
ties to the smaller ``n``. With several servers (§10.2) an update's components to all
servers travel together: to aggregator ``j`` of every server, ``t_en`` the max (eq. 18).

Why it is fast: every split ``n`` restarts from the ordering snapshot (no replay of ``n``
reservations); ``n = |U|`` (all direct, always feasible) is the first incumbent, a better
one is looked for where the best split usually is (the smallest ``n`` the aggregators can
still take), and a split is skipped or abandoned as soon as it provably cannot beat the
best one so far: commits are a running maximum, so every update not yet committed commits
at ``>= t_max`` (a lower bound of both objectives), and a byte-count bound on what ``k``
aggregators can receive before their deadlines rules out the small-``n`` splits without
walking them (single server). On the §7.4 batches 5-9 of ~1,000 splits are walked.
Skipped splits are exactly those the reference would find infeasible or worse, so the
choice is the same (tests/unit/test_ps_scheduler.py checks fast == reference). With one
server the enumeration runs compiled (``_sched.c`` via ``native.py``, same operations and
bounds; the byte bound with a rounding margin) unless ``native=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Literal, Sequence

import numpy as np

from mlfabric.ps.scheduler import native as _native
from mlfabric.ps.scheduler.netstate import INF, NetState, Transfer
from mlfabric.ps.scheduler.ordering import Batch, OrderResult

__all__ = [
    "AggregationResult", "DistributionResult", "GroupPlan", "Objective", "PullBatchPlan", "aggregate", "distribute",
    "objectives", "plan_pull_batch",
]

Objective = Literal["async", "sync"]
_REL = 1e-12  # prune only on a clear loss: float sums of the same commits may differ in the last bits
_FIT_MARGIN = 1e-9  # the byte bound rules a split out only when it misses by more than rounding


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One aggregated group: its members go to ``hosts[s]`` (one aggregator per server)."""

    slot: int
    """1-based group number (group 0 is the direct one)."""
    hosts: tuple[int, ...]
    members: tuple[int, ...]
    ready: float
    """When the last member has arrived: the aggregate's transfer starts then."""
    transfers: tuple[Transfer, ...]
    arrival: float
    commit: float
    nodes: tuple = ()
    """#36 trees (:class:`mlfabric.ps.scheduler.trees.TreeNode`, root first): the group's
    pipelined tree, ``hosts[0]`` its root and ``transfers`` one per edge; empty: Alg. 3's one
    aggregator per server."""
    chunk_bytes: int = 0
    """The tree's cut-through chunk (0: store-and-forward)."""


@dataclass(frozen=True, kw_only=True)
class AggregationResult:
    split: int
    """How many of the ordered updates go directly to the server (group 0)."""
    direct: tuple[int, ...]
    groups: tuple[GroupPlan, ...]
    member_transfers: dict[int, tuple[Transfer, ...]] = field(repr=False)
    """Each update's own transfers (to the server for group 0, to its aggregator otherwise)."""
    commit: dict[int, float] = field(repr=False)
    """When each update is applied at the server (direct: its arrival; aggregated: the aggregate's)."""
    obj_async: float
    obj_sync: float
    splits_tried: int = 0
    """Splits walked (the rest were ruled out by bounds); |U| + 1 in the reference."""

    def hop(self) -> dict[int, int]:
        """Group slot of every update: 0 = direct to the server(s), j = aggregator group j."""
        out = {g: 0 for g in self.direct}
        for grp in self.groups:
            out.update({g: grp.slot for g in grp.members})
        return out


def objectives(commits: Sequence[float]) -> tuple[float, float]:
    """(obj_async, obj_sync) of eq. 17 / eq. 16 from every applied update's commit time
    (an aggregate of ``m`` updates counts ``m`` times, as ``m(a)`` in eq. 17)."""
    if not commits:
        return 0.0, 0.0
    # a plain left-to-right sum (not sum(), which compensates from Python 3.12 on), so the
    # compiled kernel reproduces it bit for bit
    total = 0.0
    for c in commits:
        total += c
    return total / len(commits), float(max(commits))


def _validate_hosts(batch: Batch, group_hosts: Sequence[Sequence[int]]) -> None:
    for j, hosts in enumerate(group_hosts):
        if len(hosts) != len(batch.servers):
            raise ValueError(f"aggregator group {j + 1}: one host per server expected, got {hosts}")
        if any(h in batch.servers for h in hosts):
            raise ValueError(f"aggregator group {j + 1}: an aggregator may not sit on a server host ({hosts})")
    for s in range(len(batch.servers)):
        col = [hosts[s] for hosts in group_hosts]
        if len(set(col)) != len(col):
            raise ValueError(f"server {s}: aggregator hosts must be distinct, got {col}")


class _Splits:
    """Shared per-batch data of the split enumeration."""

    def __init__(self, batch: Batch, ordered: OrderResult, group_hosts: Sequence[Sequence[int]], start: float) -> None:
        self.batch = batch
        self.order = list(ordered.order)
        self.snapshots = ordered.snapshots
        self.group_hosts = [tuple(h) for h in group_hosts]
        self.start = start
        by_index = ordered.by_index()
        self.direct_tr = {g: by_index[g].transfers for g in self.order}
        ends = [by_index[g].end for g in self.order]
        self.commit_direct: list[float] = []
        running = start
        for e in ends:
            running = max(running, e)
            self.commit_direct.append(running)
        self.prefix_sum = [0.0]
        for c in self.commit_direct:
            self.prefix_sum.append(self.prefix_sum[-1] + c)

    def det_agg(self, n: int, objective: Objective, bound: float) -> AggregationResult | None:
        """DetAgg(n): None if infeasible or (``bound`` < INF) provably worse than ``bound``."""
        batch, order, start = self.batch, self.order, self.start
        N = len(order)
        k = len(self.group_hosts)
        net = self.snapshots[n].fork() if n < N else self.snapshots[n]
        t_max: float | None = self.commit_direct[n - 1] if n > 0 else None
        known = self.prefix_sum[n]
        commit = {g: self.commit_direct[i] for i, g in enumerate(order[:n])}
        member_tr = {g: self.direct_tr[g] for g in order[:n]}
        groups: list[GroupPlan] = []
        limit = bound * (1 + _REL) if bound < INF else INF
        members: list[int] = []
        ready = start
        aid = 0
        i = n

        def close() -> None:
            nonlocal t_max, known
            hosts = self.group_hosts[aid]
            comps = tuple((hosts[s], srv, float(max(batch.sizes[g, s] for g in members)))
                          for s, srv in enumerate(batch.servers))
            trs = net.reserve_job(comps, ready)
            arrival = max((tr.end for tr in trs), default=ready)
            c = arrival if t_max is None else max(t_max, arrival)
            groups.append(GroupPlan(slot=aid + 1, hosts=hosts, members=tuple(members), ready=ready,
                                    transfers=trs, arrival=arrival, commit=c))
            for g in members:
                commit[g] = c
            known += len(members) * c
            t_max = c

        while i < N:
            if aid >= k:
                return None
            g = order[i]
            comps = batch.job_to(g, self.group_hosts[aid])
            e = net.job_t_en(comps, start)
            if t_max is not None and e > t_max:
                if members:
                    close()
                    # every update still to place commits at >= t_max (running maximum)
                    lb = (known + (N - i) * t_max) / N if objective == "async" else t_max
                    if lb > limit:
                        return None
                aid += 1
                members = []
                ready = start
                continue
            if e == INF:
                return None
            member_tr[g] = net.reserve_job(comps, start)
            members.append(g)
            ready = max(ready, e)
            i += 1
        if members:
            close()
        commits = [commit[g] for g in order]
        oa, osy = objectives(commits)
        return AggregationResult(split=n, direct=tuple(order[:n]), groups=tuple(groups), member_transfers=member_tr,
                                 commit=commit, obj_async=oa, obj_sync=osy)

    def cannot_fit(self, n: int, initial: NetState) -> bool:
        """True if the ``k`` aggregators provably cannot take updates ``n..`` (single server):
        group j's members all arrive by the previous groups' commit time T_{j-1} through the
        aggregator's down link (local members excepted), and T_j <= the time the aggregate
        would take on the untouched path from T_{j-1} (after T_{j-1} nothing else uses it)."""
        batch, order = self.batch, self.order
        if len(batch.servers) != 1 or n == 0 or n >= len(order):
            return False
        server = batch.servers[0]
        rest = order[n:]
        sizes = batch.sizes[rest, 0]
        need = float(sizes.sum())
        biggest = float(sizes.max())
        src = np.asarray(batch.src)[rest]
        t = self.commit_direct[n - 1]
        need *= 1 - _FIT_MARGIN
        cap = 0.0
        for hosts in self.group_hosts:
            a = hosts[0]
            cap += initial.capacity_integral(2 * a + 1, self.start, t) + float(sizes[src == a].sum())
            if cap >= need:
                return False
            t = initial.t_en(a, server, biggest, t)
            if t == INF:
                return cap < need
        return cap < need


def aggregate(batch: Batch, ordered: OrderResult, group_hosts: Sequence[Sequence[int]], *,
              objective: Objective = "async", start: float = 0.0, native: bool | None = None) -> AggregationResult:
    """Alg. 3: the best split of ``ordered`` into a direct group and ``len(group_hosts)``
    aggregator groups (``group_hosts[j][s]``: group ``j + 1``'s aggregator for server ``s``).
    ``native``: the compiled enumeration (None: when built and the batch has one server)."""
    _validate_hosts(batch, group_hosts)
    if objective not in ("async", "sync"):
        raise ValueError(f"objective must be 'async' or 'sync', got {objective!r}")
    if _native.use(batch, native):
        return _aggregate_natively(batch, ordered, [h[0] for h in group_hosts], objective=objective, start=start)
    sp = _Splits(batch, ordered, group_hosts, start)
    N = len(sp.order)
    initial = ordered.snapshots[0]
    best = sp.det_agg(N, objective, INF)
    assert best is not None  # all direct is always feasible
    best_val = best.obj_async if objective == "async" else best.obj_sync
    best_n = N
    tried = 1

    def bound(n: int) -> float:
        """Split n's objective is >= this: later updates commit at >= the direct group's last
        commit. Nondecreasing in n (commits are a running maximum)."""
        if n == 0:
            return -INF
        c = sp.commit_direct[n - 1]
        return (sp.prefix_sum[n] + (N - n) * c) / N if objective == "async" else c

    def walk(n: int) -> AggregationResult | None:
        nonlocal best, best_val, best_n, tried
        tried += 1
        res = sp.det_agg(n, objective, best_val)
        if res is not None:
            val = res.obj_async if objective == "async" else res.obj_sync
            if val < best_val or (val == best_val and n < best_n):
                best, best_val, best_n = res, val, n
        return res

    if group_hosts and N:
        # The best split is typically the smallest one the aggregators can still take (more
        # aggregated, fewer bytes into the server), just above where the byte bound stops
        # ruling splits out: find an incumbent there first, galloping up from the first split
        # the bounds leave (few walks instead of a sweep), ...
        walked: set[int] = set()
        n, step = 1, 1
        while n < N and not bound(n) > best_val * (1 + _REL) and sp.cannot_fit(n, initial):
            n += 1
        while n < N and not bound(n) > best_val * (1 + _REL):
            if not sp.cannot_fit(n, initial):
                walked.add(n)
                if walk(n) is not None:
                    break
            n += step
            step *= 2
        # ... then every split the bounds leave, ascending: bound(n) grows with n, so the
        # first split it rules out ends the pass; ties go to the smaller n as in the
        # reference's first-minimum scan (the order of the walks does not change the choice)
        for n in range(N):
            if n in walked:
                continue
            if bound(n) > best_val * (1 + _REL):
                break
            if not sp.cannot_fit(n, initial):
                walk(n)
    return AggregationResult(split=best.split, direct=best.direct, groups=best.groups,
                             member_transfers=best.member_transfers, commit=best.commit, obj_async=best.obj_async,
                             obj_sync=best.obj_sync, splits_tried=tried)


# --------------------------------------------------------------------------- distribution (§10.3)


@dataclass(frozen=True, kw_only=True)
class DistributionResult:
    split: int
    """Workers served directly by the server (the first ``split`` in shortest-first order)."""
    direct: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...]
    """(distributor host, its workers) in group order 1..k°."""
    transfers: tuple[Transfer, ...]
    """All reserved transfers, in reservation order (server->distributor k°..1, then the rest)."""
    received: dict[int, float] = field(repr=False)
    """When each requesting worker has the model."""
    makespan: float


def distribute(net: NetState, *, server: int, workers: Sequence[int], distributors: Sequence[int],
               model_size: float, start: float = 0.0) -> DistributionResult:
    """§10.3: a batch of model requests answered with one model version through ``k°``
    distributors. Workers are ordered shortest server->worker transfer first; for every split
    ``n`` the groups are formed by Alg. 3 with ``t_en`` replaced by the distributor->worker
    times (group ``j`` takes workers while the distributor can serve each of them by the time
    the server is done with the earlier groups); then the schedule the paper prescribes is
    reserved: the model goes from the server to distributor ``k°`` first, then backwards to
    distributor 1, then straight to group 0's workers, and every distributor forwards to its
    workers as soon as it has the model. The split with the smallest makespan wins (ties:
    smaller ``n``). ``net`` is not changed."""
    if len(set(workers)) != len(workers):
        raise ValueError("one model request per worker host")
    if server in distributors or len(set(distributors)) != len(distributors):
        raise ValueError("distributors must be distinct hosts other than the server")
    order = sorted(workers, key=lambda w: (net.t_en(server, w, model_size, start), w))
    best: DistributionResult | None = None
    for n in range(len(order), -1, -1):
        if n < len(order) and not distributors:
            break
        # partition (Alg. 3 with the distribution times)
        probe = net.fork()
        t_max: float | None = None
        for w in order[:n]:
            t_max = max(t_max or start, probe.reserve(server, w, model_size, start).end)
        groups: list[tuple[int, list[int]]] = []
        i, aid = n, 0
        ok = True
        while i < len(order):
            if aid >= len(distributors):
                ok = False
                break
            d = distributors[aid]
            if not groups or groups[-1][0] != d:
                groups.append((d, []))
            e = probe.t_en(d, order[i], model_size, start)
            if t_max is not None and e > t_max:
                if groups[-1][1]:
                    t_max = max(t_max, probe.reserve(server, d, model_size, start).end)
                else:
                    groups.pop()
                aid += 1
                continue
            probe.reserve(d, order[i], model_size, start)
            groups[-1][1].append(order[i])
            i += 1
        if not ok:
            continue
        groups = [(d, ws) for d, ws in groups if ws]
        # the prescribed schedule: server -> distributor k°..1, then group 0, then fan-out
        real = net.fork()
        transfers: list[Transfer] = []
        received: dict[int, float] = {}
        at_distributor: dict[int, float] = {}
        for d, ws in reversed(groups):
            tr = real.reserve(server, d, model_size, start)
            transfers.append(tr)
            at_distributor[d] = tr.end
        for w in order[:n]:
            tr = real.reserve(server, w, model_size, start)
            transfers.append(tr)
            received[w] = tr.end
        for d, ws in reversed(groups):
            for w in ws:
                tr = real.reserve(d, w, model_size, at_distributor[d])
                transfers.append(tr)
                received[w] = tr.end
        makespan = max(received.values(), default=start)
        if best is None or makespan <= best.makespan:
            best = DistributionResult(split=n, direct=tuple(order[:n]),
                                      groups=tuple((d, tuple(ws)) for d, ws in groups), transfers=tuple(transfers),
                                      received=received, makespan=makespan)
    assert best is not None
    return best


@dataclass(frozen=True, kw_only=True)
class PullBatchPlan:
    """How one batch of pulls is answered (:func:`plan_pull_batch`)."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    """(distributor host, the workers it forwards to), in group order 1..k°."""
    by_server: tuple[int, ...]
    """Pullers the server sends the model itself (group 0 and the distributors nobody needs)."""
    transfers: tuple[Transfer, ...]
    """Every transfer the answers reserve (for the ledger and the server's busy time)."""
    tree: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Multicast distribution (#36): per sending host (the server included) the hosts it
    forwards the model to, a pipelined tree or chain rooted at the server. Empty: §10.3's one
    level, read from ``groups`` and ``by_server`` (:meth:`forwards` gives it either way)."""
    chunk_bytes: int = 0
    """> 0: a relay forwards chunk i of the model as soon as it has it (cut-through); 0:
    once the whole model is in (store-and-forward, §10.3)."""

    def forwards(self, server: int) -> dict[int, tuple[int, ...]]:
        """Who sends the model to whom, whichever way it was planned: ``tree``, or (§10.3) the
        ``server`` host to the distributors (k°..1) and ``by_server``, each distributor to its
        group."""
        if self.tree:
            return dict(self.tree)
        out: dict[int, tuple[int, ...]] = {}
        relays = tuple(d for d, _ in self.groups)
        if self.by_server or relays:
            out[server] = (*reversed(relays), *self.by_server)
        out.update({d: tuple(ws) for d, ws in self.groups})
        return out


def plan_pull_batch(net: NetState, *, server: int, pullers: Sequence[int], model_size: float, distributors: int,
                    shuffle: Callable[[list[int]], None], start: float,
                    answered_first: Sequence[int] = ()) -> PullBatchPlan:
    """§10.3 for one batch of pulls, as the runtime and the simulator answer it. The pullers of
    ``answered_first`` (they asked the server itself) are sent the model first; then, with at
    least three ``pullers`` and ``distributors`` (k°) >= 1, the k° pullers the server reaches
    soonest are earmarked (ties in the order ``shuffle`` leaves them: a seeded draw) and
    :func:`distribute` splits the others; otherwise they too are answered directly, one after
    the other. ``net`` is not changed."""
    state = net.fork()
    first = tuple(state.reserve(server, h, model_size, start) for h in answered_first)
    if distributors < 1 or len(pullers) < 3:
        return PullBatchPlan(groups=(), by_server=(*answered_first, *pullers),
                             transfers=first + tuple(state.reserve(server, h, model_size, start) for h in pullers))
    order = list(pullers)
    shuffle(order)
    order.sort(key=lambda h: state.t_en(server, h, model_size, start))  # stable: ties keep the draw
    k = min(distributors, len(order) - 1)
    plan = distribute(state, server=server, workers=order[k:], distributors=order[:k], model_size=model_size,
                      start=start)
    relays = {d for d, _ in plan.groups}
    return PullBatchPlan(groups=plan.groups,
                         by_server=(*answered_first, *(h for h in (*plan.direct, *order[:k]) if h not in relays)),
                         transfers=first + plan.transfers)


def _aggregate_natively(batch: Batch, ordered: OrderResult, hosts: Sequence[int], *, objective: Objective,
                        start: float) -> AggregationResult:
    """``aggregation.aggregate`` (Alg. 3) for one server, compiled; ``hosts[j]`` is group
    ``j + 1``'s aggregator."""
    start = float(start)
    server = batch.servers[0]
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
    split, tried, obj_async, obj_sync, members, groups = _native.aggregate_raw(
        batch, ordered.snapshots[0], order, ends, prof_ptr, prof_t, prof_r, hosts, objective == "sync", start)
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
