"""Any topology from a networkx-style edge list (``edges:FILE``), routed by BFS.

File format (what ``networkx.write_edgelist`` writes, and :meth:`Topology.write_edge_list`):
one full-duplex cable per line, ``u v [data]``, ``#`` starts a comment. ``data`` is either a
dict literal (``{'capacity': 10e9}``, ``{'capacity': '10Gbps'}``; ``capacity_reverse`` for a
different v->u rate; ``rate``/``bandwidth`` are accepted for ``capacity``) or one bare value
(``10Gbps``, ``1e10``), in bit/s; without it a cable runs at ``link_rate_bps``. Repeated lines
are parallel cables.

Hosts: nodes named ``h<i>`` are hosts ``i`` (they must be ``h0 .. h{H-1}``) and every other
node is a switch. If no node has such a name, every node is a host (nodes that are all integers
0..N-1 keep their number; otherwise hosts are numbered in order of first appearance). A host's
NICs are its cables in file order (NIC 0 = its first cable).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k edge
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mlfabric.topo.routing import GraphRouter
from mlfabric.topo.spec import TopologySpec
from mlfabric.topo.topology import Topology, parse_edge_data
from mlfabric.units import parse_rate

__all__ = ["from_edge_list"]

_HOST_NAME = re.compile(r"^h(\d+)$")


def _capacity(data: dict[str, object], key_order: tuple[str, ...], default: float, where: str) -> float:
    for key in key_order:
        if key in data:
            value = data[key]
            try:
                return parse_rate(value)  # type: ignore[arg-type]
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
    return default


def from_edge_list(path: str | Path, link_rate_bps: float) -> Topology:
    """Load an edge list file as a :class:`Topology` (see the module docstring for the format)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"edge list {str(path)!r} does not exist or is not a file")
    cables: list[tuple[str, str, float, float]] = []
    order: dict[str, int] = {}
    for number, raw in enumerate(file.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        parts = line.split(maxsplit=2)
        if len(parts) < 2:
            raise ValueError(f"{where}: expected 'u v [data]', got {raw!r}")
        u, v = parts[0], parts[1]
        if u == v:
            raise ValueError(f"{where}: self-loop on {u!r}")
        data = parse_edge_data(parts[2] if len(parts) == 3 else "", where)
        forward = _capacity(data, ("capacity", "rate", "bandwidth"), float(link_rate_bps), where)
        reverse = _capacity(data, ("capacity_reverse",), forward, where)
        for node in (u, v):
            order.setdefault(node, len(order))
        cables.append((u, v, forward, reverse))
    if not cables:
        raise ValueError(f"edge list {str(path)!r} has no edges")

    names = list(order)
    host_numbers = {name: int(m.group(1)) for name in names if (m := _HOST_NAME.match(name))}
    if host_numbers:
        n_hosts = len(host_numbers)
        if sorted(host_numbers.values()) != list(range(n_hosts)):
            raise ValueError(f"edge list {str(path)!r}: host nodes must be named h0 .. h{n_hosts - 1} without gaps")
        switches = [name for name in names if name not in host_numbers]
        node_id = dict(host_numbers)
        node_id.update({name: n_hosts + i for i, name in enumerate(switches)})
        node_names = [f"h{i}" for i in range(n_hosts)] + switches
    else:
        n_hosts = len(names)
        if all(name.isdigit() for name in names) and sorted(int(name) for name in names) == list(range(n_hosts)):
            node_id = {name: int(name) for name in names}
        else:
            node_id = {name: i for i, name in enumerate(names)}
        node_names = [""] * n_hosts
        for name, i in node_id.items():
            node_names[i] = name

    link_src: list[int] = []
    link_dst: list[int] = []
    capacity: list[float] = []
    cable_links: list[tuple[int, int]] = []
    nics: list[list[tuple[int, int]]] = [[] for _ in range(n_hosts)]
    for u, v, forward, reverse in cables:
        a, b = node_id[u], node_id[v]
        forward_link = len(link_src)
        link_src += [a, b]
        link_dst += [b, a]
        capacity += [forward, reverse]
        cable_links.append((forward_link, forward_link + 1))
        if a < n_hosts:
            nics[a].append((forward_link, forward_link + 1))
        if b < n_hosts:
            nics[b].append((forward_link + 1, forward_link))
    max_nics = max(1, max(len(host_nics) for host_nics in nics))
    nic_links = np.full((n_hosts, max_nics, 2), -1, dtype=np.int64)
    for host, host_nics in enumerate(nics):
        if not host_nics:
            raise ValueError(f"edge list {str(path)!r}: host {node_names[host]} has no cable")
        nic_links[host, : len(host_nics)] = host_nics

    src = np.asarray(link_src, dtype=np.int64)
    dst = np.asarray(link_dst, dtype=np.int64)
    # Layer 0: links leaving a host, 1: links entering a host, 2: switch-to-switch.
    layer = np.where(src < n_hosts, 0, np.where(dst < n_hosts, 1, 2))
    return Topology(
        spec=TopologySpec(kind="edges", params={"path": str(path)}),
        link_rate_bps=float(link_rate_bps),
        n_hosts=n_hosts,
        node_names=tuple(node_names),
        link_src=src,
        link_dst=dst,
        link_capacity=np.asarray(capacity, dtype=np.float64),
        link_layer=layer,
        layer_names=("host-out", "host-in", "switch-switch"),
        nic_links=nic_links,
        cables=np.asarray(cable_links, dtype=np.int64),
        router=GraphRouter(src, dst, len(node_names)),
    )
