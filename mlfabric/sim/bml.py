"""BML in the simulator: gradient synchronization time (GST) of BML, PS and hierarchical
synchronization on BCube and Fat-Tree (papers/bml.txt §2-3.3, Fig. 5).

The GST of one allreduce is the simulated makespan of the collective's schedules (the ones
the runtime executes, ``mlfabric.collectives``) with no compute, in units of
``T_F = gradient bytes x 8 / link rate``, the time one link needs for the full gradient.
The four bars of BML Fig. 5:

==========================  =====================================  ==============================
bar                         what runs                              paper's theory (x T_F)
==========================  =====================================  ==============================
BML/BCube                   ``bcube`` on ``bcube:n=..,k=..``        ``2 (N-1) / (k N)`` (§3.2)
PS/BCube                    ``ps`` (P2P parameter server), same     ``2 x`` BML (§3.3)
Hierarchical/Fat-Tree       ``hierarchical``, radices of            ``2 (N-1) / N`` (§3.3)
                            :func:`~mlfabric.collectives.bcube.hierarchy_of`
PS/Fat-Tree                 ``ps`` on ``fat-tree:k=..``             ``2 (N-1) / N`` (§2)
==========================  =====================================  ==============================

16 servers are BCube(4,2) and Fat-Tree(4), 1,024 servers BCube(32,2) and Fat-Tree(16).

Routing defaults to packet spraying (every flow split evenly over its shortest paths): the
fluid model of a non-blocking fabric that the paper's closed forms assume. BML's transfers
are all 1-hop, so its routing is fixed; per-flow ECMP (``routing="ecmp"``) makes the
Fat-Tree baselines slower through hash collisions (see docs/results.md).

Besides the paper's "2 x BML" for PS on BCube, :func:`ps_bcube_bound_tf` gives the exact
link-load bound of a uniform all-to-all on BCube(n,k): ``2 (n-1)/n x T_F`` (every host's
``k`` uplinks carry its own and its relayed traffic). It is ``k N (n-1) / (n (N-1))`` times
BML's GST: 1.6 on BCube(4,2), 1.94 on BCube(32,2); "double" is the large-``n`` limit.

Cost: the 16-server panel takes well under a second. The 1,024-server one takes minutes and
~16 GB, nearly all of it PS on Fat-Tree(16): 2.1M flows, each inter-pod flow sprayed over
146 links (the engine's incidence holds ~150M entries during the push).

Exercise it with::

    mlfabric simulate bml --servers 16 [--json out.json]
    .venv/bin/python -m pytest tests/unit/test_sim_bml.py -q
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from mlfabric.collectives.bcube import closed_form_gst, shape_options
from mlfabric.topo import parse_topology
from mlfabric.topo.spec import TopologySpec
from mlfabric.units import parse_rate

from .engine import EngineConfig
from .workloads import simulate_collective

__all__ = [
    "BARS",
    "FIG5_SETUPS",
    "GST_CHECK_CASES",
    "GSTCheck",
    "GSTResult",
    "bar_theory_tf",
    "figure5",
    "gradient_bytes",
    "gst_checks",
    "predicted_gst_s",
    "ps_bcube_bound_tf",
    "simulate_gst",
]

#: The bars of BML Fig. 5: (label, algorithm, which topology of the panel).
BARS: tuple[tuple[str, str, str], ...] = (
    ("BML/BCube", "bcube", "bcube"),
    ("PS/BCube", "ps", "bcube"),
    ("Hierarchical/Fat-Tree", "hierarchical", "fat-tree"),
    ("PS/Fat-Tree", "ps", "fat-tree"),
)
#: Servers -> (BCube spec, Fat-Tree spec) of each Fig. 5 panel.
FIG5_SETUPS: dict[int, tuple[str, str]] = {
    16: ("bcube:n=4,k=2", "fat-tree:k=4"),
    1024: ("bcube:n=32,k=2", "fat-tree:k=16"),
}
#: BCube(n, k) of the GST check (BML §3.2's closed form within ``rtol``).
GST_CHECK_CASES: tuple[tuple[int, int], ...] = ((4, 2), (3, 2), (32, 2), (8, 3))
#: The GST is scale-free in the fluid model, so the size only has to cut into exact pieces;
#: ~100 MB keeps the absolute times readable.
NOMINAL_BYTES = 100_000_000
DEFAULT_RATE = "10Gbps"


@dataclass(frozen=True, kw_only=True)
class GSTResult:
    """One simulated allreduce: its GST in seconds and in units of ``T_F``."""

    algorithm: str
    topology: str
    servers: int
    size_bytes: int
    link_rate_bps: float
    routing: str
    gst_s: float
    gst_tf: float
    flows: int
    #: Wall time of the whole simulation (schedule build, compile and engine).
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class GSTCheck:
    """Simulated BML GST on BCube(n, k) against ``2 (N-1)/(k N) x T_F``."""

    n: int
    k: int
    simulated_tf: float
    closed_form_tf: float
    rtol: float
    wall_s: float

    @property
    def rel_error(self) -> float:
        return abs(self.simulated_tf - self.closed_form_tf) / self.closed_form_tf

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.rtol

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rel_error": self.rel_error, "ok": self.ok}


def _spec(topology: str | TopologySpec) -> TopologySpec:
    return topology if isinstance(topology, TopologySpec) else TopologySpec.parse(topology)


def _threads(spec: TopologySpec) -> int:
    """BML's threads per host: k on BCube(n,k), 1 elsewhere (pieces per host = threads x N)."""
    return int(spec.params["k"]) if spec.kind == "bcube" else 1


def _hosts(spec: TopologySpec) -> int:
    p = spec.params
    if spec.kind == "bcube":
        return int(p["n"]) ** int(p["k"])
    if spec.kind == "fat-tree":
        return int(p["k"]) ** 3 // 4
    # Other kinds: build the topology once to count (cheap next to a simulation).
    return parse_topology(spec, 1.0).n_hosts


def gradient_bytes(topologies: Sequence[str | TopologySpec], *, itemsize: int = 4,
                   target: int = NOMINAL_BYTES) -> int:
    """The largest size <= ``target`` (at least one unit) that every topology cuts into exact
    pieces: a multiple of ``threads x N x itemsize`` for each (BML's ``k N`` pieces; the
    parameter server's and hierarchical's ``N`` shards divide it too)."""
    unit = itemsize
    for topology in topologies:
        spec = _spec(topology)
        unit = math.lcm(unit, _threads(spec) * _hosts(spec) * itemsize)
    return max(target // unit, 1) * unit


@lru_cache(maxsize=32)
def _simulate(algorithm: str, spec: TopologySpec, rate_bps: float, size_bytes: int, itemsize: int,
              routing: str) -> GSTResult:
    # Cached: the CLI's figure and GST check share BCube runs, the tests share the 16-server
    # ones; only this small record is kept, not the task graph.
    wall0 = time.perf_counter()
    result = simulate_collective(algorithm, str(spec), rate_bps, size_bytes=size_bytes, itemsize=itemsize,
                                 config=EngineConfig(routing=routing), **shape_options(algorithm, spec))
    full_transfer_s = size_bytes * 8.0 / rate_bps
    return GSTResult(algorithm=algorithm, topology=str(spec), servers=result.topology.n_hosts, size_bytes=size_bytes,
                     link_rate_bps=rate_bps, routing=routing, gst_s=result.time_s,
                     gst_tf=result.time_s / full_transfer_s, flows=result.flows, wall_s=time.perf_counter() - wall0)


def simulate_gst(algorithm: str, topology: str | TopologySpec, *, rate: float | str = DEFAULT_RATE,
                 size_bytes: int | None = None, itemsize: int = 4, routing: str = "spray") -> GSTResult:
    """Simulate one allreduce (``"bcube"``, ``"ps"``, ``"hierarchical"``, ``"ring"``, ...) on
    every host of ``topology``; ``size_bytes`` defaults to :func:`gradient_bytes` of it."""
    spec = _spec(topology)
    size = gradient_bytes([spec], itemsize=itemsize) if size_bytes is None else int(size_bytes)
    return _simulate(algorithm, spec, parse_rate(rate), size, itemsize, routing)


def ps_bcube_bound_tf(n: int, k: int) -> float:
    """Link-load bound of the P2P PS on BCube(n,k), in ``T_F``: ``2 (n-1)/n``.

    Push (and pull) is a uniform all-to-all of ``P/N`` per pair. ``C(k,q) (n-1)^q`` peers are
    ``q`` hops away, so a host's uplinks carry ``P/N x sum_q q C(k,q) (n-1)^q = P k (n-1)/n``
    (own traffic plus, by symmetry, what it relays); spread over ``k`` NICs that is
    ``(n-1)/n x T_F`` per phase.
    """
    return 2.0 * (n - 1) / n


def bar_theory_tf(label: str, bcube_spec: str | TopologySpec, fat_tree_spec: str | TopologySpec) -> float:
    """The paper's theoretical GST of a Fig. 5 bar, in ``T_F``."""
    bc, ft = _spec(bcube_spec), _spec(fat_tree_spec)
    n, k = int(bc.params["n"]), int(bc.params["k"])
    if label == "BML/BCube":
        return closed_form_gst(n, k, 1.0)
    if label == "PS/BCube":
        return 2.0 * closed_form_gst(n, k, 1.0)  # §3.3: "it will double the GST"
    if label in ("Hierarchical/Fat-Tree", "PS/Fat-Tree"):
        hosts = _hosts(ft)
        return 2.0 * (hosts - 1) / hosts
    raise ValueError(f"unknown Fig. 5 bar {label!r}; choose one of {', '.join(b[0] for b in BARS)}")


def figure5(servers: Sequence[int] = (16, 1024), *, rate: float | str = DEFAULT_RATE, itemsize: int = 4,
            routing: str = "spray", on_bar: Callable[[int, str], None] | None = None) -> list[dict[str, Any]]:
    """BML Fig. 5: one row per (servers, bar) with the simulated GST and the paper's theory.

    Each panel uses one gradient size for its four bars (exact pieces on both topologies).
    Rows: ``servers``, ``bar``, ``name`` (bar and shape: ``"BML/BCube(4,2)"``), ``algorithm``, ``topology``, ``gst_tf``, ``theory_tf``,
    ``sim_vs_theory``, ``gst_s``, ``size_bytes``, ``flows``, ``wall_s`` (and ``bound_tf``,
    the link-load bound, for PS/BCube). ``on_bar(servers, label)`` is called before each
    simulation (a progress display: 1,024-server bars take up to minutes).
    """
    rows: list[dict[str, Any]] = []
    for count in servers:
        if count not in FIG5_SETUPS:
            raise ValueError(f"Fig. 5 has {', '.join(map(str, FIG5_SETUPS))} servers, not {count}")
        bcube_spec, fat_tree_spec = FIG5_SETUPS[count]
        size = gradient_bytes([bcube_spec, fat_tree_spec], itemsize=itemsize)
        for label, algorithm, where in BARS:
            topology = bcube_spec if where == "bcube" else fat_tree_spec
            if on_bar is not None:
                on_bar(count, label)
            result = simulate_gst(algorithm, topology, rate=rate, size_bytes=size, itemsize=itemsize, routing=routing)
            theory = bar_theory_tf(label, bcube_spec, fat_tree_spec)
            spec = _spec(topology)
            shape = (f"({spec.params['n']},{spec.params['k']})" if spec.kind == "bcube" else f"({spec.params['k']})")
            row: dict[str, Any] = {
                "servers": count, "bar": label, "name": label + shape, "algorithm": algorithm, "topology": result.topology,
                "gst_tf": result.gst_tf, "theory_tf": theory, "sim_vs_theory": result.gst_tf / theory,
                "gst_s": result.gst_s, "size_bytes": size, "link_rate_bps": result.link_rate_bps,
                "routing": routing, "flows": result.flows, "wall_s": result.wall_s,
            }
            if label == "PS/BCube":
                row["bound_tf"] = ps_bcube_bound_tf(int(spec.params["n"]), int(spec.params["k"]))
            rows.append(row)
    return rows


def gst_checks(cases: Sequence[tuple[int, int]] = GST_CHECK_CASES, *, rtol: float = 1e-3,
               rate: float | str = DEFAULT_RATE, itemsize: int = 4, routing: str = "spray",
               on_case: Callable[[int, int], None] | None = None) -> list[GSTCheck]:
    """Simulated BML GST on each BCube(n, k) against ``2 (N-1)/(k N) x T_F`` (BML §3.2)."""
    checks = []
    for n, k in cases:
        if on_case is not None:
            on_case(n, k)
        # BML only talks to 1-hop neighbours (one path each), so routing changes nothing; it
        # is passed on so that the check shares Fig. 5's cached BCube(32,2) run.
        result = simulate_gst("bcube", f"bcube:n={n},k={k}", rate=rate, itemsize=itemsize, routing=routing)
        checks.append(GSTCheck(n=n, k=k, simulated_tf=result.gst_tf, closed_form_tf=closed_form_gst(n, k, 1.0),
                               rtol=rtol, wall_s=result.wall_s))
    return checks


def predicted_gst_s(algorithm: str, topology_spec: str | TopologySpec, rate: float | str, size_bytes: int, *,
                    itemsize: int = 4, routing: str = "spray") -> float:
    """Simulated GST in seconds of one ``algorithm`` allreduce of ``size_bytes`` on every host
    of ``topology_spec`` at ``rate`` (bit/s or ``"500Mbps"``): the figure an emulated run is
    compared with. ``"bcube"`` takes n, k and ``"hierarchical"`` its radices from the spec.
    Unlike :func:`figure5`, the size is used as given (``size_bytes // itemsize`` elements),
    so uneven pieces cost what the schedule really costs."""
    return simulate_gst(algorithm, topology_spec, rate=rate, size_bytes=int(size_bytes), itemsize=itemsize,
                        routing=routing).gst_s
