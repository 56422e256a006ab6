"""The scheduler's network model: per-link residual capacity over time (MLfabric Fig. 4).

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q -k netstate

Hosts hang off a congestion-free core (a star): host ``h`` has an up link (NIC out, link id
``2h``) and a down link (NIC in, link id ``2h + 1``), each with its own capacity in
**bytes per second**, constant or a piecewise-constant forecast (what a network monitor
reports). A transfer from ``src`` to ``dst`` crosses ``up(src)`` and ``down(dst)``; a transfer
inside one host (``src == dst``, e.g. a worker's update to the aggregator on its own host)
crosses nothing and takes no time.

Every link's residual capacity is a piecewise-constant timeline: breakpoints ``times`` (the
first is the origin, the batch's "now") and ``rates`` (``rates[j]`` holds on
``[times[j], times[j+1])``, the last one forever). Two operations, as in the paper:

* :meth:`NetState.t_en` (Fig. 4b): the completion time of ``size`` bytes from ``src`` to
  ``dst`` starting no earlier than ``start``, sending at every instant at the path's residual
  bottleneck rate (``min`` of the two links), i.e. as fast as the network allows;
* :meth:`NetState.reserve` (NetUp, Fig. 4c): the same walk, recording that rate profile, then
  subtracting it from both links of the path; returns the :class:`Transfer` (its schedule).

A *job* is several such transfers reserved together (MLfabric §10.2: one update's
components to several servers, eq. 18): they are reserved one after the other on the shared
state and the job completes at the latest of them (:meth:`NetState.job_t_en`,
:meth:`NetState.reserve_job`).

Why the representation is per-link Python lists and not one time x link numpy matrix: a
reservation adds breakpoints to two links only, and a global grid would make every insert
copy all links (L x K floats, tens of MB at 1,000 updates); with per-link lists an update
costs the length of two timelines, which stay short because a transfer uses *all* of its
bottleneck, so the bottleneck's residual drops to zero over the transfer and neighbouring
zero segments merge (:func:`_subtract` compacts). The vectorised part is across candidates:
:attr:`NetState.first_free` and :attr:`NetState.peak` (numpy, per link) give every candidate a
lower bound on its ``t_en`` in one numpy expression, so the ordering code evaluates the exact
walk for a handful of candidates per step instead of all of them (see ``ordering.py``).

States are cheap to fork and never shared mutably: :meth:`NetState.fork` copies the list of
per-link timelines (pointers) and the two stat arrays; a reservation *replaces* the two
touched timelines with new lists, so a fork taken earlier is an exact, bit-identical snapshot
(the aggregation step restarts from the ordering step's snapshots; no float "undo").
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import chain
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["INF", "Component", "NetState", "Transfer", "down_link", "up_link"]

INF = math.inf

Component = tuple[int, int, float]
"""One transfer of a job: ``(src host, dst host, size in bytes)``."""


def up_link(host: int) -> int:
    return 2 * host


def down_link(host: int) -> int:
    return 2 * host + 1


@dataclass(frozen=True, slots=True)
class Transfer:
    """A reserved transfer: ``size`` bytes from ``src`` to ``dst`` at ``rates[j]`` bytes/s on
    ``[times[j], times[j+1])`` (the last segment ends at ``end``). ``start`` is the earliest
    start asked for; ``times[0]`` is when bytes first move (later if the path was full)."""

    src: int
    dst: int
    size: float
    start: float
    end: float
    times: tuple[float, ...]
    rates: tuple[float, ...]

    @property
    def begin(self) -> float:
        return self.times[0] if self.times else self.end

    def bytes_sent(self) -> float:
        """Integral of the rate profile (equals ``size`` up to float rounding)."""
        edges = (*self.times[1:], self.end)
        return float(sum(r * (b - a) for a, b, r in zip(self.times, edges, self.rates)))

    def rate_at(self, t: float) -> float:
        if not self.times or t < self.times[0] or t >= self.end:
            return 0.0
        return self.rates[bisect_right(self.times, t) - 1]


def _walk(ta: list[float], ra: list[float], tb: list[float], rb: list[float], size: float, start: float,
          record: bool) -> tuple[float, list[float], list[float]]:
    """Send ``size`` bytes from ``start`` at ``min(ra, rb)``: the completion time, and when
    ``record`` the rate profile (segments from the first positive rate on, equal neighbours
    merged). One function for both so ``t_en`` and ``reserve`` agree to the last bit."""
    ia = bisect_right(ta, start) - 1
    ib = bisect_right(tb, start) - 1
    if ia < 0 or ib < 0:
        raise ValueError(f"start {start} is before the network state's origin {max(ta[0], tb[0])}")
    na_len, nb_len = len(ta), len(tb)
    t = start
    rem = size
    pt: list[float] = []
    pr: list[float] = []
    while True:
        na = ta[ia + 1] if ia + 1 < na_len else INF
        nb = tb[ib + 1] if ib + 1 < nb_len else INF
        nxt = na if na < nb else nb
        x, y = ra[ia], rb[ib]
        r = x if x < y else y
        if record and (pt or r > 0.0) and (not pr or pr[-1] != r):
            pt.append(t)
            pr.append(r)
        if r > 0.0:
            if nxt == INF:
                return t + rem / r, pt, pr
            chunk = r * (nxt - t)
            if chunk >= rem:
                return t + rem / r, pt, pr
            rem -= chunk
        elif nxt == INF:
            return INF, pt, pr
        t = nxt
        if na == nxt:
            ia += 1
        if nb == nxt:
            ib += 1


def _subtract(tl: list[float], rl: list[float], pt: list[float], pr: list[float],
              end: float) -> tuple[list[float], list[float]]:
    """The link timeline minus a rate profile on ``[pt[0], end)``, equal neighbours merged.

    The profile's rate in each of its segments is the minimum of the path's links there, so
    ``link - profile`` is exact and never negative (one operand is the other or smaller)."""
    t = pt[0]
    i = bisect_right(tl, t) - 1
    out_t = tl[:i]
    out_r = rl[:i]
    if tl[i] < t:
        out_t.append(tl[i])
        out_r.append(rl[i])
    n_l, n_p = len(tl), len(pt)
    j = 0
    while t < end:
        nl = tl[i + 1] if i + 1 < n_l else INF
        np_ = pt[j + 1] if j + 1 < n_p else end
        nxt = nl if nl < np_ else np_
        v = rl[i] - pr[j]
        if not out_r or out_r[-1] != v:
            out_t.append(t)
            out_r.append(v)
        t = nxt
        if nl == nxt:
            i += 1
        if np_ == nxt:
            j += 1
    if end < INF:
        v = rl[i]
        if not out_r or out_r[-1] != v:
            out_t.append(end)
            out_r.append(v)
        for k in range(i + 1, n_l):
            if out_r[-1] != rl[k]:
                out_t.append(tl[k])
                out_r.append(rl[k])
    return out_t, out_r


def _stats(tl: list[float], rl: list[float]) -> tuple[float, float]:
    """(first time with positive residual, peak residual) of one link timeline."""
    first = INF
    for t, r in zip(tl, rl):
        if r > 0.0:
            first = t
            break
    return first, max(rl)


class NetState:
    """Residual capacity timelines of every host's up and down link (module docstring)."""

    __slots__ = ("n_hosts", "origin", "times", "rates", "first_free", "peak")

    def __init__(self, up: Sequence[float] | np.ndarray, down: Sequence[float] | np.ndarray, *,
                 origin: float = 0.0) -> None:
        up_a = np.asarray(up, dtype=float)
        down_a = np.asarray(down, dtype=float)
        if up_a.ndim != 1 or up_a.shape != down_a.shape or up_a.size == 0:
            raise ValueError(f"up and down must be equal-length 1-d capacity lists, got {up_a.shape} and {down_a.shape}")
        if not (np.all(np.isfinite(up_a)) and np.all(np.isfinite(down_a))) or (up_a < 0).any() or (down_a < 0).any():
            raise ValueError("link capacities must be finite and >= 0 (bytes/s)")
        self.n_hosts = int(up_a.size)
        self.origin = float(origin)
        caps = np.empty(2 * self.n_hosts)
        caps[0::2] = up_a
        caps[1::2] = down_a
        self.times: list[list[float]] = [[self.origin] for _ in range(caps.size)]
        self.rates: list[list[float]] = [[float(c)] for c in caps]
        self.first_free = np.where(caps > 0, self.origin, INF)
        self.peak = caps.copy()

    # ------------------------------------------------------------------ construction

    @classmethod
    def star(cls, n_hosts: int, capacity: float, *, origin: float = 0.0) -> "NetState":
        """Every NIC (in and out) at ``capacity`` bytes/s."""
        return cls([capacity] * n_hosts, [capacity] * n_hosts, origin=origin)

    def set_timeline(self, link: int, times: Sequence[float], rates: Sequence[float]) -> None:
        """Replace one link's residual capacity by a piecewise-constant forecast
        (``times[0]`` must be the origin, times strictly increasing, rates >= 0)."""
        tl = [float(t) for t in times]
        rl = [float(r) for r in rates]
        if not tl or len(tl) != len(rl) or tl[0] != self.origin:
            raise ValueError(f"link {link}: times must start at the origin {self.origin} and match rates")
        if any(b <= a for a, b in zip(tl, tl[1:])) or any(not (0 <= r < INF) for r in rl):
            raise ValueError(f"link {link}: times must increase strictly and rates be finite and >= 0")
        ct, cr = [tl[0]], [rl[0]]
        for t, r in zip(tl[1:], rl[1:]):
            if r != cr[-1]:
                ct.append(t)
                cr.append(r)
        self.times[link] = ct
        self.rates[link] = cr
        self.first_free[link], self.peak[link] = _stats(ct, cr)

    def fork(self) -> "NetState":
        """An independent state sharing the (never mutated) timelines."""
        new = NetState.__new__(NetState)
        new.n_hosts = self.n_hosts
        new.origin = self.origin
        new.times = list(self.times)
        new.rates = list(self.rates)
        new.first_free = self.first_free.copy()
        new.peak = self.peak.copy()
        return new

    # ------------------------------------------------------------------ queries

    def residual(self, link: int, t: float) -> float:
        tl = self.times[link]
        if t < tl[0]:
            raise ValueError(f"time {t} is before the origin {tl[0]}")
        return self.rates[link][bisect_right(tl, t) - 1]

    def timeline(self, link: int) -> tuple[list[float], list[float]]:
        return list(self.times[link]), list(self.rates[link])

    def capacity_integral(self, link: int, t0: float, t1: float) -> float:
        """Bytes the link can still carry on ``[t0, t1]``."""
        if t1 <= t0:
            return 0.0
        tl, rl = self.times[link], self.rates[link]
        i = max(bisect_right(tl, t0) - 1, 0)
        total = 0.0
        t = max(t0, tl[0])
        while t < t1:
            nxt = tl[i + 1] if i + 1 < len(tl) else INF
            seg_end = nxt if nxt < t1 else t1
            total += rl[i] * (seg_end - t)
            t = seg_end
            i += 1
        return total

    def t_en(self, src: int, dst: int, size: float, start: float) -> float:
        """Completion time of ``size`` bytes ``src -> dst`` from ``start`` (Fig. 4b)."""
        if src == dst or size <= 0.0:
            return start
        a, b = 2 * src, 2 * dst + 1
        return _walk(self.times[a], self.rates[a], self.times[b], self.rates[b], size, start, False)[0]

    def lower_bound(self, src: int, dst: int, size: float, start: float) -> float:
        """A cheap bound ``<= t_en``: nothing moves before both links have residual, and
        nothing moves faster than the smaller of their peaks."""
        if src == dst or size <= 0.0:
            return start
        a, b = 2 * src, 2 * dst + 1
        rate = min(self.peak[a], self.peak[b])
        if rate <= 0.0:
            return INF
        return max(start, self.first_free[a], self.first_free[b]) + size / rate

    # ------------------------------------------------------------------ reservations

    def reserve(self, src: int, dst: int, size: float, start: float) -> Transfer:
        """NetUp (Fig. 4c): reserve the ``t_en`` profile on both links; returns its schedule."""
        if src == dst or size <= 0.0:
            return Transfer(src, dst, float(size), start, start, (), ())
        a, b = 2 * src, 2 * dst + 1
        end, pt, pr = _walk(self.times[a], self.rates[a], self.times[b], self.rates[b], size, start, True)
        if end == INF:
            raise ValueError(f"transfer {src}->{dst} of {size} bytes never completes: the path has no capacity left")
        tr = Transfer(src, dst, float(size), start, end, tuple(pt), tuple(pr))
        self.apply(tr)
        return tr

    def apply(self, tr: Transfer) -> None:
        """Subtract an already computed schedule (one :meth:`reserve` returned on an identical
        state) from both links of its path: the state becomes exactly what that reservation
        left (the compiled ordering hands back schedules; snapshots are rebuilt from them)."""
        if tr.src == tr.dst or not tr.times:
            return
        for link in (2 * tr.src, 2 * tr.dst + 1):
            tl, rl = _subtract(self.times[link], self.rates[link], list(tr.times), list(tr.rates), tr.end)
            self.times[link] = tl
            self.rates[link] = rl
            self.first_free[link], self.peak[link] = _stats(tl, rl)

    def to_csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every link's timeline in CSR form for the compiled kernel (``_sched.c``):
        ``(link_ptr, times, rates)``, link ``l``'s breakpoints at ``link_ptr[l]:link_ptr[l+1]``."""
        lens = np.fromiter(map(len, self.times), dtype=np.int64, count=len(self.times))
        ptr = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=ptr[1:])
        total = int(ptr[-1])
        times = np.fromiter(chain.from_iterable(self.times), dtype=float, count=total)
        rates = np.fromiter(chain.from_iterable(self.rates), dtype=float, count=total)
        return ptr, times, rates

    def job_t_en(self, comps: Sequence[Component], start: float) -> float:
        """Completion of a job (its components reserved one after the other, eq. 18), without
        changing this state: only the links two components share need a scratch copy."""
        if len(comps) == 1:
            src, dst, size = comps[0]
            return self.t_en(src, dst, size, start)
        scratch: dict[int, tuple[list[float], list[float]]] = {}
        worst = start
        last = len(comps) - 1
        for k, (src, dst, size) in enumerate(comps):
            if src == dst or size <= 0.0:
                continue
            a, b = 2 * src, 2 * dst + 1
            ta, ra = scratch.get(a) or (self.times[a], self.rates[a])
            tb, rb = scratch.get(b) or (self.times[b], self.rates[b])
            end, pt, pr = _walk(ta, ra, tb, rb, size, start, k < last)
            if end == INF:
                return INF
            worst = max(worst, end)
            if k < last:
                scratch[a] = _subtract(ta, ra, pt, pr, end)
                scratch[b] = _subtract(tb, rb, pt, pr, end)
        return worst

    def reserve_job(self, comps: Sequence[Component], start: float) -> tuple[Transfer, ...]:
        return tuple(self.reserve(src, dst, size, start) for src, dst, size in comps)

    def job_lower_bound(self, comps: Sequence[Component], start: float) -> float:
        return max((self.lower_bound(s, d, z, start) for s, d, z in comps), default=start)

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Raise if a timeline is malformed or a residual is negative (used by the tests)."""
        for link, (tl, rl) in enumerate(zip(self.times, self.rates)):
            if tl[0] != self.origin or len(tl) != len(rl):
                raise AssertionError(f"link {link}: bad timeline head")
            if any(b <= a for a, b in zip(tl, tl[1:])):
                raise AssertionError(f"link {link}: times not increasing: {tl}")
            if min(rl) < 0.0:
                raise AssertionError(f"link {link}: negative residual {min(rl)}")
