"""A deliberately straightforward pure-Python water-filling: the baseline and the cross-check.

This is the textbook progressive-filling loop written with dicts and Python loops, the way
one would write it first: raise every unfrozen flow to the lowest level at which some link
(or some flow's cap) saturates, freeze the flows there, repeat. It is kept simple on purpose:
tests compare the vectorized solver (:mod:`mlfabric.flow.maxmin`) against it on small random
instances, and the benchmark (:mod:`mlfabric.flow.bench`) reports the speed ratio against it.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q -k naive
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlfabric.flow.incidence import Incidence

__all__ = ["naive_max_min"]


def naive_max_min(
    flows: Incidence | Sequence[Sequence[tuple[int, float]]],
    capacity: Sequence[float],
    caps: Sequence[float] | None = None,
    *,
    tie_rtol: float = 1e-12,
) -> list[float]:
    """Max-min fair rates by plain progressive filling.

    ``flows[f]`` is a list of ``(link, weight)`` pairs (or an :class:`Incidence`),
    ``capacity[l]`` the capacity of link ``l``, ``caps[f]`` an optional per-flow upper bound.
    Returns one rate per flow (``inf`` for a flow nothing constrains).
    """
    flow_lists = flows.to_lists() if isinstance(flows, Incidence) else [list(entries) for entries in flows]
    n_flows = len(flow_lists)
    cap_of = [math.inf] * n_flows if caps is None else [float(c) for c in caps]
    if len(cap_of) != n_flows:
        raise ValueError(f"caps has {len(cap_of)} entries for {n_flows} flows")

    # link -> {flow: weight} for the flows that really load it.
    flows_on_link: dict[int, dict[int, float]] = {}
    for flow, entries in enumerate(flow_lists):
        for link, weight in entries:
            if weight > 0:
                on_link = flows_on_link.setdefault(link, {})
                on_link[flow] = on_link.get(flow, 0.0) + weight

    links_of_flow: list[set[int]] = [set() for _ in range(n_flows)]
    for link, on_link in flows_on_link.items():
        for flow in on_link:
            links_of_flow[flow].add(link)

    rate = [0.0] * n_flows
    unfrozen = set(range(n_flows))
    remaining = {link: float(capacity[link]) for link in flows_on_link}
    active_weight = {link: sum(on_link.values()) for link, on_link in flows_on_link.items()}
    # Counted separately so float cancellation in active_weight cannot keep a link alive.
    active_count = {link: len(on_link) for link, on_link in flows_on_link.items()}
    level = 0.0
    while unfrozen:
        # The next level at which a link saturates or a flow reaches its cap.
        next_level = math.inf
        for link, weight in active_weight.items():
            if active_count[link] > 0 and weight > 0:
                next_level = min(next_level, level + max(remaining[link], 0.0) / weight)
        for flow in unfrozen:
            next_level = min(next_level, cap_of[flow])
        if next_level == math.inf:
            for flow in unfrozen:
                rate[flow] = math.inf
            break
        threshold = next_level * (1.0 + tie_rtol)

        to_freeze: set[int] = set()
        for link, weight in active_weight.items():
            if active_count[link] > 0 and weight > 0 and level + max(remaining[link], 0.0) / weight <= threshold:
                to_freeze.update(flow for flow in flows_on_link[link] if flow in unfrozen)
        for flow in unfrozen:
            if cap_of[flow] <= threshold:
                to_freeze.add(flow)

        # Everyone still unfrozen rises to the new level; links lose that much capacity.
        rise = next_level - level
        for link, weight in active_weight.items():
            if active_count[link] > 0:
                remaining[link] -= rise * weight
        level = next_level
        for flow in to_freeze:
            rate[flow] = level
            unfrozen.discard(flow)
            for link in links_of_flow[flow]:
                active_weight[link] -= flows_on_link[link][flow]
                active_count[link] -= 1
        for flow in unfrozen:
            rate[flow] = level
    return rate
