"""MLNET's aggregation/multicast trees (MLNET §3): per server, a spanning tree over the workers.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet.py -k trees tests/unit/test_sim.py -k tree

One pure function, :func:`tree_parents`, shared by the simulator (``sim/workloads.py``, which
times the trees) and the parameter-server runtime (``ps/policies/mlnet.py``, which moves real tensors
along them), so that a simulated and a real run of one placement use the same trees.

Kinds (``TREE_KINDS``):

* ``direct``: no tree, every worker is a child of every server (MLNET's BASELINE);
* ``binary`` (``tree`` with ``degree=2``) and ``tree`` of in-degree ``d``: the workers, sorted by
  host (so that rack-mates share subtrees), are split recursively: the server gets ``d``
  children, the heads of ``d`` contiguous parts of the list, and each part is split the same
  way below its head. Server ``j``'s tree rotates the list by ``j*W/S`` so that the work of
  aggregating is spread over the workers rather than always falling on the same heads;
* ``rack``: one aggregator per rack (the workers whose hosts share a first-hop switch): every
  other worker of the rack is its child, and it is a child of the server; server ``j`` takes
  the rack's ``(j mod size)``-th worker as aggregator, again to spread the work.

The result is an ``(S, W)`` integer array: ``parents[j, w]`` is the worker whose node receives
worker ``w``'s pushes for server ``j`` (and answers its pulls), ``-1`` the server itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from mlfabric.collectives.partition import piece_sizes

if TYPE_CHECKING:
    from mlfabric.topo.topology import Topology

__all__ = ["TREE_KINDS", "children_of", "parse_tree_kind", "rack_of", "split_tree", "subtree_of", "tree_parents"]

TREE_KINDS = ("direct", "binary", "rack", "tree")


def parse_tree_kind(text: str) -> tuple[str, int | None]:
    """``binary`` -> (binary, None), ``rack``, ``tree:3`` -> (tree, 3), ``direct``; ValueError
    naming the accepted forms otherwise (and for an in-degree below 1)."""
    kind, _, arg = text.strip().lower().partition(":")
    if kind == "tree":
        try:
            degree = int(arg)
        except ValueError:
            raise ValueError(f"tree kind {text!r}: give the in-degree as tree:D, e.g. tree:4") from None
        if degree < 1:
            raise ValueError(f"tree kind {text!r}: the in-degree d must be >= 1, got {degree}")
        return kind, degree
    if kind not in TREE_KINDS or arg:
        raise ValueError(f"unknown tree kind {text!r}; choose binary, rack, tree:D (in-degree D >= 1) or direct")
    return kind, None


def rack_of(topology: "Topology", hosts: Sequence[int] | np.ndarray) -> np.ndarray:
    """The rack of each host: the switch (or node) its NIC 0 plugs into."""
    return topology.link_dst[topology.nic_links[np.asarray(hosts, dtype=np.int64), 0, 0]]


def split_tree(n: int, degree: int) -> np.ndarray:
    """Parent position of each of ``n`` positions (-1: a child of the root): the recursive
    contiguous split of the module docstring."""
    if degree < 1:
        raise ValueError(f"a tree's in-degree must be >= 1, got {degree}")
    parent = np.full(n, -1, dtype=np.int64)
    stack = [(0, n, -1)]
    while stack:
        lo, hi, head = stack.pop()
        start = lo
        for size in piece_sizes(hi - lo, min(degree, hi - lo)):
            parent[start] = head
            if size > 1:
                stack.append((start + 1, start + size, start))
            start += size
    return parent


def tree_parents(kind: str, servers: int, worker_hosts: Sequence[int] | np.ndarray, *, degree: int | None = None,
                 racks: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """``(S, W)``: the parent worker of each worker in server ``j``'s tree (-1: the server).

    ``worker_hosts``: the host of each worker (its order decides the trees' shape); ``degree``:
    the in-degree of kind ``tree`` (binary is 2); ``racks``: the rack of each worker (kind
    ``rack`` only: workers with equal values share an aggregator)."""
    hosts = np.asarray(worker_hosts, dtype=np.int64).reshape(-1)
    w = hosts.size
    if kind not in TREE_KINDS:
        raise ValueError(f"unknown tree kind {kind!r}; choose one of {', '.join(TREE_KINDS)}")
    if servers < 1:
        raise ValueError(f"a tree needs a server to root it, got {servers} servers")
    if w < 1:
        raise ValueError(f"a {kind} tree over zero workers: a parameter-server job needs at least one worker")
    if kind == "tree" and (degree is None or degree < 1):
        raise ValueError(f"a tree's in-degree d must be >= 1, got {degree}")
    if kind != "tree" and degree is not None:
        raise ValueError(f"degree applies to kind 'tree' only (binary is d=2, rack is one aggregator per rack), "
                         f"got {kind} with degree {degree}")
    if kind == "direct":
        return np.full((servers, w), -1, dtype=np.int64)
    order = np.argsort(hosts, kind="stable")
    parents = np.empty((servers, w), dtype=np.int64)
    if kind == "rack":
        if racks is None:
            raise ValueError("a rack tree needs the rack of every worker (racks=...; from the topology: "
                             "mlfabric.sim.workloads.rack_of)")
        rack = np.asarray(racks, dtype=np.int64).reshape(-1)
        if rack.size != w:
            raise ValueError(f"racks must give the rack of each of the {w} workers, got {rack.size} values")
        server = np.arange(servers)
        by_rack = order[np.argsort(rack[order], kind="stable")]  # by rack, by host inside a rack
        bounds = np.flatnonzero(np.diff(rack[by_rack])) + 1
        for members in np.split(by_rack, bounds):
            aggregator = members[server % members.size]
            parents[:, members] = aggregator[:, None]
            parents[server, aggregator] = -1
        return parents
    base = split_tree(w, 2 if kind == "binary" else int(degree))  # type: ignore[arg-type]
    positions = np.arange(w)
    for j in range(servers):
        at = order[(positions + j * w // servers) % w]  # the worker at each position
        parents[j, at] = np.where(base >= 0, at[np.maximum(base, 0)], -1)
    return parents


def children_of(parents: np.ndarray, worker: int) -> list[int]:
    """The workers whose parent is ``worker`` in one tree (a row of :func:`tree_parents`)."""
    return np.flatnonzero(np.asarray(parents) == worker).tolist()


def subtree_of(parents: np.ndarray, worker: int) -> list[int]:
    """``worker`` and every worker below it in one tree, ``worker`` first."""
    out, frontier = [worker], [worker]
    while frontier:
        frontier = [c for p in frontier for c in children_of(parents, p)]
        out += frontier
    return out
