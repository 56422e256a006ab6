"""Routing over a topology: shortest paths, seeded per-flow ECMP, and packet spraying.

Every router answers three questions about host pairs, vectorized over many flows:

* ``path_counts(src, dst)``: how many shortest paths each pair has;
* ``select(src, dst, index)``: the ``index``-th shortest path of each pair, where paths are
  ordered lexicographically by their tuple of link ids (the same order for structural and
  generic routers, so a structural fat-tree router and a BFS over the same graph pick the same
  path for the same index);
* ``spray(src, dst)``: each flow split evenly over all its shortest paths (the fluid limit of
  per-packet load balancing), as fractional link weights.

Per-flow ECMP picks ``index = hash(seed, src, dst, key) % count``; the key plays the role of
a 5-tuple's ports (default: the flow's position in the list). On symmetric topologies like the
fat-tree this is the same distribution as per-hop hashing.

:class:`GraphRouter` does all of this for any graph by BFS (``edges:FILE`` topologies, and
tests that cross-check the structural routers of ``fat_tree``, ``bcube`` and ``racks``).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k "path or ecmp or spray"
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Sequence

import numpy as np

from mlfabric.flow.incidence import Incidence

__all__ = [
    "Router",
    "GraphRouter",
    "ecmp_hash",
    "incidence_from_entries",
    "incidence_from_blocks",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic is intended)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def ecmp_hash(src: np.ndarray, dst: np.ndarray, keys: np.ndarray, seed: int) -> np.ndarray:
    """Deterministic 64-bit hash of (seed, src, dst, key) per flow; same inputs, same hash, any platform."""
    with np.errstate(over="ignore"):
        seed_array = np.full(np.shape(src), np.uint64(seed % (1 << 64)), dtype=np.uint64)
        h = _splitmix64(seed_array)
        h = _splitmix64(h ^ np.asarray(src, dtype=np.int64).astype(np.uint64))
        h = _splitmix64(h ^ np.asarray(dst, dtype=np.int64).astype(np.uint64))
        h = _splitmix64(h ^ np.asarray(keys, dtype=np.int64).astype(np.uint64))
    return h


def incidence_from_entries(
    n_flows: int, n_links: int, flows: np.ndarray, links: np.ndarray, weights: np.ndarray
) -> Incidence:
    """Incidence from unordered (flow, link, weight) triples; repeated (flow, link) pairs are summed."""
    keys = flows.astype(np.int64) * np.int64(n_links) + links.astype(np.int64)
    unique_keys, inverse = np.unique(keys, return_inverse=True)
    summed = np.bincount(inverse, weights=weights, minlength=unique_keys.size)
    row = unique_keys // n_links
    indptr = np.zeros(n_flows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n_flows), out=indptr[1:])
    return Incidence(indptr=indptr, links=unique_keys % n_links, weights=summed, n_links=n_links)


def incidence_from_blocks(
    n_flows: int,
    n_links: int,
    blocks: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
) -> Incidence:
    """Incidence from blocks ``(rows, links (n, w), weights (n, w) or None)``; each flow in at most one block.

    Link ids < 0 in a block are padding and dropped. Rows keep their given link order.
    """
    lengths = np.zeros(n_flows, dtype=np.int64)
    any_weights = any(block_weights is not None for _, _, block_weights in blocks)
    for rows, block_links, _ in blocks:
        lengths[rows] = (block_links >= 0).sum(axis=1)
    indptr = np.zeros(n_flows + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    links = np.empty(indptr[-1], dtype=np.int64)
    weights = np.empty(indptr[-1], dtype=np.float64) if any_weights else None
    for rows, block_links, block_weights in blocks:
        valid = block_links >= 0
        # Position of each valid entry: row start + rank of the entry among the row's valid ones.
        rank = np.cumsum(valid, axis=1) - 1
        positions = indptr[rows][:, None] + rank
        links[positions[valid]] = block_links[valid]
        if weights is not None:
            weights[positions[valid]] = 1.0 if block_weights is None else block_weights[valid]
    return Incidence(indptr=indptr, links=links, weights=weights, n_links=n_links)


class Router(abc.ABC):
    """Shortest-path routing between hosts; see the module docstring for the path order."""

    n_links: int

    @abc.abstractmethod
    def path_counts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Number of shortest paths of each (src, dst) pair (1 for src == dst: the empty path)."""

    @abc.abstractmethod
    def select(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> Incidence:
        """The ``index[f]``-th shortest path of each flow, as an incidence with unit weights."""

    def paths(self, src: int, dst: int) -> list[tuple[int, ...]]:
        """All shortest paths from ``src`` to ``dst`` as tuples of link ids, in lexicographic order."""
        count = int(self.path_counts(np.array([src]), np.array([dst]))[0])
        index = np.arange(count, dtype=np.int64)
        chosen = self.select(np.full(count, src), np.full(count, dst), index)
        return [tuple(chosen.links[chosen.indptr[i] : chosen.indptr[i + 1]].tolist()) for i in range(count)]

    def spray(self, src: np.ndarray, dst: np.ndarray) -> Incidence:
        """Each flow split evenly over all its shortest paths (weights = fraction of paths per link)."""
        counts = self.path_counts(src, dst)
        flow_parts: list[np.ndarray] = []
        link_parts: list[np.ndarray] = []
        weight_parts: list[np.ndarray] = []
        for index in range(int(counts.max(initial=0))):
            rows = np.flatnonzero(counts > index)
            chosen = self.select(src[rows], dst[rows], np.full(rows.size, index, dtype=np.int64))
            entry_rows = rows[chosen.entry_flows()]
            flow_parts.append(entry_rows)
            link_parts.append(chosen.links)
            weight_parts.append(1.0 / counts[entry_rows])
        if not flow_parts:
            return Incidence(indptr=np.zeros(src.size + 1, dtype=np.int64), links=np.zeros(0, dtype=np.int64),
                             weights=np.zeros(0), n_links=self.n_links)
        return incidence_from_entries(
            src.size,
            self.n_links,
            np.concatenate(flow_parts),
            np.concatenate(link_parts),
            np.concatenate(weight_parts),
        )


class GraphRouter(Router):
    """Shortest paths on any directed graph by BFS; hosts may relay (server-centric graphs like BCube)."""

    def __init__(self, link_src: np.ndarray, link_dst: np.ndarray, n_nodes: int) -> None:
        self.link_src = np.asarray(link_src, dtype=np.int64)
        self.link_dst = np.asarray(link_dst, dtype=np.int64)
        self.n_nodes = int(n_nodes)
        self.n_links = int(self.link_src.size)
        order = np.lexsort((np.arange(self.n_links), self.link_src))
        self._out_links = order  # links sorted by (source node, link id)
        self._out_ptr = np.zeros(self.n_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.link_src, minlength=self.n_nodes), out=self._out_ptr[1:])
        in_order = np.lexsort((np.arange(self.n_links), self.link_dst))
        self._in_links = in_order
        self._in_ptr = np.zeros(self.n_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.link_dst, minlength=self.n_nodes), out=self._in_ptr[1:])
        self._dist_cache: dict[int, np.ndarray] = {}
        self._count_cache: dict[int, np.ndarray] = {}
        self._paths_cache: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    def _distances_to(self, dst: int) -> np.ndarray:
        """Hop distance of every node to ``dst`` (-1 when unreachable), by BFS on reversed links."""
        cached = self._dist_cache.get(dst)
        if cached is not None:
            return cached
        dist = np.full(self.n_nodes, -1, dtype=np.int64)
        dist[dst] = 0
        queue = deque([dst])
        in_ptr, in_links, link_src = self._in_ptr, self._in_links, self.link_src
        while queue:
            node = queue.popleft()
            for link in in_links[in_ptr[node] : in_ptr[node + 1]]:
                prev = link_src[link]
                if dist[prev] < 0:
                    dist[prev] = dist[node] + 1
                    queue.append(prev)
        self._dist_cache[dst] = dist
        return dist

    def _counts_to(self, dst: int) -> np.ndarray:
        """Number of shortest paths from every node to ``dst`` (as Python ints in an object array)."""
        cached = self._count_cache.get(dst)
        if cached is not None:
            return cached
        dist = self._distances_to(dst)
        counts = np.zeros(self.n_nodes, dtype=object)
        counts[dst] = 1
        for node in np.argsort(dist, kind="stable"):
            if dist[node] <= 0:
                continue
            total = 0
            for link in self._next_links(node, dist):
                total += counts[self.link_dst[link]]
            counts[node] = total
        self._count_cache[dst] = counts
        return counts

    def _next_links(self, node: int, dist: np.ndarray) -> list[int]:
        """Out-links of ``node`` that lead one hop closer to the destination, by increasing link id."""
        out = self._out_links[self._out_ptr[node] : self._out_ptr[node + 1]]
        return [int(link) for link in out if dist[self.link_dst[link]] == dist[node] - 1]

    def all_paths(self, src: int, dst: int) -> list[tuple[int, ...]]:
        key = (src, dst)
        cached = self._paths_cache.get(key)
        if cached is not None:
            return cached
        dist = self._distances_to(dst)
        if dist[src] < 0:
            raise ValueError(f"no path from node {src} to node {dst}: the graph is disconnected")
        found: list[tuple[int, ...]] = []

        def walk(node: int, prefix: list[int]) -> None:
            if node == dst:
                found.append(tuple(prefix))
                return
            for link in self._next_links(node, dist):
                prefix.append(link)
                walk(int(self.link_dst[link]), prefix)
                prefix.pop()

        walk(src, [])
        self._paths_cache[key] = found
        return found

    def path_counts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        result = np.empty(src.size, dtype=np.int64)
        pairs, inverse = np.unique(np.stack([src, dst]), axis=1, return_inverse=True)
        per_pair = np.empty(pairs.shape[1], dtype=np.int64)
        for i, (s, d) in enumerate(pairs.T.tolist()):
            count = self._counts_to(d)[s]
            if self._distances_to(d)[s] < 0:
                raise ValueError(f"no path from node {s} to node {d}: the graph is disconnected")
            per_pair[i] = count
        result[:] = per_pair[inverse.reshape(-1)]
        return result

    def select(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> Incidence:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        index = np.asarray(index, dtype=np.int64)
        if src.size == 0:
            return Incidence.empty(self.n_links)
        combos, inverse = np.unique(np.stack([src, dst, index]), axis=1, return_inverse=True)
        combo_paths = []
        for s, d, i in combos.T.tolist():
            paths = self.all_paths(s, d)
            if not 0 <= i < len(paths):
                raise ValueError(f"path index {i} out of range: {s}->{d} has {len(paths)} shortest paths")
            combo_paths.append(paths[i])
        per_combo = Incidence.from_paths(combo_paths, self.n_links)
        return per_combo.subset(inverse.reshape(-1))
