"""Network topologies shared by the simulator, the emulator and the CLI, with routing.

``parse_topology("fat-tree:k=16,oversub=4", link_rate_bps=10e9)`` builds a :class:`Topology`
(hosts, switches, directed capacitated links, NICs) whose ``route_ecmp`` / ``route_spray``
turn ``(src, dst)`` host pairs into the flow-link incidence the max-min solver
(:mod:`mlfabric.flow`) consumes. Spec strings: ``star:n=16``, ``fat-tree:k=16,oversub=4``,
``racks:r=4,h=8,oversub=4``, ``bcube:n=4,k=2``, ``edges:FILE``. Capacity traces in the
emulator's CSV format load with :func:`load_capacity_trace`.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q
"""

from __future__ import annotations

from pathlib import Path

from mlfabric.topo.bcube import bcube
from mlfabric.topo.edges import from_edge_list
from mlfabric.topo.fat_tree import fat_tree
from mlfabric.topo.racks import racks, star
from mlfabric.topo.routing import GraphRouter, Router, ecmp_hash
from mlfabric.topo.spec import TOPOLOGY_KINDS, TopologySpec
from mlfabric.topo.topology import DIRECTIONS, Topology
from mlfabric.topo.trace import CapacityTrace, TraceRow, load_capacity_trace, write_capacity_trace
from mlfabric.units import parse_rate

__all__ = [
    "DIRECTIONS",
    "TOPOLOGY_KINDS",
    "CapacityTrace",
    "GraphRouter",
    "Router",
    "Topology",
    "TopologySpec",
    "TraceRow",
    "bcube",
    "build_topology",
    "ecmp_hash",
    "fat_tree",
    "from_edge_list",
    "load_capacity_trace",
    "parse_topology",
    "racks",
    "star",
    "write_capacity_trace",
]


def build_topology(spec: TopologySpec, link_rate_bps: float | str) -> Topology:
    """Build the topology a validated spec names, with host links at ``link_rate_bps`` (bit/s or '10Gbps')."""
    rate = parse_rate(link_rate_bps)
    if not rate > 0:
        raise ValueError(f"link rate must be > 0 bit/s, got {link_rate_bps!r}")
    params = spec.params
    if spec.kind == "star":
        return star(spec.int_param("n"), rate)
    if spec.kind == "fat-tree":
        return fat_tree(spec.int_param("k"), rate, oversub=spec.float_param("oversub"))
    if spec.kind == "racks":
        return racks(spec.int_param("r"), spec.int_param("h"), rate, oversub=spec.float_param("oversub"))
    if spec.kind == "bcube":
        return bcube(spec.int_param("n"), spec.int_param("k"), rate)
    if spec.kind == "edges":
        return from_edge_list(Path(str(params["path"])), rate)
    raise ValueError(f"no builder for topology kind {spec.kind!r}")  # unreachable: TopologySpec validates kinds


def parse_topology(spec: str | TopologySpec, link_rate_bps: float | str) -> Topology:
    """Parse a spec string (``'fat-tree:k=16,oversub=4'``) and build it with host links at ``link_rate_bps``."""
    parsed = spec if isinstance(spec, TopologySpec) else TopologySpec.parse(spec)
    return build_topology(parsed, link_rate_bps)
