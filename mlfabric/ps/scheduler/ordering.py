"""Update ordering: shortest transfer first (MLfabric Alg. 1) with deadlines and look-ahead drops (Alg. 2).

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q -k ordering

Input: a :class:`Batch` (each update's worker host, bytes per server component, deadline),
the network state and the earliest start. Output: an :class:`OrderResult`, one
:class:`OrderDecision` per update (kept in application order with its position, start, end
and per-component :class:`~mlfabric.ps.scheduler.netstate.Transfer`, or dropped with the
reason), plus the network *snapshots* after each kept reservation (the aggregation step
restarts from them).

The loop (Alg. 2, ``p`` = the position the next kept update gets, 1-based):

1. updates whose deadline ``dl(g) = v(g) + tau_max - v_init`` (eq. 9) is below ``p`` are
   *doomed*: applied at position ``p`` or later their delay would exceed ``tau_max``; they
   are dropped without reserving anything (the network never carries a doomed update);
2. ``ShrtDLine``: if updates are *due* (``dl(g) == p``), pick the due one with the smallest
   ``t_en``; otherwise ``ShrtUp``: the update with the smallest ``t_en`` (Alg. 1);
3. look-ahead (only after a due pick: a ShrtUp pick is the minimum, and reservations only
   delay the others, so it can never lose): reserve the pick on a fork, find the update that
   would take position ``p + 1`` on that fork; if it completes *before* the pick, drop the
   pick (Fig. 5: a 10 Mbps update that would hold the server back while a 90 Mbps one could
   already be applied);
4. otherwise keep the pick: position ``p``, the fork becomes the state.

Ties are broken by the smaller batch index, everywhere, so fast and reference agree.

Why it is fast: ``ShrtUp`` needs the argmin of ``t_en`` over all remaining updates after
every reservation (|U|^2 walks for |U| updates in the reference). Here every update has a
static *key* ``max_s size_s / min(peak(up), peak(down_s))`` (its transfer time on an empty
path); for any state, ``max(start, first free time of the servers' down links) + key`` is a
lower bound of its ``t_en`` (nothing reaches a server before its link frees up, nothing is
faster than the peak rate), and stays one as reservations only lower peaks. Scanning the
remaining updates in key order, the scan stops at the first bound above the best exact
``t_en`` found so far; under a server bottleneck that is after one or two exact walks.

With one server the same loop runs compiled (``_sched.c``, via ``native.py``; same float
operations, bit-identical decisions) unless ``native=False``; the Python loop here is the
fallback and the multi-server path. :func:`list_order` reserves a given list instead
(MLfabric-S's second candidate list, :func:`longest_first`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from mlfabric.ps.scheduler import native as _native
from mlfabric.ps.scheduler.netstate import INF, Component, NetState, Transfer

__all__ = ["Batch", "OrderDecision", "OrderResult", "ReplayedSnapshots", "list_order", "longest_first", "order_updates",
           "transfer_keys"]

DropReason = Literal["doomed", "look-ahead", "no-capacity"]


@dataclass(frozen=True, kw_only=True)
class Batch:
    """A batch of updates as the pure algorithms see it (index = position in the batch).

    ``sizes[g, s]`` is the bytes of update ``g`` for server ``s`` (host ``servers[s]``);
    ``deadlines[g]`` is ``dl(g)`` of eq. 9 (``None``: no deadlines, MLfabric-S and Alg. 1)."""

    src: tuple[int, ...]
    sizes: np.ndarray
    servers: tuple[int, ...]
    deadlines: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        sizes = np.asarray(self.sizes, dtype=float)
        if sizes.ndim == 1:
            sizes = sizes[:, None]
        object.__setattr__(self, "sizes", sizes)
        n = len(self.src)
        if sizes.shape != (n, len(self.servers)):
            raise ValueError(f"sizes must be (updates, servers) = ({n}, {len(self.servers)}), got {sizes.shape}")
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"servers must be distinct hosts, got {self.servers}")
        if (sizes < 0).any() or not np.isfinite(sizes).all():
            raise ValueError("update sizes must be finite and >= 0 bytes")
        if self.deadlines is not None and len(self.deadlines) != n:
            raise ValueError(f"{len(self.deadlines)} deadlines for {n} updates")

    @property
    def n(self) -> int:
        return len(self.src)

    def job(self, g: int) -> tuple[Component, ...]:
        """Update ``g``'s components straight to the servers."""
        return tuple((self.src[g], srv, float(self.sizes[g, s])) for s, srv in enumerate(self.servers))

    def job_to(self, g: int, hosts: Sequence[int]) -> tuple[Component, ...]:
        """Update ``g``'s components to ``hosts[s]`` (aggregators of each server)."""
        return tuple((self.src[g], hosts[s], float(self.sizes[g, s])) for s in range(len(self.servers)))


@dataclass(frozen=True, slots=True)
class OrderDecision:
    index: int
    dropped: bool
    reason: DropReason | None = None
    position: int | None = None
    start: float | None = None
    end: float | None = None
    transfers: tuple[Transfer, ...] = ()


@dataclass(frozen=True, kw_only=True)
class OrderResult:
    decisions: tuple[OrderDecision, ...]
    """Every update once: kept ones in application order, dropped ones where they were dropped."""
    order: tuple[int, ...]
    """Indices of the kept updates, in application order."""
    snapshots: Sequence[NetState] = field(repr=False, compare=False)
    """``snapshots[n]``: the network after the first ``n`` kept updates were reserved (a
    tuple, or :class:`ReplayedSnapshots` when the compiled loop made the result)."""

    def kept(self) -> list[OrderDecision]:
        return [d for d in self.decisions if not d.dropped]

    def by_index(self) -> dict[int, OrderDecision]:
        return {d.index: d for d in self.decisions}


class ReplayedSnapshots(Sequence[NetState]):
    """The snapshots of a compiled ordering, rebuilt on first use: snapshot ``n`` is the
    initial state with the first ``n`` kept transfers applied (:meth:`NetState.apply`, the
    same subtraction the reservation did, so bit-identical). The compiled aggregation never
    needs them; only a Python aggregation of a compiled ordering does."""

    def __init__(self, initial: NetState, kept: Sequence[OrderDecision]) -> None:
        self._initial = initial
        self._kept = kept
        self._built: list[NetState] | None = None

    def __len__(self) -> int:
        return len(self._kept) + 1

    def __getitem__(self, n):  # type: ignore[override]
        if n == 0 or n == -len(self):
            return self._initial
        if self._built is None:
            built = [self._initial]
            for d in self._kept:
                nxt = built[-1].fork()
                for tr in d.transfers:
                    nxt.apply(tr)
                built.append(nxt)
            self._built = built
        return self._built[n]


def transfer_keys(batch: Batch, net: NetState) -> list[float]:
    """Each update's transfer time on the empty path to its servers (the slowest component):
    ``size / min(peak(up), peak(down))``, 0 when local or empty, inf when unreachable."""
    src = np.asarray(batch.src, dtype=np.int64)
    peak_up = net.peak[src * 2][:, None]
    peak_down = net.peak[np.array([2 * h + 1 for h in batch.servers], dtype=np.int64)][None, :]
    rate = np.minimum(peak_up, peak_down)
    local = src[:, None] == np.asarray(batch.servers)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(local | (batch.sizes <= 0), 0.0, batch.sizes / rate)
    t = np.where(np.isnan(t), INF, t)
    keys = t.max(axis=1) if t.shape[1] else np.zeros(batch.n)
    return keys.tolist()


def longest_first(batch: Batch, net: NetState) -> list[int]:
    """MLfabric-S's second list: updates by :func:`transfer_keys` descending (ties: smaller
    index). For a makespan the long transfers, often ones held back by their worker's slow
    NIC, should start first so the others fill the server's link beside them (Graham's
    longest-processing-time rule); shortest-first leaves them alone at the end."""
    keys = transfer_keys(batch, net)
    return sorted(range(batch.n), key=lambda g: (-keys[g], g))


class _Fast:
    """State of one ordering run (the bounds, the remaining updates in key order)."""

    def __init__(self, batch: Batch, net: NetState, start: float) -> None:
        self.batch = batch
        self.start = start
        self.jobs = [batch.job(g) for g in range(batch.n)]
        self.single = len(batch.servers) == 1
        self.server_down = np.array([2 * h + 1 for h in batch.servers])
        self.up = np.asarray(batch.src, dtype=np.int64) * 2
        self.keys = transfer_keys(batch, net)
        self.sorted: list[tuple[float, int]] = sorted(zip(self.keys, range(batch.n)))

    def remove(self, g: int) -> None:
        item = (self.keys[g], g)
        del self.sorted[bisect_left(self.sorted, item)]

    def t_en(self, net: NetState, g: int) -> float:
        if self.single:
            src, dst, size = self.jobs[g][0]
            return net.t_en(src, dst, size, self.start)
        return net.job_t_en(self.jobs[g], self.start)

    def shortest(self, net: NetState, exclude: frozenset[int] | set[int] = frozenset()) -> tuple[float, int]:
        """ShrtUp: (t_en, index) of the remaining update with the smallest t_en on ``net``."""
        base = max(self.start, float(net.first_free[self.server_down].min()))
        ff = net.first_free
        up = self.up
        best, best_g = INF, -1
        for key, g in self.sorted:
            if base + key > best:
                break
            if g in exclude:
                continue
            lb = max(base, ff[up[g]]) + key
            if lb > best:
                continue
            e = self.t_en(net, g)
            if e < best or (e == best and g < best_g):
                best, best_g = e, g
        if best_g < 0:
            # every candidate is unreachable: the smallest index, as the reference's argmin
            best_g = min((g for _, g in self.sorted if g not in exclude), default=-1)
        return best, best_g


def _pick_due(due: list[int], t_en) -> tuple[float, int]:
    best, best_g = INF, -1
    for g in sorted(due):
        e = t_en(g)
        if e < best or (e == best and g < best_g) or best_g < 0:
            best, best_g = e, g
    return best, best_g


def order_updates(batch: Batch, net: NetState, *, start: float = 0.0, native: bool | None = None) -> OrderResult:
    """Alg. 2 (Alg. 1 when ``batch.deadlines`` is None) on a fork of ``net`` (left unchanged).
    ``native``: the compiled loop (None: when built and the batch has one server)."""
    if _native.use(batch, native):
        return _from_native(batch, net, _native.order_raw(batch, net, start=start), float(start))
    fast = _Fast(batch, net, start)
    net = net.fork()
    dl = batch.deadlines
    buckets: dict[int, list[int]] = {}
    if dl is not None:
        for g, d in enumerate(dl):
            buckets.setdefault(int(d), []).append(g)
    alive = set(range(batch.n))
    decisions: list[OrderDecision] = []
    order: list[int] = []
    snapshots = [net]
    p = 1
    # deadlines below 1 are doomed from the start; afterwards p grows by one per kept update,
    # so only the bucket dl == p - 1 can become doomed (no scan of all remaining updates)
    checked = 0
    for g in range(batch.n):
        if dl is not None and dl[g] < 1:
            alive.discard(g)
            fast.remove(g)
            decisions.append(OrderDecision(index=g, dropped=True, reason="doomed"))

    def drop_doomed() -> None:
        nonlocal checked
        if dl is None:
            return
        while checked < p - 1:
            checked += 1
            for g in buckets.get(checked, ()):
                if g in alive:
                    alive.discard(g)
                    fast.remove(g)
                    decisions.append(OrderDecision(index=g, dropped=True, reason="doomed"))

    def due_at(pos: int, skip: int = -1) -> list[int]:
        if dl is None:
            return []
        return [g for g in buckets.get(pos, ()) if g in alive and g != skip]

    while alive:
        drop_doomed()
        if not alive:
            break
        due = due_at(p)
        by_deadline = bool(due)
        if by_deadline:
            e_star, g_star = _pick_due(due, lambda g: fast.t_en(net, g))
        else:
            e_star, g_star = fast.shortest(net)
        alive.discard(g_star)
        fast.remove(g_star)
        if e_star == INF:
            decisions.append(OrderDecision(index=g_star, dropped=True, reason="no-capacity"))
            continue
        nxt = net.fork()
        transfers = nxt.reserve_job(fast.jobs[g_star], start)
        if by_deadline and alive:
            # look-ahead on the fork: who would be applied at p + 1? (updates due at p
            # other than the pick are doomed at p + 1: they cannot be "next")
            doomed_next = set(due) - {g_star}
            due2 = due_at(p + 1)
            if due2:
                e_next, g_next = _pick_due(due2, lambda g: fast.t_en(nxt, g))
            elif len(alive) > len(doomed_next):
                e_next, g_next = fast.shortest(nxt, doomed_next)
            else:
                g_next = -1
            if g_next >= 0 and e_star > e_next:
                decisions.append(OrderDecision(index=g_star, dropped=True, reason="look-ahead"))
                continue
        begin = min((tr.begin for tr in transfers), default=start)
        decisions.append(OrderDecision(index=g_star, dropped=False, position=p, start=begin, end=e_star,
                                       transfers=transfers))
        order.append(g_star)
        net = nxt
        snapshots.append(net)
        p += 1
    return OrderResult(decisions=tuple(decisions), order=tuple(order), snapshots=tuple(snapshots))


def list_order(batch: Batch, net: NetState, order: Sequence[int], *, start: float = 0.0,
               native: bool | None = None) -> OrderResult:
    """The updates of ``order`` reserved straight to the server(s) in that order (positions
    1, 2, ...; one that cannot complete is dropped as ``no-capacity``), with the snapshots."""
    if _native.use(batch, native):
        return _from_native(batch, net, _native.list_order_raw(batch, net, order, start=start), float(start))
    if sorted(order) != sorted(set(order)) or any(not 0 <= g < batch.n for g in order):
        raise ValueError("order must list distinct update indices")
    net = net.fork()
    snapshots = [net]
    decisions: list[OrderDecision] = []
    kept: list[int] = []
    for g in order:
        job = batch.job(g)
        end = net.job_t_en(job, start)
        if end == INF:
            decisions.append(OrderDecision(index=g, dropped=True, reason="no-capacity"))
            continue
        net = net.fork()
        transfers = net.reserve_job(job, start)
        kept.append(g)
        decisions.append(OrderDecision(index=g, dropped=False, position=len(kept),
                                       start=min((tr.begin for tr in transfers), default=start), end=end,
                                       transfers=transfers))
        snapshots.append(net)
    return OrderResult(decisions=tuple(decisions), order=tuple(kept), snapshots=tuple(snapshots))


def _from_native(batch: Batch, net: NetState, raw: list, start: float) -> OrderResult:
    """The compiled loop's raw decisions (:mod:`~mlfabric.ps.scheduler.native`) as an OrderResult."""
    server = batch.servers[0]
    src = batch.src
    sizes = batch.sizes[:, 0].tolist()
    decisions = []
    order = []
    kept = []
    for g, kind, pos, end, begin, pt, pr in raw:
        if kind:
            decisions.append(OrderDecision(index=g, dropped=True, reason=_native.REASONS[kind]))
            continue
        # NetState.reserve's Transfer: a local or empty one ends at its start with no segments
        tr = Transfer(src[g], server, sizes[g], start, end if pt else start, pt, pr)
        d = OrderDecision(index=g, dropped=False, position=pos, start=begin, end=end, transfers=(tr,))
        decisions.append(d)
        kept.append(d)
        order.append(g)
    return OrderResult(decisions=tuple(decisions), order=tuple(order),
                       snapshots=ReplayedSnapshots(net.fork(), kept))
