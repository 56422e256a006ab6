"""Exact max-min fair rates (TCP-like sharing) by vectorized water-filling.

Max-min fairness is the outcome of *progressive filling*: every flow's rate rises at the same
speed; when a link saturates, the flows crossing it freeze at the current level; the others
keep rising. A flow may also have its own cap (an application limit, a NIC it does not
model as a link), which acts like a private link. Flows may use links fractionally
(``Incidence.weights``, from packet spraying): link ``l`` is saturated when
``sum_f w_fl * x_f = c_l``.

The textbook loop freezes one level at a time with a Python pass over all links and flows
per level; a 1,024-host fat-tree carrying 250k flows has ~2,000 distinct levels. Two
vectorized strategies replace it, and a solve may use both:

* **local-min rounds** freeze, in one whole-array step, *every* link whose fill level
  ``t_l = residual_l / (unfrozen weight on l)`` is no larger than the level of every link
  and cap it shares an unfrozen flow with. Levels only rise as other flows freeze below them
  (a flow that freezes early takes less than its fair share), so such a link saturates at
  exactly its current level in sequential progressive filling too. Few rounds when there are
  few distinct levels (a parameter-server push: ~5 rounds for 40k flows), but each round
  touches every unfrozen flow.
* **sequential events** are the textbook loop with a link -> flows index (built with a
  linear-time radix sort): each event costs a few passes over the links plus work for the
  flows it freezes, independent of how many flows remain. Best when links are few and
  flows many (the 250k-flow fat-tree: ~6k links, ~2k events).

``method="auto"`` starts with rounds and switches to events as soon as a round did less work
per frozen level than events would (a deterministic cost model on counts, not timings, so
the same input always takes the same path).

Flows are stored in "buckets": flows with the same number of link entries form a dense
``(entries, flows)`` array of link ids, so gathers and minima are whole-array numpy
operations; ragged lengths are padded with a dummy link of infinite capacity.

Ties: levels that agree within ``tie_rtol`` (relative) saturate together, so flows that in
exact arithmetic share a bottleneck level get it as one batch.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q
    .venv/bin/python -m mlfabric.flow.bench
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlfabric.flow.incidence import Incidence

__all__ = [
    "DEFAULT_TIE_RTOL",
    "MaxMinStats",
    "solve_max_min",
    "solve_max_min_with_stats",
    "validate_capacity",
    "validate_caps",
]

#: Relative tolerance under which two fill levels count as the same level (one batch).
#: Far below the certificate's 1e-9, far above float64 rounding (~1e-16 per operation).
DEFAULT_TIE_RTOL = 1e-12

# Bucket widths: exact up to this many link entries per flow, then rounded up to one of
# four widths per power of two, so padding wastes at most 25% and there are few buckets.
_EXACT_WIDTH_LIMIT = 8


@dataclass(frozen=True, kw_only=True)
class MaxMinStats:
    """What one solve did: useful to see why a solve was slow."""

    n_flows: int
    n_links: int
    nnz: int
    #: Local-min rounds run (each freezes every locally tightest link at once).
    rounds: int
    #: Sequential progressive-filling events run after switching strategy.
    events: int
    buckets: int


def validate_capacity(capacity: np.ndarray | list[float], n_links: int) -> np.ndarray:
    """Capacities as a float64 array of length ``n_links``; inf is allowed, negative/NaN are not."""
    array = np.asarray(capacity, dtype=np.float64)
    if array.shape != (n_links,):
        raise ValueError(f"capacity has shape {array.shape}, expected ({n_links},) (one value per link)")
    if np.isnan(array).any():
        raise ValueError(f"capacity of link {int(np.flatnonzero(np.isnan(array))[0])} is NaN")
    if (array < 0).any():
        bad = int(np.flatnonzero(array < 0)[0])
        raise ValueError(f"capacity of link {bad} is negative ({array[bad]})")
    return array


def validate_caps(caps: np.ndarray | list[float] | None, n_flows: int) -> np.ndarray | None:
    """Per-flow rate caps as float64 (inf = no cap), or None when there are none."""
    if caps is None:
        return None
    array = np.asarray(caps, dtype=np.float64)
    if array.shape != (n_flows,):
        raise ValueError(f"caps has shape {array.shape}, expected ({n_flows},) (one value per flow)")
    if np.isnan(array).any() or (array < 0).any():
        bad = int(np.flatnonzero(np.isnan(array) | (array < 0))[0])
        raise ValueError(f"cap of flow {bad} is {array[bad]}; caps must be >= 0 (inf for none)")
    if np.isinf(array).all():
        return None
    return array


def _bucket_width(length: np.ndarray) -> np.ndarray:
    """Padded width for each row length (exact when small, else <= 25% padding)."""
    width = length.copy()
    large = length > _EXACT_WIDTH_LIMIT
    if large.any():
        big = length[large]
        step = np.left_shift(1, np.floor(np.log2(big)).astype(np.int64) - 2)
        width[large] = -(-big // step) * step
    return width


@dataclass(eq=False)
class _Bucket:
    """Unfrozen flows with the same padded width: ``links[h, i]`` is flow ``flows[i]``'s h-th link."""

    links: np.ndarray  # (width, n) intp; padding points at the dummy link n_links
    weights: np.ndarray | None  # (width, n) float64, or None when every weight is 1
    flows: np.ndarray  # (n,) original flow index
    caps: np.ndarray | None  # (n,) or None


def _make_buckets(incidence: Incidence, caps: np.ndarray | None) -> list[_Bucket]:
    pad = incidence.n_links
    lengths = incidence.lengths()
    links = incidence.links
    weights = incidence.weights
    if weights is not None and (weights == 0).any():
        # A zero weight means the flow does not load the link: it must not constrain it either.
        links = np.where(weights == 0, pad, links)
    widths = _bucket_width(lengths)
    buckets: list[_Bucket] = []
    for width in np.unique(widths[lengths > 0]).tolist():
        rows = np.flatnonzero(widths == width)
        starts = incidence.indptr[rows]
        offsets = np.arange(width, dtype=np.int64)[:, None]
        positions = starts[None, :] + offsets
        row_lengths = lengths[rows]
        if (row_lengths == width).all():
            bucket_links = links[positions]
            bucket_weights = None if weights is None else weights[positions]
        else:
            valid = offsets < row_lengths[None, :]
            positions = np.where(valid, positions, 0)
            bucket_links = np.where(valid, links[positions], pad)
            bucket_weights = None
            if weights is not None:
                bucket_weights = np.where(valid, weights[positions], 0.0)
        buckets.append(
            _Bucket(
                links=bucket_links.astype(np.intp, copy=False),
                weights=bucket_weights,
                flows=rows,
                caps=None if caps is None else caps[rows],
            )
        )
    return buckets


@dataclass(eq=False)
class _FillState:
    """Per-link state of a water-filling run; index ``pad`` (= n_links) is the padding link."""

    capacity: np.ndarray  # (L+1,), capacity[pad] = inf
    frozen_load: np.ndarray  # (L+1,) load of frozen flows
    unfrozen_weight: np.ndarray  # (L+1,) sum of weights of unfrozen flows
    unfrozen_count: np.ndarray  # (L+1,) number of unfrozen entries (robust "no flows left" test)
    rates: np.ndarray  # (n_flows,) output
    pad: int

    def levels(self, out: np.ndarray) -> np.ndarray:
        """Fill level of every link: the common rate at which its unfrozen flows saturate it."""
        residual = self.capacity - self.frozen_load
        np.maximum(residual, 0.0, out=residual)
        out.fill(np.inf)
        np.divide(residual, self.unfrozen_weight, out=out, where=(self.unfrozen_count > 0) & (self.unfrozen_weight > 0))
        out[self.pad] = np.inf
        return out

    def freeze(self, links: np.ndarray, weights: np.ndarray | None, entry_rates: np.ndarray) -> None:
        """Move entries (flat link ids, weights or None for 1, each entry's flow rate) to the frozen side."""
        size = self.capacity.size
        counts = np.bincount(links, minlength=size)
        self.unfrozen_count -= counts
        if weights is None:
            self.unfrozen_weight -= counts
            self.frozen_load += np.bincount(links, weights=entry_rates, minlength=size)
        else:
            self.unfrozen_weight -= np.bincount(links, weights=weights, minlength=size)
            self.frozen_load += np.bincount(links, weights=weights * entry_rates, minlength=size)
        self.unfrozen_count[self.pad] = 0
        self.unfrozen_weight[self.pad] = 0.0


def _local_min_round(
    buckets: list[_Bucket], state: _FillState, grow: float, level: np.ndarray, link_min: np.ndarray
) -> tuple[list[_Bucket], int, int]:
    """One round: freeze every flow crossing a locally minimal link (or at its cap).

    Returns (remaining buckets, flows frozen, distinct levels frozen).
    """
    state.levels(level)
    # Each flow's tightest constraint, then each link's tightest neighbouring constraint.
    link_min.fill(np.inf)
    tightest_links: list[np.ndarray] = []
    tightest_all: list[np.ndarray] = []
    for bucket in buckets:
        tightest_link = level.take(bucket.links).min(axis=0)
        tightest = tightest_link if bucket.caps is None else np.minimum(tightest_link, bucket.caps)
        # One scatter per bucket (not one per row): numpy call overhead dominates small solves.
        np.minimum.at(link_min, bucket.links.ravel(), np.broadcast_to(tightest, bucket.links.shape).ravel())
        tightest_links.append(tightest_link)
        tightest_all.append(tightest)

    local_min = (level <= link_min * grow) & np.isfinite(level)
    n_frozen = 0
    frozen_levels: list[np.ndarray] = [level[local_min]]
    remaining: list[_Bucket] = []
    for bucket, tightest_link, tightest in zip(buckets, tightest_links, tightest_all):
        freeze = local_min.take(bucket.links).any(axis=0)
        if bucket.caps is not None:
            # An infinite cap never binds (inf <= inf must not freeze a flow at inf).
            at_cap = (bucket.caps <= tightest_link * grow) & np.isfinite(bucket.caps)
            frozen_levels.append(bucket.caps[at_cap])
            freeze |= at_cap
        if not freeze.any():
            remaining.append(bucket)
            continue
        frozen_rates = tightest[freeze]
        n_frozen += frozen_rates.size
        state.rates[bucket.flows[freeze]] = frozen_rates
        frozen_links = bucket.links[:, freeze]
        state.freeze(
            frozen_links.ravel(),
            None if bucket.weights is None else bucket.weights[:, freeze].ravel(),
            np.broadcast_to(frozen_rates, frozen_links.shape).ravel(),
        )
        keep = np.flatnonzero(~freeze)
        if keep.size:
            remaining.append(
                _Bucket(
                    links=bucket.links.take(keep, axis=1),
                    weights=None if bucket.weights is None else bucket.weights.take(keep, axis=1),
                    flows=bucket.flows[keep],
                    caps=None if bucket.caps is None else bucket.caps[keep],
                )
            )
    distinct = int(np.unique(np.concatenate(frozen_levels)).size) if n_frozen else 0
    return remaining, n_frozen, distinct


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _sequential_events(buckets: list[_Bucket], state: _FillState, grow: float) -> int:
    """Classic progressive filling on what is left, one level (event) at a time.

    Each event costs a few passes over the links plus work proportional to the flows it
    freezes, independent of how many flows remain: the better choice when links are few and
    flows many (a fat-tree carrying 250k flows has ~6k links and ~2k distinct levels).
    Returns the number of events. ``state`` is consumed (its arrays are not kept consistent).
    """
    pad = state.pad
    n_ext = state.capacity.size
    # All remaining flows in one (n_flows, width) array of link ids, padded with `pad`, so that
    # a set of frozen flows' entries is a single row gather.
    width = max(bucket.links.shape[0] for bucket in buckets)
    n_flows = sum(bucket.flows.size for bucket in buckets)
    rows = np.full((n_flows, width), pad, dtype=np.intp)
    weighted = buckets[0].weights is not None
    row_weights = np.zeros((n_flows, width)) if weighted else None
    flow_ids = np.empty(n_flows, dtype=np.int64)
    caps = np.full(n_flows, np.inf)
    offset = 0
    for bucket in buckets:
        n, w = bucket.flows.size, bucket.links.shape[0]
        rows[offset : offset + n, :w] = bucket.links.T
        if row_weights is not None and bucket.weights is not None:
            row_weights[offset : offset + n, :w] = bucket.weights.T
        flow_ids[offset : offset + n] = bucket.flows
        if bucket.caps is not None:
            caps[offset : offset + n] = bucket.caps
        offset += n

    # Link-major view: which flows cross each link. Link ids fit 16 bits on most topologies,
    # and numpy's stable sort is a linear-time radix sort for 16-bit keys.
    flat = rows.ravel()
    sort_keys = flat.astype(np.uint16) if n_ext <= np.iinfo(np.uint16).max + 1 else flat
    flows_by_link = np.argsort(sort_keys, kind="stable") // width
    link_ptr = np.zeros(n_ext + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat, minlength=n_ext), out=link_ptr[1:])

    # Residual capacity and unfrozen entry count per link; the padding link gets an infinite
    # residual and a huge finite count/weight that never reaches 0, so its level stays inf
    # (inf / 1e300) without special cases in the loop.
    residual = np.maximum(state.capacity - state.frozen_load, 0.0)
    residual[pad] = np.inf
    count = state.unfrozen_count.astype(np.float64)
    count[pad] = _NEVER_EMPTY
    divisor = count if not weighted else state.unfrozen_weight.copy()
    divisor[pad] = _NEVER_EMPTY
    level = np.full(n_ext, np.inf)
    np.divide(residual, divisor, out=level, where=(count > 0) & (divisor > 0))

    capped = np.flatnonzero(np.isfinite(caps))
    cap_order = capped[np.argsort(caps[capped], kind="stable")]
    next_cap = 0
    active = np.ones(n_flows, dtype=bool)
    position = np.empty(n_flows, dtype=np.int64)  # scratch for de-duplicating frozen flows
    rates = state.rates
    events = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            while next_cap < cap_order.size and not active[cap_order[next_cap]]:
                next_cap += 1
            # Rounding can leave a level a hair below 0 on a link that is in fact full.
            link_level = max(float(level.min()), 0.0)
            cap_level = caps[cap_order[next_cap]] if next_cap < cap_order.size else np.inf
            current = min(link_level, cap_level)
            if current == np.inf:
                break  # what is left is unconstrained: rate inf (already set)
            events += 1
            threshold = current * grow
            candidates = []
            if link_level <= threshold:
                saturated = np.flatnonzero(level <= threshold)
                if saturated.size == 1:
                    link = saturated[0]
                    candidates.append(flows_by_link[link_ptr[link] : link_ptr[link + 1]])
                else:
                    starts = link_ptr[saturated]
                    candidates.append(flows_by_link[_ranges(starts, link_ptr[saturated + 1] - starts)])
            stop = next_cap
            while stop < cap_order.size and caps[cap_order[stop]] <= threshold:
                stop += 1
            if stop > next_cap:
                candidates.append(cap_order[next_cap:stop])
                next_cap = stop
            frozen = candidates[0] if len(candidates) == 1 else np.concatenate(candidates)
            frozen = frozen[active[frozen]]
            if frozen.size > 1:
                # A flow can sit on several saturated links: keep one copy (no sort needed).
                order = np.arange(frozen.size)
                position[frozen] = order
                frozen = frozen[position[frozen] == order]
            active[frozen] = False
            # Everyone frozen now gets the current level: <= every level on its path, so feasible.
            rates[flow_ids[frozen]] = current
            touched = rows[frozen].ravel()
            np.subtract.at(count, touched, 1.0)
            if row_weights is None:
                np.subtract.at(residual, touched, current)
            else:
                touched_weights = row_weights[frozen].ravel()
                np.subtract.at(divisor, touched, touched_weights)
                np.subtract.at(residual, touched, touched_weights * current)
            # Only the touched links' levels changed.
            new_level = residual[touched] / divisor[touched]
            new_level[count[touched] <= 0] = np.inf
            level[touched] = new_level
    return events


_NEVER_EMPTY = 1e300

# Deterministic cost model for switching from local-min rounds to sequential events, in
# nanoseconds on a ~3 GHz core (only the ratios matter): a round touches every remaining
# entry a few times; an event costs numpy call overhead plus a few passes over the links.
_ROUND_NS_PER_ENTRY = 6.0
_EVENT_NS = 30_000.0
_EVENT_NS_PER_LINK = 3.0


def solve_max_min_with_stats(
    incidence: Incidence,
    capacity: np.ndarray | list[float],
    caps: np.ndarray | list[float] | None = None,
    *,
    tie_rtol: float = DEFAULT_TIE_RTOL,
    method: str = "auto",
) -> tuple[np.ndarray, MaxMinStats]:
    """Max-min fair rates and solve statistics; see :func:`solve_max_min`.

    ``method``: ``"auto"`` (local-min rounds, switching to sequential events when a round
    freezes too few levels for its cost), ``"rounds"`` or ``"events"`` (one strategy only;
    all three give the same allocation up to ``tie_rtol``).
    """
    n_links = incidence.n_links
    n_flows = incidence.n_flows
    capacity = validate_capacity(capacity, n_links)
    caps = validate_caps(caps, n_flows)
    if not 0 <= tie_rtol < 1e-6:
        raise ValueError(f"tie_rtol={tie_rtol} must be in [0, 1e-6): it merges levels that differ by that much")
    if method not in ("auto", "rounds", "events"):
        raise ValueError(f"method={method!r} must be 'auto', 'rounds' or 'events'")

    rates = np.full(n_flows, np.inf)
    no_links = incidence.lengths() == 0
    if caps is not None:
        rates[no_links] = caps[no_links]

    buckets = _make_buckets(incidence, caps)
    n_buckets = len(buckets)
    pad = n_links
    state = _FillState(
        capacity=np.append(capacity, np.inf),
        frozen_load=np.zeros(n_links + 1),
        unfrozen_weight=np.zeros(n_links + 1),
        unfrozen_count=np.zeros(n_links + 1, dtype=np.int64),
        rates=rates,
        pad=pad,
    )
    for bucket in buckets:
        flat = bucket.links.ravel()
        counts = np.bincount(flat, minlength=n_links + 1)
        state.unfrozen_count += counts
        if bucket.weights is None:
            state.unfrozen_weight += counts
        else:
            state.unfrozen_weight += np.bincount(flat, weights=bucket.weights.ravel(), minlength=n_links + 1)
    state.unfrozen_count[pad] = 0
    state.unfrozen_weight[pad] = 0.0

    grow = 1.0 + tie_rtol
    level = np.empty(n_links + 1)
    link_min = np.empty(n_links + 1)
    rounds = 0
    events = 0
    if method == "events" and buckets:
        events = _sequential_events(buckets, state, grow)
        buckets = []
    while buckets:
        buckets, n_frozen, distinct_levels = _local_min_round(buckets, state, grow, level, link_min)
        rounds += 1
        if n_frozen == 0:
            break  # no finite constraint is left: the remaining flows are unconstrained (rate inf)
        if method == "auto" and buckets:
            remaining_entries = sum(bucket.links.size for bucket in buckets)
            active_links = int(np.count_nonzero(state.unfrozen_count))
            round_cost = _ROUND_NS_PER_ENTRY * remaining_entries
            event_cost = _EVENT_NS + _EVENT_NS_PER_LINK * active_links
            # The last round did the work of `distinct_levels` events: switch when events are cheaper.
            if round_cost > distinct_levels * event_cost:
                events = _sequential_events(buckets, state, grow)
                buckets = []

    stats = MaxMinStats(
        n_flows=n_flows,
        n_links=n_links,
        nnz=incidence.nnz,
        rounds=rounds,
        events=events,
        buckets=n_buckets,
    )
    return rates, stats


def solve_max_min(
    incidence: Incidence,
    capacity: np.ndarray | list[float],
    caps: np.ndarray | list[float] | None = None,
    *,
    tie_rtol: float = DEFAULT_TIE_RTOL,
    method: str = "auto",
) -> np.ndarray:
    """Max-min fair rate of every flow (same unit as ``capacity``, normally bit/s).

    ``incidence`` says which links each flow crosses (with weights for fractional use),
    ``capacity[l]`` is link ``l``'s capacity (``inf`` allowed, 0 allowed), ``caps[f]`` an
    optional per-flow upper bound (``inf`` for none). Flows with no links get their cap (or
    ``inf``); flows crossing a zero-capacity link get 0. Levels within ``tie_rtol`` of each
    other are frozen together.
    """
    rates, _ = solve_max_min_with_stats(incidence, capacity, caps, tie_rtol=tie_rtol, method=method)
    return rates
