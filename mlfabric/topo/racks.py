"""One-switch stars (``star:n=16``) and two-tier racks (``racks:r=4,h=8,oversub=4``).

``star``: n hosts on one switch; host ``i`` has links ``i`` (host -> switch) and ``n + i``.

``racks``: ``r`` ToR switches with ``h`` hosts each, all ToRs under one core switch. Host
``x = rack*h + i``; links ``x`` (host -> ToR), ``H + x`` (ToR -> host), ``2H + t`` (ToR ``t``
-> core), ``2H + r + t`` (core -> ToR ``t``). Each ToR uplink carries ``h * link_rate /
oversub`` so that a rack's hosts together can offer ``oversub`` times what leaves the rack
(``oversub=1``: a non-blocking two-tier network).

Both have exactly one shortest path per host pair: 2 links inside a rack, 4 across racks.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k "star or racks"
"""

from __future__ import annotations

import numpy as np

from mlfabric.flow.incidence import Incidence
from mlfabric.topo.routing import Router
from mlfabric.topo.spec import TopologySpec
from mlfabric.topo.topology import Topology

__all__ = ["star", "racks", "TwoTierRouter"]


class TwoTierRouter(Router):
    """Single-path routing for hosts grouped in racks under one core (a star is one rack, no core)."""

    def __init__(self, n_racks: int, hosts_per_rack: int, *, has_core: bool) -> None:
        self.n_racks = n_racks
        self.hosts_per_rack = hosts_per_rack
        self.n_hosts = n_racks * hosts_per_rack
        self.has_core = has_core
        self.n_links = 2 * self.n_hosts + (2 * n_racks if has_core else 0)

    def path_counts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        return np.ones(np.shape(src), dtype=np.int64)

    def select(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> Incidence:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if (np.asarray(index) != 0).any():
            raise ValueError("path index out of range: star and racks topologies have one shortest path per pair")
        h = self.n_hosts
        src_rack = src // self.hosts_per_rack
        dst_rack = dst // self.hosts_per_rack
        paths = np.full((src.size, 4), -1, dtype=np.int64)
        differ = src != dst
        same_rack = (src_rack == dst_rack) & differ
        paths[same_rack, 0] = src[same_rack]
        paths[same_rack, 1] = h + dst[same_rack]
        cross = src_rack != dst_rack
        paths[cross] = np.stack([src, 2 * h + src_rack, 2 * h + self.n_racks + dst_rack, h + dst], axis=1)[cross]
        return Incidence.from_padded(paths, self.n_links)


def _host_arrays(n_hosts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hosts = np.arange(n_hosts)
    nic_links = np.stack([hosts, n_hosts + hosts], axis=1)[:, None, :]
    cables = np.stack([hosts, n_hosts + hosts], axis=1)
    return hosts, nic_links, cables


def star(n: int, link_rate_bps: float) -> Topology:
    """n hosts on one switch, every link at ``link_rate_bps``."""
    if n < 1:
        raise ValueError(f"star needs n >= 1 hosts, got {n}")
    hosts, nic_links, cables = _host_arrays(n)
    switch = np.full(n, n)
    rate = float(link_rate_bps)
    return Topology(
        spec=TopologySpec(kind="star", params={"n": n}),
        link_rate_bps=rate,
        n_hosts=n,
        node_names=tuple([f"h{i}" for i in range(n)] + ["sw"]),
        link_src=np.concatenate([hosts, switch]),
        link_dst=np.concatenate([switch, hosts]),
        link_capacity=np.full(2 * n, rate),
        link_layer=np.repeat([0, 1], n),
        layer_names=("host-switch", "switch-host"),
        nic_links=nic_links,
        cables=cables,
        router=TwoTierRouter(1, n, has_core=False),
    )


def racks(r: int, h: int, link_rate_bps: float, *, oversub: float = 1.0) -> Topology:
    """r racks of h hosts under one core; ToR uplinks at ``h * link_rate_bps / oversub``."""
    if r < 1 or h < 1:
        raise ValueError(f"racks needs r >= 1 and h >= 1, got r={r}, h={h}")
    if not oversub > 0:
        raise ValueError(f"racks oversub must be > 0, got {oversub}")
    n_hosts = r * h
    hosts, nic_links, cables = _host_arrays(n_hosts)
    tors = np.arange(r)
    tor_node = n_hosts + hosts // h
    tor_nodes = n_hosts + tors
    core = np.full(r, n_hosts + r)
    rate = float(link_rate_bps)
    uplink = h * rate / oversub
    oversub_value: float | int = int(oversub) if float(oversub).is_integer() else float(oversub)
    return Topology(
        spec=TopologySpec(kind="racks", params={"r": r, "h": h, "oversub": oversub_value}),
        link_rate_bps=rate,
        n_hosts=n_hosts,
        node_names=tuple([f"h{i}" for i in range(n_hosts)] + [f"tor{t}" for t in range(r)] + ["core"]),
        link_src=np.concatenate([hosts, tor_node, tor_nodes, core]),
        link_dst=np.concatenate([tor_node, hosts, core, tor_nodes]),
        link_capacity=np.concatenate([np.full(2 * n_hosts, rate), np.full(2 * r, uplink)]),
        link_layer=np.repeat([0, 1, 2, 3], [n_hosts, n_hosts, r, r]),
        layer_names=("host-tor", "tor-host", "tor-core", "core-tor"),
        nic_links=nic_links,
        cables=np.concatenate([cables, np.stack([2 * n_hosts + tors, 2 * n_hosts + r + tors], axis=1)]),
        router=TwoTierRouter(r, h, has_core=True),
    )
