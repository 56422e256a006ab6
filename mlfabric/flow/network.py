"""A mutable set of flows on capacitated links whose max-min rates are kept up to date.

:class:`FlowNetwork` is what an event engine (``mlfabric.sim``) or the parameter-server
scheduler holds: flows come and go (``add_flows`` / ``remove_flows``, in batches, e.g. all
flows that finish at the same instant), link capacities change (``set_capacity``, from a
capacity trace), per-flow caps change (``set_caps``); ``rates()`` re-solves lazily, once per
batch of changes.

Re-solving only what changed: progressive filling freezes flows in increasing order of rate,
and a change can only alter the process from some level ``T`` on:

* removing a flow: ``T`` = its old rate;
* lowering link ``l``'s capacity to ``c'`` below its current load: ``T >= c' / W_l`` (``W_l``
  = total weight on ``l``); raising the capacity of a saturated link: ``T >= load_l / W_l``
  (its saturation level is at least the average rate on it); other capacity changes: none;
* adding flows: ``T >= min over their links of c_l / W_l`` (with the new flows counted in
  ``W_l``): below that level none of their links can fill, so nothing else can change;
* changing a cap: like removing and re-adding the flow.

Every flow whose old rate is below ``T`` keeps it; only the others are re-solved, on the
capacity the kept flows leave. When most flows would be re-solved anyway, a full solve is
done instead.

The compiled kernel narrows that further (``reach``): a change travels along the bottleneck
structure only. A changed link changes the flows *tight* on it (at its share, the largest
rate on it); a flow whose rate changes changes the saturated links it crosses; nothing else
moves. On the 624 x 400 parameter-server run that is a fifth of the flows at or above ``T``.
The kept flows are checked, on every link where a re-solved flow saturates, not to be faster
than it; those that are join the re-solved flows, with the flows tight on their links, and
the filling runs again (``reach_grows``); after a few rounds every flow at or above ``T`` is
re-solved (``reach_fallbacks``).

Either way the result is the exact max-min allocation (tests compare with a from-scratch
solve and check the certificate after random change sequences).

The re-solve runs in a compiled kernel (``_fill.c``: gather, heap-based progressive filling,
loads and the sorted suffix in one call) when the optional extension is built, else with
numpy (``solve_max_min``); ``native=`` picks one. Both give the same allocation up to the tie
tolerance.

Flow ids are small integers handed out by ``add_flows``; the id of a removed flow may be
reused by a later ``add_flows``.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q -k network
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlfabric.flow.certificate import CertificateReport, check_certificate
from mlfabric.flow.incidence import Incidence
from mlfabric.flow.maxmin import DEFAULT_TIE_RTOL, solve_max_min, validate_capacity

try:  # the compiled re-solve (setup.py builds it when a C compiler is there)
    from mlfabric.flow import _fill
except ImportError:  # pragma: no cover - depends on the install
    _fill = None

__all__ = ["FlowNetwork", "UpdateStats"]

# Above this fraction of flows to re-solve, a full solve is cheaper than the bookkeeping (numpy
# path; the compiled path's fraction is FlowNetwork._full_solve_fraction_native).
_FULL_SOLVE_FRACTION = 0.6
# With the reach, updates adding at most this many flows (and <= 1% of the live ones) are
# never solved in full (see update).
_REACH_ONLY_NEW = 64
# Row width of the packed link lists the compiled kernel reads (must match PACKED in _fill.c):
# a count, then up to _PACKED - 1 link ids, one cache line per flow.
_PACKED = 8
# A link whose load is within this relative distance of its capacity counts as saturated
# when deciding whether a capacity increase matters (false positives only cost time).
_SATURATION_SLACK = 1e-7


@dataclass(frozen=True, kw_only=True)
class UpdateStats:
    """What the last :meth:`FlowNetwork.update` did."""

    #: "none" (nothing re-solved), "partial" (only flows at or above the divergence level) or "full".
    kind: str
    flows_total: int
    flows_resolved: int
    divergence_level: float
    #: Times the compiled re-solve put a left-out slack link back and redid its filling.
    slack_retries: int = 0
    #: Times the compiled re-solve's reach (only the flows a change can reach) failed its
    #: check and, after growing, gave up (REACH_MAX_GROWS rounds, nothing new found, or 80% of
    #: the candidates reached anyway), so every flow at or above the divergence level was
    #: re-solved.
    reach_fallbacks: int = 0
    #: Times the reach's check found kept flows faster than a new bottleneck and the filling
    #: ran again with them (and the flows tight on their links) re-solved too.
    reach_grows: int = 0
    #: Candidates (flows at or above the divergence level) the compiled reach read: those in
    #: the rate bands of changed links (all of them without the reach).
    candidates_read: int = 0


class FlowNetwork:
    """Flows over links with capacities; ``rates()`` returns their max-min fair rates."""

    # Class attributes the engine's compiled loop (_fill.run_events) reads too, so that its
    # updates follow the same rules as update().
    #: The entry array is compacted once more than half of it, and more than this many
    #: entries, belong to removed flows.
    _compact_min_dead = 1 << 16
    #: Flows whose old rate is within this relative distance of the divergence level are
    #: re-solved rather than kept: keeps rounding on a tie from splitting a batch.
    _keep_margin = 1e-9
    #: The compiled path solves in full above this fraction of flows to re-solve: its
    #: bookkeeping is cheap, and a partial re-solve can leave slack links out, which a full
    #: one cannot, so it solves in full only when (nearly) everything moves.
    _full_solve_fraction_native = 0.95

    def __init__(
        self,
        link_capacity: np.ndarray | list[float],
        *,
        tie_rtol: float = DEFAULT_TIE_RTOL,
        incremental: bool = True,
        native: bool | None = None,
        reach: bool = True,
    ) -> None:
        capacity = np.asarray(link_capacity, dtype=np.float64)
        self._capacity = validate_capacity(capacity, capacity.size).copy()
        self.n_links = int(capacity.size)
        self.tie_rtol = tie_rtol
        #: False: every update is a full solve (for comparisons and debugging).
        self.incremental = incremental
        if native and _fill is None:
            raise RuntimeError("native=True but mlfabric.flow._fill is not built (reinstall with a C compiler)")
        #: Re-solve with the compiled kernel (``_fill.c``; default: when it is built) or with
        #: numpy (``solve_max_min``): the same allocation up to ``tie_rtol``.
        self.native = _fill is not None if native is None else native
        #: Compiled path: a partial re-solve takes only the flows a change can reach along the
        #: bottleneck structure (False: every flow at or above the divergence level).
        self.reach = reach
        # Scratch of the kernel: -1 for every link between calls.
        self._link_map = np.full(self.n_links, -1, dtype=np.int32)
        # Per-flow slots (grown by doubling; freed slots are reused).
        self._slots = 0
        self._start = np.zeros(0, dtype=np.int64)
        self._length = np.zeros(0, dtype=np.int64)
        # The same links again, one row per slot (count -1: longer than a row), for the
        # compiled kernel: one cache line instead of three scattered reads per flow.
        self._packed = np.full((0, _PACKED), -1, dtype=np.int32)
        self._cap = np.zeros(0)
        self._any_cap = False  # some flow ever had a finite cap (the kernel skips caps otherwise)
        self._rate = np.zeros(0)  # NaN exactly where not solved (the compiled kernel relies on it)
        self._alive = np.zeros(0, dtype=bool)
        self._solved = np.zeros(0, dtype=bool)
        self._free: list[np.ndarray] = []
        self._n_alive = 0
        # Solved flows sorted by rate at their last solve (may hold ids of since-removed or
        # reused flows; they are filtered when read): the flows at or above a divergence
        # level are a suffix, found by binary search instead of a pass over all flows.
        # They live in the first ``_order_n`` slots of preallocated buffers, so a partial
        # update rewrites only the suffix it re-solved (no O(all flows) copy per update).
        self._order = np.zeros(0, dtype=np.int64)
        self._order_rates = np.zeros(0)
        self._order_n = 0
        # Reusable per-slot scratch for de-duplicating id arrays (see _distinct).
        self._scratch = np.zeros(0, dtype=np.int64)
        #: Ids whose rates may have changed in the last update (the re-solved flows; the
        #: compiled kernel lists only those whose rate is new or differs): an event engine
        #: only needs to recompute finish times for these.
        self.last_resolved = np.zeros(0, dtype=np.int64)
        self._last_rates: np.ndarray | None = None  # their rates, when the compiled kernel listed them
        # Entry storage (append-only, compacted when mostly garbage).
        self._entries = 0
        self._dead_entries = 0
        self._links = np.zeros(0, dtype=np.int64)
        self._weights = np.zeros(0)
        self._unit_weights = True
        # Per-link aggregates over alive flows.
        self._weight_sum = np.zeros(self.n_links)
        self._load = np.zeros(self.n_links)  # of solved flows at their current rates
        # Links a flow left, or whose capacity changed, since the last update: their load is
        # no guide to whether they are saturated (the compiled re-solve keeps them in).
        self._perturbed = np.zeros(self.n_links, dtype=np.uint8)
        # Per link, for the compiled re-solve's reach: the largest rate on it where saturated
        # (its share), inf where not, 0 where unknown (a changed capacity; before any solve).
        self._share = np.zeros(self.n_links)
        self._caps_changed = False  # a flow's cap changed since the last update (no reach then)
        self._capacity_changed = False  # a link capacity changed since the last update (see update)
        # Pending changes.
        self._divergence = np.inf
        self._pending_new: list[np.ndarray] = []
        self._dirty = False
        self.last_update = UpdateStats(kind="none", flows_total=0, flows_resolved=0, divergence_level=np.inf)

    # ------------------------------------------------------------------ storage helpers

    def _grow_slots(self, needed: int) -> None:
        if needed <= self._start.size:
            return
        size = max(needed, 2 * self._start.size, 64)
        for name, fill in (("_start", 0), ("_length", 0), ("_cap", np.inf), ("_rate", np.nan), ("_alive", False), ("_solved", False)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
        packed = np.full((size, _PACKED), -1, dtype=np.int32)
        packed[: self._packed.shape[0]] = self._packed
        self._packed = packed

    def _grow_entries(self, needed: int) -> None:
        if needed <= self._links.size:
            return
        size = max(needed, 2 * self._links.size, 256)
        links = np.zeros(size, dtype=np.int64)
        links[: self._entries] = self._links[: self._entries]
        weights = np.zeros(size)
        weights[: self._entries] = self._weights[: self._entries]
        self._links, self._weights = links, weights

    def _compact_entries(self) -> None:
        ids = self.flow_ids()
        incidence = self._incidence_of(ids)
        self._links = incidence.links.copy()
        self._weights = incidence.weight_array().copy()
        self._entries = incidence.nnz
        self._dead_entries = 0
        self._start[ids] = incidence.indptr[:-1]

    def _entry_positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts = self._start[ids]
        lengths = self._length[ids]
        indptr = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        positions = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1], dtype=np.int64)
        return positions, indptr

    def _incidence_of(self, ids: np.ndarray) -> Incidence:
        positions, indptr = self._entry_positions(ids)
        weights = None if self._unit_weights else self._weights[positions]
        return Incidence(indptr=indptr, links=self._links[positions], weights=weights, n_links=self.n_links)

    def _check_ids(self, ids: np.ndarray | list[int] | int, what: str, *, distinct: bool = False) -> np.ndarray:
        array = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        if array.size == 0:
            return array
        bad = (array < 0) | (array >= self._slots)
        if not bad.any():
            bad = ~self._alive[array]
        if bad.any():
            raise ValueError(f"{what}: flow id {int(array[np.flatnonzero(bad)[0]])} is not a live flow of this FlowNetwork")
        if distinct:
            # O(n) repeat test (np.unique would sort): the last write of each id wins.
            order = np.arange(array.size)
            scratch = self._scratch_for_slots()
            scratch[array] = order
            if not np.array_equal(scratch[array], order):
                raise ValueError(f"{what}: flow ids must not repeat")
        return array

    # ------------------------------------------------------------------ public: inspection

    @property
    def n_flows(self) -> int:
        return self._n_alive

    def flow_ids(self) -> np.ndarray:
        """Ids of the live flows, ascending."""
        return np.flatnonzero(self._alive[: self._slots])

    def capacity(self) -> np.ndarray:
        return self._capacity.copy()

    def incidence(self, ids: np.ndarray | None = None) -> Incidence:
        """Incidence of the given live flows (default: all, in :meth:`flow_ids` order)."""
        ids = self.flow_ids() if ids is None else self._check_ids(ids, "incidence")
        return self._incidence_of(ids)

    def caps(self, ids: np.ndarray | None = None) -> np.ndarray:
        ids = self.flow_ids() if ids is None else self._check_ids(ids, "caps")
        return self._cap[ids].copy()

    # ------------------------------------------------------------------ public: changes

    def add_flows(self, incidence: Incidence, caps: np.ndarray | list[float] | None = None) -> np.ndarray:
        """Add the incidence's flows (optionally with per-flow caps); returns their ids."""
        if incidence.n_links != self.n_links:
            raise ValueError(f"incidence is over {incidence.n_links} links, this FlowNetwork has {self.n_links}")
        n = incidence.n_flows
        cap_array = np.full(n, np.inf) if caps is None else np.asarray(caps, dtype=np.float64)
        if cap_array.shape != (n,) or np.isnan(cap_array).any() or (cap_array < 0).any():
            raise ValueError(f"caps must be {n} values >= 0 (inf for none)")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        # Reuse freed slots first, then grow.
        reused = np.zeros(0, dtype=np.int64)
        if self._free:
            pool = np.concatenate(self._free)
            reused, rest = pool[:n], pool[n:]
            self._free = [rest] if rest.size else []
        fresh = np.arange(self._slots, self._slots + n - reused.size, dtype=np.int64)
        ids = np.concatenate([reused, fresh])
        self._slots += fresh.size
        self._grow_slots(self._slots)
        self._grow_entries(self._entries + incidence.nnz)

        self._links[self._entries : self._entries + incidence.nnz] = incidence.links
        self._weights[self._entries : self._entries + incidence.nnz] = incidence.weight_array()
        if incidence.weights is not None and not np.all(incidence.weights == 1.0):
            self._unit_weights = False
        self._start[ids] = self._entries + incidence.indptr[:-1]
        lengths = incidence.lengths()
        self._length[ids] = lengths
        self._pack_links(ids, incidence, lengths)
        self._entries += incidence.nnz
        self._cap[ids] = cap_array
        self._any_cap = self._any_cap or bool(np.isfinite(cap_array).any())
        self._rate[ids] = np.nan
        self._alive[ids] = True
        self._n_alive += n
        self._solved[ids] = False
        self._weight_sum += incidence.link_weight_sum()
        self._pending_new.append(ids)
        self._dirty = True
        return ids

    def _pack_links(self, ids: np.ndarray, incidence: Incidence, lengths: np.ndarray) -> None:
        """Fill the packed rows of new flows ``ids`` (count -1 where a row is too short)."""
        fits = lengths < _PACKED
        self._packed[ids, 0] = np.where(fits, lengths, -1)
        flows = incidence.entry_flows()
        keep = fits[flows]
        column = np.arange(incidence.nnz, dtype=np.int64) - incidence.indptr[:-1][flows]
        self._packed[ids[flows[keep]], 1 + column[keep]] = incidence.links[keep]

    def remove_flows(self, ids: np.ndarray | list[int] | int) -> None:
        """Remove flows (e.g. all that finished at this instant: one batch, one re-solve)."""
        if self.native:
            ids = np.ascontiguousarray(np.atleast_1d(np.asarray(ids, dtype=np.int64)))
            if ids.size == 0:
                return
            lowest, dead = _fill.remove(ids, self._start, self._length, self._links, self._weights, self._rate,
                                        self._solved, self._alive, self._weight_sum, self._load, self._perturbed,
                                        self._unit_weights)
            self._forget(ids, lowest, dead)
            return
        ids = self._check_ids(ids, "remove_flows", distinct=True)
        if ids.size == 0:
            return
        positions, indptr = self._entry_positions(ids)
        links = self._links[positions]
        weights = self._weights[positions]
        self._weight_sum -= np.bincount(links, weights=weights, minlength=self.n_links)
        self._perturbed[links] = 1
        solved = self._solved[ids]
        lowest = np.inf
        if solved.any():
            rates = self._rate[ids]
            entry_rates = np.repeat(np.where(solved, rates, 0.0), np.diff(indptr))
            finite = np.isfinite(entry_rates)
            self._load -= np.bincount(links[finite], weights=(weights * entry_rates)[finite], minlength=self.n_links)
            lowest = float(rates[solved].min())
        self._alive[ids] = False
        self._solved[ids] = False
        self._rate[ids] = np.nan
        self._forget(ids, lowest, int(self._length[ids].sum()))

    def _forget(self, ids: np.ndarray, lowest_rate: float, dead_entries: int) -> None:
        """The rest of removing ``ids`` (already dead, their load off): free their slots, and
        re-solve from their lowest rate on."""
        self._divergence = min(self._divergence, lowest_rate)
        self._n_alive -= ids.size
        self._dead_entries += dead_entries
        self._dirty = True
        self.adopt_removed(ids)

    def adopt_removed(self, ids: np.ndarray) -> None:
        """Free the slots of flows removed by compiled code (the event engine's loop,
        ``_fill.run_events``, which did the rest of :meth:`remove_flows` and the updates
        after it, so :attr:`last_update` and :attr:`last_resolved` describe the last update
        made from Python); compact the entry array when it is mostly dead."""
        if ids.size:
            self._free.append(ids.copy())
        if self._dead_entries > max(self._entries // 2, self._compact_min_dead):
            self._compact_entries()

    @property
    def slot_capacity(self) -> int:
        """Room for flow slots (the per-slot arrays' length): every flow id is below it."""
        return int(self._start.size)

    def set_capacity(self, links: np.ndarray | list[int] | int, capacity: np.ndarray | list[float] | float) -> None:
        """Change link capacities (bit/s); e.g. one change point of a capacity trace."""
        link_array = np.atleast_1d(np.asarray(links, dtype=np.int64))
        values = np.broadcast_to(np.asarray(capacity, dtype=np.float64), link_array.shape).copy()
        if link_array.size and (link_array.min() < 0 or link_array.max() >= self.n_links):
            raise ValueError(f"link ids must be in [0, {self.n_links})")
        if np.isnan(values).any() or (values < 0).any():
            raise ValueError("capacities must be >= 0 (inf allowed)")
        for link, new in zip(link_array.tolist(), values.tolist()):
            old = self._capacity[link]
            if new == old:
                continue
            self._capacity[link] = new
            self._capacity_changed = True
            self._perturbed[link] = 1
            self._share[link] = 0.0
            self._dirty = True
            weight = self._weight_sum[link]
            load = self._load[link]
            if weight <= 0:
                continue  # nobody uses the link
            if new < old:
                # From inf, flows at rate inf may cross the link (their load is not in _load).
                if old == np.inf or new < load * (1.0 + _SATURATION_SLACK):
                    self._divergence = min(self._divergence, new / weight)
            elif load >= old * (1.0 - _SATURATION_SLACK):
                self._divergence = min(self._divergence, load / weight)

    def set_caps(self, ids: np.ndarray | list[int] | int, caps: np.ndarray | list[float] | float) -> None:
        """Change per-flow rate caps (inf for none)."""
        ids = self._check_ids(ids, "set_caps", distinct=True)
        values = np.broadcast_to(np.asarray(caps, dtype=np.float64), ids.shape).copy()
        if np.isnan(values).any() or (values < 0).any():
            raise ValueError("caps must be >= 0 (inf for none)")
        for flow, new in zip(ids.tolist(), values.tolist()):
            old = self._cap[flow]
            if new == old:
                continue
            self._cap[flow] = new
            self._any_cap = self._any_cap or new < np.inf
            self._dirty = True
            self._caps_changed = True
            if not self._solved[flow]:
                continue
            rate = self._rate[flow]
            if new < rate:
                self._divergence = min(self._divergence, new)
            elif rate >= old * (1.0 - _SATURATION_SLACK):
                self._divergence = min(self._divergence, rate)

    # ------------------------------------------------------------------ public: solving

    def _scratch_for_slots(self) -> np.ndarray:
        # Kept between calls: allocating a slots-sized array per event costs more than the
        # work on the few ids it is used for. Contents are garbage; callers write before reading.
        if self._scratch.size < self._slots:
            self._scratch = np.empty(max(self._slots, 2 * self._scratch.size), dtype=np.int64)
        return self._scratch

    def _distinct(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` without repeats, in order (O(n), no sort: the last write of each id wins)."""
        if ids.size < 2:
            return ids
        order = np.arange(ids.size)
        scratch = self._scratch_for_slots()
        scratch[ids] = order
        return ids[scratch[ids] == order]

    def _reserve_order(self, end: int) -> None:
        """Room for ``end`` entries in the rate order (the first ``_order_n`` are kept)."""
        if end > self._order.size:
            size = max(end, 2 * self._order.size, 256)
            order, order_rates = np.empty(size, dtype=np.int64), np.empty(size)
            kept = self._order_n
            order[:kept], order_rates[:kept] = self._order[:kept], self._order_rates[:kept]
            self._order, self._order_rates = order, order_rates

    def _set_order(self, ids: np.ndarray, rates: np.ndarray, start: int) -> None:
        """Replace the rate order from position ``start`` on by ``ids`` (already sorted by ``rates``)."""
        end = start + ids.size
        self._order_n = min(self._order_n, start)
        self._reserve_order(end)
        self._order[start:end] = ids
        self._order_rates[start:end] = rates
        self._order_n = end

    def _restore_order_at(self, split: int) -> None:
        """Re-solved rates (from ``split`` on) lie at or above the divergence level up to
        rounding; if rounding put one below a kept rate, restore the whole order outright."""
        n = self._order_n
        if 0 < split < n and self._order_rates[split] < self._order_rates[split - 1]:
            resort = np.argsort(self._order_rates[:n], kind="stable")
            self._set_order(self._order[:n][resort], self._order_rates[:n][resort], 0)

    def _entry_load(self, links: np.ndarray, weights: np.ndarray, lengths: np.ndarray, rates: np.ndarray) -> np.ndarray:
        """Per-link load of flows with the given entries (rows of ``lengths`` entries) at ``rates``;
        flows at rate inf (unconstrained) carry no accounted load."""
        entry_rates = np.repeat(rates, lengths)
        finite = np.isfinite(entry_rates)
        if not finite.all():
            links, weights, entry_rates = links[finite], weights[finite], entry_rates[finite]
        return np.bincount(links, weights=weights * entry_rates, minlength=self.n_links)

    def update(self) -> UpdateStats:
        """Re-solve if anything changed since the last call; returns what was done."""
        if not self._dirty:
            self.last_resolved = np.zeros(0, dtype=np.int64)
            self._last_rates = None
            self.last_update = UpdateStats(kind="none", flows_total=self._n_alive, flows_resolved=0, divergence_level=np.inf)
            return self.last_update
        divergence = self._divergence
        pending = self._pending_new
        new_ids = pending[0] if len(pending) == 1 else np.concatenate(pending) if pending else np.zeros(0, dtype=np.int64)
        new_ids = self._distinct(new_ids[self._alive[new_ids] & ~self._solved[new_ids]])
        if new_ids.size:
            positions, _ = self._entry_positions(new_ids)
            touched = self._links[positions]
            weight = self._weight_sum[touched]
            used = weight > 0  # zero-weight entries constrain nothing
            if used.any():
                # Below c_l / W_l no link of a new flow can fill, so nothing else changes there.
                divergence = min(divergence, float((self._capacity[touched[used]] / weight[used]).min()))

        # Solved flows at or above the divergence level: a suffix of the rate order.
        n_order = self._order_n
        keep_below = divergence * (1.0 - self._keep_margin)
        split = int(np.searchsorted(self._order_rates[:n_order], keep_below, side="left")) if divergence < np.inf else n_order
        candidates = self._order[split:n_order]
        n_filter = 0
        full_above = (self._full_solve_fraction_native if self.native else _FULL_SOLVE_FRACTION) * self._n_alive
        # With the reach, an update adding a handful of flows at most (and <= 1% of the live
        # ones: a first solve stays full) stays partial however low its divergence level: the
        # reach re-solves what the change reaches (~30k of ~240k flows where the slowest flow
        # of a 624 x 400 iteration finishes, in ~25 ms against ~50 ms in full; MLNET's binary
        # trees, 1-2 new flows per event: 13 full solves instead of 1,570). Hundreds of new
        # flows (a server's pulls) reach nearly everything, and a full solve is faster then.
        # Not after a capacity change: a link cut to 0 must end with exactly no load, and a
        # partial update's kept load carries rounding (a full solve rebuilds it from 0).
        reach_only = (self.reach and new_ids.size <= min(_REACH_ONLY_NEW, 0.01 * self._n_alive)
                      and not self._caps_changed and not self._capacity_changed)
        if self.native and self.incremental and (candidates.size + new_ids.size <= full_above or reach_only):
            # A partial re-solve for sure: the kernel drops the suffix's stale ids and repeats
            # itself (three numpy passes less per update).
            resolve = np.concatenate([candidates, new_ids]) if new_ids.size else candidates
            full, n_filter = False, candidates.size
        else:
            suffix = candidates[self._alive[candidates] & self._solved[candidates]]
            resolve = self._distinct(np.concatenate([suffix, new_ids]) if new_ids.size else suffix)
            full = (not self.incremental) or resolve.size > full_above
            if full:
                resolve, split = self.flow_ids(), 0
        self.last_resolved = resolve
        self._last_rates = None
        n_resolved = resolve.size
        slack_retries = reach_fallbacks = reach_grows = 0
        candidates_read = n_filter
        if (full or resolve.size) and self.native:
            self._reserve_order(split + resolve.size)
            changed = np.empty(resolve.size, dtype=np.int64)
            changed_rates = np.empty(resolve.size)
            # Slack links can be left out of a re-solve of solved flows (the kernel checks
            # they stay within capacity, else redoes the filling with them).
            skip_slack = not full and new_ids.size == 0
            # The reach needs the caps unchanged (a flow whose cap changed is on no changed link).
            use_reach = self.reach and not full and not self._caps_changed
            _, n_taken, n_changed, slack_retries, n_resolved, reach_fallbacks, n_read, reach_grows = _fill.resolve(
                resolve, self._order_rates[split : split + n_filter], self._start, self._length, self._links,
                self._weights, self._packed, self._cap, self._rate, self._solved, self._alive, self._capacity, self._load, self._perturbed, self._share, self._link_map,
                self._order[split : split + resolve.size], self._order_rates[split : split + resolve.size], changed,
                changed_rates, full, self._unit_weights, self._any_cap, skip_slack, use_reach, 1.0 + self.tie_rtol,
                n_filter)
            self._order_n = split + n_taken
            if use_reach:
                candidates_read = n_read
            self._restore_order_at(split)
            self.last_resolved = changed[:n_changed]
            self._last_rates = changed_rates[:n_changed]
        elif full or resolve.size:
            positions, indptr = self._entry_positions(resolve)
            links, weights, lengths = self._links[positions], self._weights[positions], np.diff(indptr)
            incidence = Incidence.trusted(indptr, links, None if self._unit_weights else weights, self.n_links)
            if full:
                # Loads rebuilt from scratch: no rounding accumulated over partial updates.
                capacity, load_kept = self._capacity, np.zeros(self.n_links)
            else:
                # The kept flows' load stays; unsolved (new) flows carry none yet (rate 0).
                old = np.where(self._solved[resolve], self._rate[resolve], 0.0)
                load_kept = self._load - self._entry_load(links, weights, lengths, old)
                capacity = np.maximum(self._capacity - load_kept, 0.0)
            rates = solve_max_min(incidence, capacity, self._cap[resolve], tie_rtol=self.tie_rtol)
            self._rate[resolve] = rates
            self._solved[resolve] = True
            self._load = load_kept + self._entry_load(links, weights, lengths, rates)
            sort = np.argsort(rates, kind="stable")
            self._set_order(resolve[sort], rates[sort], split)
            self._restore_order_at(split)
        stats = UpdateStats(kind="full" if full else "partial" if n_resolved else "none", flows_total=self._n_alive,
                            flows_resolved=n_resolved, divergence_level=divergence, slack_retries=slack_retries,
                            reach_fallbacks=reach_fallbacks, reach_grows=reach_grows,
                            candidates_read=candidates_read)
        if self._order_n > 2 * self._n_alive + 1024:
            # Mostly stale entries: rebuild from the live flows' current rates.
            ids = self.flow_ids()
            ids = ids[self._solved[ids]]
            sort = np.argsort(self._rate[ids], kind="stable")
            self._set_order(ids[sort], self._rate[ids][sort], 0)
        self._divergence = np.inf
        self._pending_new = []
        self._perturbed.fill(0)
        self._caps_changed = self._capacity_changed = False
        self._dirty = False
        self.last_update = stats
        return stats

    def last_resolved_rates(self) -> np.ndarray:
        """Current rates of :attr:`last_resolved`, without re-solving or checking ids (the
        per-event read of an event engine; call right after :meth:`update`)."""
        return self._rate[self.last_resolved] if self._last_rates is None else self._last_rates

    def rates(self, ids: np.ndarray | list[int] | None = None) -> np.ndarray:
        """Max-min rates of the given live flows (default: all, in :meth:`flow_ids` order)."""
        self.update()
        ids = self.flow_ids() if ids is None else self._check_ids(ids, "rates")
        return self._rate[ids].copy()

    def link_load(self) -> np.ndarray:
        """Load on every link at the current rates."""
        self.update()
        return self._load.copy()

    def check(self, rtol: float = 1e-9) -> CertificateReport:
        """Certificate of the current rates (recomputed from scratch, independent of the solver)."""
        ids = self.flow_ids()
        return check_certificate(self._incidence_of(ids), self._capacity, self.rates(ids), self._cap[ids], rtol=rtol)
