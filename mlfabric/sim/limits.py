"""What a simulation will take, estimated from its arguments before anything is built.

``mlfabric simulate collective --topology fat-tree:k=2000`` used to die in a 15 GiB numpy
allocation (or be killed silently) while building a topology of 2 billion hosts. Before
building, the CLI now asks :func:`estimate_collective` (or :func:`estimate_ps`) for the
hosts, links, tasks, flows, events and memory of the run, from the topology spec, the
algorithm, the ranks and the size alone (arithmetic: microseconds), and
:func:`check_fits` refuses what will not fit in this machine's memory with
:class:`SimulationTooLarge` (the CLI exits with code 2), naming the estimate and the limit.

The memory model is measured, not derived: bytes per task of the task graph, the engine's
per-task state and the compiled loop's buffers (~400 B per task: a 1,024-rank ring's 4.2 M
tasks peaked at 1.73 GB), plus ~300 B per directed link and ~200 B per host for the
topology and its router, plus the interpreter (~150 MB). Flow counts per algorithm follow
the builders (``mlfabric.collectives``): ring ``2 (N-1) N c`` messages (``c`` pipelining
chunks per segment), halving-doubling ``2 log2(N) N``, binomial tree ``2 (N-1) c``,
BCube ``2 k (n-1) N / n``-ish per level. Where the estimate is rough (an ``edges:FILE``
topology, a collective kind not modelled) it says so and refuses nothing it cannot size.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim_scale.py -q -k limits
    mlfabric simulate collective --topology fat-tree:k=2000 --algorithm ring   # exit code 2
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mlfabric.topo.spec import TopologySpec

__all__ = ["SimEstimate", "SimulationTooLarge", "estimate_collective", "estimate_ps", "check_fits", "memory_limit_bytes",
           "topology_size"]

#: Measured: peak bytes per task of graph + engine (see the module docstring).
BYTES_PER_TASK = 400
BYTES_PER_LINK = 300
BYTES_PER_HOST = 200
BASE_BYTES = 150 * 2**20
#: Share of the memory available at the start that a run may plan to use.
MEMORY_FRACTION = 0.8


class SimulationTooLarge(ValueError):
    """The estimated run does not fit in this machine's memory (the CLI exits with code 2)."""

    def __init__(self, message: str, estimate: SimEstimate, limit_bytes: int) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.limit_bytes = limit_bytes


@dataclass(frozen=True, kw_only=True)
class SimEstimate:
    """What a run is expected to take (counts exact where the builders are, else rough)."""

    hosts: int
    links: int
    tasks: int
    flows: int
    #: At most one per flow (flows finishing together share one) plus timers.
    events: int
    memory_bytes: int
    #: False when a count is a guess (an edge-list topology, a kind not modelled).
    exact: bool = True

    def describe(self) -> str:
        return (f"{self.hosts:,} hosts, {self.links:,} links, {self.tasks:,} tasks, {self.flows:,} flows, "
                f"<= {self.events:,} events, ~{_gib(self.memory_bytes)} of memory"
                + ("" if self.exact else " (rough)"))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def topology_size(spec: TopologySpec | str) -> tuple[int, int, bool]:
    """(hosts, directed links, exact) of a topology spec, without building it."""
    parsed = spec if isinstance(spec, TopologySpec) else TopologySpec.parse(spec)
    if parsed.kind == "star":
        n = parsed.int_param("n")
        return n, 2 * n, True
    if parsed.kind == "fat-tree":
        k = parsed.int_param("k")
        # k^3/4 hosts; host-edge, edge-agg and agg-core layers of k^3/4 cables each, both ways.
        return k**3 // 4, 3 * k**3 // 2, True
    if parsed.kind == "racks":
        r, h = parsed.int_param("r"), parsed.int_param("h")
        return r * h, 2 * (r * h + r), True
    if parsed.kind == "bcube":
        n, k = parsed.int_param("n"), parsed.int_param("k")
        hosts = n**k
        return hosts, 2 * k * hosts, True
    return 0, 0, False  # edges:FILE: sized when read


def _log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def _collective_flows(kind: str, world: int, count: int, chunks: int | None, spec: TopologySpec) -> tuple[int, bool]:
    """Messages (flows) of one collective over ``world`` ranks, and whether the count is exact."""
    from mlfabric.collectives.partition import chunks_for
    from mlfabric.collectives.ring import MAX_CHUNKS, MIN_CHUNK_ELEMENTS

    if world <= 1:
        return 0, True
    algorithm = kind.split(":", 1)[1] if kind.startswith("allreduce:") else kind
    if algorithm == "ring":
        c = chunks or chunks_for(count // world, MIN_CHUNK_ELEMENTS, MAX_CHUNKS)
        return 2 * (world - 1) * world * c, True
    if algorithm == "halving_doubling":
        return 2 * _log2_ceil(world) * world, world & (world - 1) == 0
    if algorithm == "tree":
        c = chunks or chunks_for(count, MIN_CHUNK_ELEMENTS, MAX_CHUNKS)
        return 2 * (world - 1) * c, False
    if algorithm == "bcube" and spec.kind == "bcube":
        n, k = spec.int_param("n"), spec.int_param("k")
        return 2 * k * (n - 1) * world, False
    if algorithm in ("allgather", "reduce_scatter"):
        return (world - 1) * world, False
    # Other kinds (broadcast, reduce, hierarchical, ...): a log-depth guess.
    return 2 * _log2_ceil(world) * world, False


def _estimate(hosts: int, links: int, flows: int, exact: bool, *, timers: int = 0) -> SimEstimate:
    tasks = 2 * flows + timers
    memory = BASE_BYTES + BYTES_PER_TASK * tasks + BYTES_PER_LINK * links + BYTES_PER_HOST * hosts
    return SimEstimate(hosts=hosts, links=links, tasks=tasks, flows=flows, events=flows + timers, memory_bytes=memory,
                       exact=exact)


def estimate_collective(topology: TopologySpec | str, kind: str, *, ranks: int | None = None, size_bytes: float,
                        itemsize: int = 4, chunks: int | None = None) -> SimEstimate:
    """The estimate of ``mlfabric simulate collective`` with these arguments (``kind`` as
    :func:`~mlfabric.sim.collective_kind` returns it: ``allreduce:ring``, ``broadcast``...)."""
    spec = topology if isinstance(topology, TopologySpec) else TopologySpec.parse(topology)
    hosts, links, exact = topology_size(spec)
    world = ranks if ranks is not None else hosts
    flows, flows_exact = _collective_flows(kind, world, int(size_bytes) // max(itemsize, 1), chunks, spec)
    return _estimate(hosts, links, flows, exact and flows_exact, timers=world)


def estimate_ps(topology: TopologySpec | str, *, workers: int, servers: int, iterations: int = 1,
                jobs: int = 1) -> SimEstimate:
    """The estimate of ``mlfabric simulate ps``: a push and a pull per (worker, server, iteration)."""
    spec = topology if isinstance(topology, TopologySpec) else TopologySpec.parse(topology)
    hosts, links, exact = topology_size(spec)
    flows = 2 * workers * servers * iterations * jobs
    return _estimate(hosts, links, flows, exact, timers=(workers + servers) * iterations * jobs)


def memory_limit_bytes() -> int:
    """What a run may use: ``MEMORY_FRACTION`` of the memory available now (MemAvailable),
    or of the physical memory where /proc/meminfo is missing; ``MLFABRIC_SIM_MEMORY``
    (bytes) overrides it."""
    override = os.environ.get("MLFABRIC_SIM_MEMORY")
    if override:
        return int(float(override))
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * MEMORY_FRACTION)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_FRACTION)


def check_fits(estimate: SimEstimate, limit_bytes: int | None = None) -> SimEstimate:
    """Raise :class:`SimulationTooLarge` when the estimated memory exceeds the limit; returns the estimate."""
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    if estimate.memory_bytes > limit:
        raise SimulationTooLarge(
            f"this simulation would need {estimate.describe()}; the limit here is {_gib(limit)} "
            f"({MEMORY_FRACTION:.0%} of the memory available, MLFABRIC_SIM_MEMORY=<bytes> to change it). "
            "Use a smaller topology, fewer ranks (--ranks), or fewer chunks (--chunks).",
            estimate, limit)
    return estimate
