"""The :class:`Topology` object: hosts, switches, directed links with capacities, NICs, routing.

Conventions (shared with the simulator and the emulator):

* nodes are integers: hosts are ``0 .. n_hosts-1``, switches follow (``n_hosts ..``);
* links are *directed*; a full-duplex cable is two links (``cables`` pairs them up);
* capacities are bit/s (``link_capacity``); the array is read-only, simulations change
  capacities through :class:`mlfabric.flow.FlowNetwork` or :meth:`Topology.with_capacity`;
* ``nic_links[h, i] = (egress link, ingress link)`` of host ``h``'s NIC ``i`` (-1 where a host
  has fewer NICs); BCube host ``h`` NIC ``l`` is its level-``l`` port;
* flows are ``(src_host, dst_host)`` pairs; routing returns an
  :class:`~mlfabric.flow.incidence.Incidence` for the max-min solver;
* optionally (:meth:`Topology.with_host_links`) every host has a *host-internal link*
  (``hN->hN``, layer ``host``) of its own rate: the shared-memory hop between ranks placed on
  one host, which the simulator then times and shares like any link (without it such
  transfers take no time).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from mlfabric.flow.incidence import Incidence
from mlfabric.topo.routing import GraphRouter, Router, ecmp_hash
from mlfabric.topo.spec import TopologySpec

__all__ = ["Topology", "FlowPairs", "DIRECTIONS"]

#: Direction names used by NIC lookups and capacity traces.
DIRECTIONS = ("egress", "ingress")

FlowPairs = np.ndarray | Sequence[tuple[int, int]] | Sequence[Sequence[int]]


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.array(array, copy=True)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False, kw_only=True)
class Topology:
    """A network of hosts and switches joined by directed, capacitated links, with its router."""

    spec: TopologySpec
    #: The nominal host link rate the topology was built with (bit/s).
    link_rate_bps: float
    n_hosts: int
    #: One name per node: hosts first (``h0, h1, ...``), then switches.
    node_names: tuple[str, ...]
    link_src: np.ndarray
    link_dst: np.ndarray
    link_capacity: np.ndarray
    #: Index into ``layer_names`` for every link (e.g. ``edge-agg``), for per-layer statistics.
    link_layer: np.ndarray
    layer_names: tuple[str, ...]
    nic_links: np.ndarray
    #: ``(n_cables, 2)``: the two directed links of each full-duplex cable.
    cables: np.ndarray
    router: Router = field(repr=False)
    #: ``host_links[h]``: the host-internal link of host h (:meth:`with_host_links`); None
    #: when the topology has none.
    host_links: np.ndarray | None = None

    def __post_init__(self) -> None:
        n_links = int(np.asarray(self.link_src).size)
        for name in ("link_src", "link_dst", "link_layer"):
            object.__setattr__(self, name, _readonly(np.asarray(getattr(self, name), dtype=np.int64)))
        object.__setattr__(self, "link_capacity", _readonly(np.asarray(self.link_capacity, dtype=np.float64)))
        object.__setattr__(self, "nic_links", _readonly(np.asarray(self.nic_links, dtype=np.int64)))
        object.__setattr__(self, "cables", _readonly(np.asarray(self.cables, dtype=np.int64).reshape(-1, 2)))
        if self.link_dst.size != n_links or self.link_capacity.size != n_links or self.link_layer.size != n_links:
            raise ValueError("link_src, link_dst, link_capacity and link_layer must have one entry per link")
        if len(self.node_names) < self.n_hosts:
            raise ValueError("node_names must name every host and switch")
        if n_links and (self.link_src.max() >= self.n_nodes or self.link_dst.max() >= self.n_nodes):
            raise ValueError("a link refers to a node that does not exist")
        if (self.link_capacity < 0).any() or np.isnan(self.link_capacity).any():
            raise ValueError("link capacities must be >= 0")
        if self.nic_links.shape[:1] != (self.n_hosts,) or self.nic_links.shape[2:] != (2,):
            raise ValueError(f"nic_links must have shape (n_hosts, n_nics, 2), got {self.nic_links.shape}")

    # ------------------------------------------------------------------ sizes and names

    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    @property
    def n_switches(self) -> int:
        return self.n_nodes - self.n_hosts

    @property
    def n_links(self) -> int:
        return int(self.link_src.size)

    @property
    def n_nics(self) -> int:
        """NICs per host (the largest count when hosts differ)."""
        return int(self.nic_links.shape[1])

    def is_host(self, node: int) -> bool:
        return 0 <= node < self.n_hosts

    def link_name(self, link: int) -> str:
        """``'h3->edge0_1'``: readable link names for errors and reports."""
        return f"{self.node_names[self.link_src[link]]}->{self.node_names[self.link_dst[link]]}"

    def links_in_layer(self, layer: str) -> np.ndarray:
        if layer not in self.layer_names:
            raise ValueError(f"unknown layer {layer!r}; this topology has {', '.join(self.layer_names)}")
        return np.flatnonzero(self.link_layer == self.layer_names.index(layer))

    def host_link(self, host: int, nic: int = 0, direction: str = "egress") -> int:
        """Link id of a host's NIC in one direction (``egress``: host->switch, ``ingress``: switch->host)."""
        if not self.is_host(host):
            raise ValueError(f"host {host} out of range [0, {self.n_hosts}) for {self.spec}")
        if not 0 <= nic < self.n_nics or self.nic_links[host, nic, 0] < 0:
            raise ValueError(f"host {host} has no NIC {nic} in {self.spec} (it has {self.n_nics_of(host)})")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} must be one of {DIRECTIONS}")
        return int(self.nic_links[host, nic, DIRECTIONS.index(direction)])

    def n_nics_of(self, host: int) -> int:
        return int((self.nic_links[host, :, 0] >= 0).sum())

    def host_nics(self, host: int) -> list[tuple[int, int]]:
        """``[(egress link, ingress link), ...]`` of a host's NICs, NIC 0 first."""
        if not self.is_host(host):
            raise ValueError(f"host {host} out of range [0, {self.n_hosts}) for {self.spec}")
        return [(int(out), int(into)) for out, into in self.nic_links[host].tolist() if out >= 0]

    def summary(self) -> dict[str, object]:
        """Counts and capacities per layer, for logs and reports."""
        layers = {}
        for index, name in enumerate(self.layer_names):
            members = self.link_layer == index
            if members.any():
                layers[name] = {
                    "links": int(members.sum()),
                    "capacity_bps": sorted(set(self.link_capacity[members].tolist())),
                }
        return {
            "spec": str(self.spec),
            "hosts": self.n_hosts,
            "switches": self.n_switches,
            "links": self.n_links,
            "nics_per_host": self.n_nics,
            "layers": layers,
        }

    # ------------------------------------------------------------------ capacities

    def with_capacity(self, capacity: np.ndarray) -> Topology:
        """A copy with other link capacities (same structure and router)."""
        capacity = np.asarray(capacity, dtype=np.float64)
        if capacity.shape != (self.n_links,):
            raise ValueError(f"capacity has shape {capacity.shape}, expected ({self.n_links},)")
        return replace(self, link_capacity=capacity)

    def with_host_links(self, rate_bps: float) -> Topology:
        """A copy where every host also has a host-internal link of ``rate_bps`` (the
        shared-memory hop between its ranks), appended after the other links in a layer
        ``host``; routes between distinct hosts are unchanged."""
        if not rate_bps > 0:
            raise ValueError(f"the host-internal rate must be positive, got {rate_bps} bit/s")
        if self.host_links is not None:
            raise ValueError(f"{self.spec} already has host-internal links")
        hosts = np.arange(self.n_hosts, dtype=np.int64)
        layers = (*self.layer_names, "host")
        return replace(
            self, link_src=np.concatenate([self.link_src, hosts]), link_dst=np.concatenate([self.link_dst, hosts]),
            link_capacity=np.concatenate([self.link_capacity, np.full(self.n_hosts, float(rate_bps))]),
            link_layer=np.concatenate([self.link_layer, np.full(self.n_hosts, len(layers) - 1, dtype=np.int64)]),
            layer_names=layers, host_links=_readonly(self.n_links + hosts))

    def capacity(self) -> np.ndarray:
        """A writable copy of the link capacities (bit/s)."""
        return np.array(self.link_capacity, copy=True)

    # ------------------------------------------------------------------ routing

    def _pairs(self, flows: FlowPairs) -> tuple[np.ndarray, np.ndarray]:
        array = np.asarray(flows, dtype=np.int64)
        if array.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if array.ndim != 2 or array.shape[1] != 2:
            raise ValueError(f"flows must be (src, dst) host pairs, shape (n, 2); got shape {array.shape}")
        src, dst = array[:, 0].copy(), array[:, 1].copy()
        bad = (src < 0) | (src >= self.n_hosts) | (dst < 0) | (dst >= self.n_hosts)
        if bad.any():
            index = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"flow {index} ({src[index]}->{dst[index]}) names a host outside [0, {self.n_hosts}) of {self.spec}"
            )
        return src, dst

    def paths(self, src: int, dst: int) -> list[tuple[int, ...]]:
        """All shortest paths between two hosts as tuples of link ids, lexicographically ordered."""
        self._pairs([(src, dst)])
        return self.router.paths(int(src), int(dst))

    def n_paths(self, flows: FlowPairs) -> np.ndarray:
        """Number of shortest paths of each flow."""
        src, dst = self._pairs(flows)
        return self.router.path_counts(src, dst)

    def ecmp_index(self, flows: FlowPairs, *, seed: int = 0, flow_keys: np.ndarray | None = None) -> np.ndarray:
        """Which shortest path (index into :meth:`paths`) per-flow ECMP picks for each flow."""
        src, dst = self._pairs(flows)
        keys = np.arange(src.size, dtype=np.int64) if flow_keys is None else np.asarray(flow_keys, dtype=np.int64)
        if keys.shape != src.shape:
            raise ValueError(f"flow_keys has shape {keys.shape}, expected ({src.size},)")
        counts = self.router.path_counts(src, dst)
        return (ecmp_hash(src, dst, keys, seed) % counts.astype(np.uint64)).astype(np.int64)

    def route_ecmp(self, flows: FlowPairs, *, seed: int = 0, flow_keys: np.ndarray | None = None) -> Incidence:
        """Seeded per-flow ECMP: each flow takes one shortest path chosen by hashing (seed, src, dst, key).

        ``flow_keys`` (default: each flow's position) stands in for the 5-tuple's ports: give
        stable keys (e.g. flow ids) when the same flow must keep its path across calls.
        """
        src, dst = self._pairs(flows)
        index = self.ecmp_index(flows, seed=seed, flow_keys=flow_keys)
        return self.router.select(src, dst, index)

    def route_fixed(self, flows: FlowPairs, path_index: int | np.ndarray = 0) -> Incidence:
        """Each flow on a chosen shortest path (``path_index`` into :meth:`paths`, per flow or for all)."""
        src, dst = self._pairs(flows)
        index = np.broadcast_to(np.asarray(path_index, dtype=np.int64), src.shape).copy()
        counts = self.router.path_counts(src, dst)
        bad = (index < 0) | (index >= counts)
        if bad.any():
            f = int(np.flatnonzero(bad)[0])
            raise ValueError(f"flow {f} ({src[f]}->{dst[f]}): path index {index[f]} out of range, it has {counts[f]} shortest paths")
        return self.router.select(src, dst, index)

    def route_spray(self, flows: FlowPairs) -> Incidence:
        """Packet spraying: each flow split evenly over all its shortest paths (fractional link weights)."""
        src, dst = self._pairs(flows)
        return self.router.spray(src, dst)

    def generic_router(self) -> GraphRouter:
        """A BFS router over this topology's graph (for cross-checking structural routers)."""
        return GraphRouter(self.link_src, self.link_dst, self.n_nodes)

    # ------------------------------------------------------------------ export

    def write_edge_list(self, path: str | Path) -> None:
        """Write the cables as a networkx-style edge list readable by ``edges:PATH``.

        One line per cable, ``u v {'capacity': <bit/s>}`` (plus ``capacity_reverse`` when the
        two directions differ); hosts are named ``h<i>`` so the loader recognises them.
        """
        lines = [f"# {self.spec} ({self.n_hosts} hosts, {self.n_switches} switches, {len(self.cables)} cables)"]
        for forward, reverse in self.cables.tolist():
            data: dict[str, float] = {"capacity": float(self.link_capacity[forward])}
            if self.link_capacity[reverse] != self.link_capacity[forward]:
                data["capacity_reverse"] = float(self.link_capacity[reverse])
            u = self.node_names[self.link_src[forward]]
            v = self.node_names[self.link_dst[forward]]
            lines.append(f"{u} {v} {data!r}")
        Path(path).write_text("\n".join(lines) + "\n")


def parse_edge_data(text: str, where: str) -> dict[str, object]:
    """The data column of an edge-list line: a dict literal (``{'capacity': 1e9}``) or one value."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{where}: cannot parse edge data {text!r} as a dict literal") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: edge data {text!r} is not a dict")
        return value
    return {"capacity": text}
