"""Three-tier k-ary fat-tree (``fat-tree:k=16,oversub=4``) with structural, vectorized routing.

Structure (Al-Fares et al.; MLNET's 1,024-host evaluation is k=16: 320 16-port switches):
``k`` pods, each with ``k/2`` edge (ToR) and ``k/2`` aggregation switches; ``(k/2)^2`` core
switches; ``k/2`` hosts per edge switch, ``k^3/4`` hosts in all. Edge switch ``e`` of pod ``p``
connects to every aggregation switch of its pod; aggregation switch ``a`` of every pod connects
to the ``k/2`` cores of core group ``a`` (cores ``a*k/2 .. a*k/2 + k/2 - 1``).

Oversubscription ``oversub = s`` is applied at the ToR uplinks: each edge<->aggregation link
runs at ``link_rate / s``, so the ``k/2`` hosts under a ToR can offer ``s`` times what can
leave the rack. Aggregation<->core links run at the full rate; an aggregation switch then has
``k/2`` downlinks at ``rate/s`` and ``k/2`` uplinks at ``rate``, so oversubscription is not
compounded above the ToRs and the whole fabric is ``s``:1 end to end.

Link ids (H hosts, E = k^3/4 cables per switch tier, ``half = k/2``):

==========================  =====================================================
``h``                       host ``h`` -> its edge switch
``H + h``                   edge switch -> host ``h``
``2H + ge*half + a``        edge switch ``ge`` (global id ``p*half + e``) -> agg ``a`` of its pod
``2H + E + ge*half + a``    that agg -> edge switch ``ge``
``2H + 2E + ga*half + j``   agg ``ga`` (global id ``p*half + a``) -> core ``a*half + j``
``2H + 3E + ga*half + j``   that core -> agg ``ga``
==========================  =====================================================

Shortest paths: same edge switch 1 (2 links); same pod ``k/2`` (4 links, one per agg);
different pods ``(k/2)^2`` (6 links, path index ``a*half + j``), which is also their
lexicographic order by link ids.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k fat_tree
"""

from __future__ import annotations

import numpy as np

from mlfabric.flow.incidence import Incidence
from mlfabric.topo.routing import Router, incidence_from_blocks
from mlfabric.topo.spec import TopologySpec
from mlfabric.topo.topology import Topology

__all__ = ["fat_tree", "FatTreeRouter"]

LAYERS = ("host-edge", "edge-host", "edge-agg", "agg-edge", "agg-core", "core-agg")


class FatTreeRouter(Router):
    """Closed-form shortest paths of a k-ary fat-tree (no graph search; vectorized over flows)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.half = k // 2
        self.n_hosts = k * self.half * self.half
        self.n_cables = self.n_hosts  # per tier: k*half edge switches x half uplinks, same for aggs
        h, e = self.n_hosts, self.n_cables
        self.host_up, self.host_down = 0, h
        self.edge_up, self.agg_down = 2 * h, 2 * h + e
        self.agg_up, self.core_down = 2 * h + 2 * e, 2 * h + 3 * e
        self.n_links = 2 * h + 4 * e

    def _locate(self, host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pod, global edge switch id) of each host."""
        edge = host // self.half
        return edge // self.half, edge

    def path_counts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        src_pod, src_edge = self._locate(np.asarray(src))
        dst_pod, dst_edge = self._locate(np.asarray(dst))
        counts = np.ones(np.shape(src), dtype=np.int64)
        counts[(src_pod == dst_pod) & (src_edge != dst_edge)] = self.half
        counts[src_pod != dst_pod] = self.half * self.half
        return counts

    def _padded_paths(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> np.ndarray:
        """``(n, 6)`` link ids of each flow's chosen path, padded with -1 (paths of 0, 2, 4 or 6 links)."""
        half = self.half
        src_pod, src_edge = self._locate(src)
        dst_pod, dst_edge = self._locate(dst)
        agg = np.where(src_pod == dst_pod, index, index // half)
        core = index % half
        up = self.host_up + src
        down = self.host_down + dst
        edge_up = self.edge_up + src_edge * half + agg
        agg_down = self.agg_down + dst_edge * half + agg
        agg_up = self.agg_up + (src_pod * half + agg) * half + core
        core_down = self.core_down + (dst_pod * half + agg) * half + core
        paths = np.full((src.size, 6), -1, dtype=np.int64)
        same_host = src == dst
        same_edge = (src_edge == dst_edge) & ~same_host
        same_pod = (src_pod == dst_pod) & (src_edge != dst_edge)
        other_pod = src_pod != dst_pod
        paths[same_edge, 0] = up[same_edge]
        paths[same_edge, 1] = down[same_edge]
        paths[same_pod, :4] = np.stack([up, edge_up, agg_down, down], axis=1)[same_pod]
        paths[other_pod] = np.stack([up, edge_up, agg_up, core_down, agg_down, down], axis=1)[other_pod]
        return paths

    def select(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> Incidence:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        index = np.asarray(index, dtype=np.int64)
        counts = self.path_counts(src, dst)
        if ((index < 0) | (index >= counts)).any():
            raise ValueError("path index out of range for a fat-tree flow")
        return Incidence.from_padded(self._padded_paths(src, dst, index), self.n_links)

    def spray(self, src: np.ndarray, dst: np.ndarray) -> Incidence:
        """Even split over all shortest paths, built in closed form (an inter-pod flow touches
        2 host links, k/2 ToR uplinks and agg downlinks at 1/(k/2), and (k/2)^2 core links each
        way at 1/(k/2)^2)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        half = self.half
        src_pod, src_edge = self._locate(src)
        dst_pod, dst_edge = self._locate(dst)
        aggs = np.arange(half, dtype=np.int64)
        cores = np.arange(half * half, dtype=np.int64)  # index a*half + j
        blocks = []

        rows = np.flatnonzero((src_edge == dst_edge) & (src != dst))
        links = np.stack([self.host_up + src[rows], self.host_down + dst[rows]], axis=1)
        blocks.append((rows, links, np.ones(links.shape)))

        rows = np.flatnonzero((src_pod == dst_pod) & (src_edge != dst_edge))
        links = np.concatenate(
            [
                (self.host_up + src[rows])[:, None],
                self.edge_up + src_edge[rows, None] * half + aggs[None, :],
                self.agg_down + dst_edge[rows, None] * half + aggs[None, :],
                (self.host_down + dst[rows])[:, None],
            ],
            axis=1,
        )
        weights = np.concatenate([np.ones((rows.size, 1)), np.full((rows.size, 2 * half), 1.0 / half), np.ones((rows.size, 1))], axis=1)
        blocks.append((rows, links, weights))

        rows = np.flatnonzero(src_pod != dst_pod)
        links = np.concatenate(
            [
                (self.host_up + src[rows])[:, None],
                self.edge_up + src_edge[rows, None] * half + aggs[None, :],
                self.agg_up + (src_pod[rows, None] * half) * half + cores[None, :],
                self.core_down + (dst_pod[rows, None] * half) * half + cores[None, :],
                self.agg_down + dst_edge[rows, None] * half + aggs[None, :],
                (self.host_down + dst[rows])[:, None],
            ],
            axis=1,
        )
        # agg_up id offset (p*half + a)*half + j == p*half*half + (a*half + j): hence the core offsets above.
        weights = np.concatenate(
            [
                np.ones((rows.size, 1)),
                np.full((rows.size, half), 1.0 / half),
                np.full((rows.size, 2 * half * half), 1.0 / (half * half)),
                np.full((rows.size, half), 1.0 / half),
                np.ones((rows.size, 1)),
            ],
            axis=1,
        )
        blocks.append((rows, links, weights))
        return incidence_from_blocks(src.size, self.n_links, blocks)


def fat_tree(k: int, link_rate_bps: float, *, oversub: float = 1.0) -> Topology:
    """Build the k-ary fat-tree; host links at ``link_rate_bps``, ToR uplinks at ``link_rate_bps / oversub``."""
    if k < 2 or k % 2:
        raise ValueError(f"fat-tree k must be an even number >= 2, got {k}")
    if not oversub > 0:
        raise ValueError(f"fat-tree oversub must be > 0, got {oversub}")
    router = FatTreeRouter(k)
    half = router.half
    n_hosts = router.n_hosts
    n_edge = k * half
    n_agg = k * half
    edge_node0 = n_hosts
    agg_node0 = n_hosts + n_edge
    core_node0 = n_hosts + n_edge + n_agg

    hosts = np.arange(n_hosts)
    host_edge = edge_node0 + hosts // half
    edge_ids = np.repeat(np.arange(n_edge), half)  # cable i = ge*half + a
    edge_aggs = np.tile(np.arange(half), n_edge)
    edge_agg_node = agg_node0 + (edge_ids // half) * half + edge_aggs
    agg_ids = np.repeat(np.arange(n_agg), half)  # cable i = ga*half + j
    agg_cores = np.tile(np.arange(half), n_agg)
    agg_core_node = core_node0 + (agg_ids % half) * half + agg_cores

    link_src = np.concatenate([hosts, host_edge, edge_node0 + edge_ids, edge_agg_node, agg_node0 + agg_ids, agg_core_node])
    link_dst = np.concatenate([host_edge, hosts, edge_agg_node, edge_node0 + edge_ids, agg_core_node, agg_node0 + agg_ids])
    rate = float(link_rate_bps)
    capacity = np.concatenate(
        [
            np.full(2 * n_hosts, rate),
            np.full(2 * router.n_cables, rate / oversub),
            np.full(2 * router.n_cables, rate),
        ]
    )
    layer = np.repeat(np.arange(6), [n_hosts, n_hosts, router.n_cables, router.n_cables, router.n_cables, router.n_cables])
    names = [f"h{i}" for i in range(n_hosts)]
    names += [f"edge{p}_{e}" for p in range(k) for e in range(half)]
    names += [f"agg{p}_{a}" for p in range(k) for a in range(half)]
    names += [f"core{a}_{j}" for a in range(half) for j in range(half)]
    cable_ids = np.arange(router.n_cables)
    cables = np.concatenate(
        [
            np.stack([router.host_up + hosts, router.host_down + hosts], axis=1),
            np.stack([router.edge_up + cable_ids, router.agg_down + cable_ids], axis=1),
            np.stack([router.agg_up + cable_ids, router.core_down + cable_ids], axis=1),
        ]
    )
    nic_links = np.stack([router.host_up + hosts, router.host_down + hosts], axis=1)[:, None, :]
    oversub_value: float | int = int(oversub) if float(oversub).is_integer() else float(oversub)
    return Topology(
        spec=TopologySpec(kind="fat-tree", params={"k": k, "oversub": oversub_value}),
        link_rate_bps=rate,
        n_hosts=n_hosts,
        node_names=tuple(names),
        link_src=link_src,
        link_dst=link_dst,
        link_capacity=capacity,
        link_layer=layer,
        layer_names=LAYERS,
        nic_links=nic_links,
        cables=cables,
        router=router,
    )
