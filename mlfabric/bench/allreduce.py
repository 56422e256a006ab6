"""Allreduce benchmark: mlfabric's algorithms against gloo, side by side, on local ranks.

    mlfabric bench allreduce --world-size 4 --algorithms ring,halving_doubling,tree,gloo \\
        --sizes 4KB,1MB,64MB --iters 10 --warmup 2 --transport zmq --json out.json

Spawns ``world_size`` ranks (:mod:`mlfabric.bench.procs`); each joins a gloo process group
(the reference allreduce, and the barriers) and an mlfabric communicator. For every size,
each repetition runs every algorithm once, in the order given (rep 1: ring, hd, tree, gloo;
rep 2: ...), so drift on a shared machine hits all of them alike. Every call starts on all
ranks at one instant (``start="aligned"``: a margin after the last rank is ready; ranks on
one machine share its clock), as in the simulator where every rank starts at 0; each rank's
time counts from that instant and an iteration's time is the slowest rank's. (With
``start="barrier"`` each rank starts when it leaves a gloo barrier, whose exit reaches the
ranks up to ~30 ms apart on 2 cores, and that skew counts in the slowest rank's time.) The
first call of each algorithm is checked against gloo's result on the same input (integer
valued float32, so sums are exact in any order) and the benchmark fails on any mismatch.

Reported per size and algorithm: the median iteration time, algbw = bytes / time and
busbw = algbw * 2(N-1)/N (as nccl-tests defines them), and busbw relative to gloo's in the
same run. :func:`run_allreduce_bench` returns it all as :class:`AllreduceBenchResult`.

With ``emulate_topology`` (``--emulate --topology``, root) rank r runs on host r of an
emulated cluster (:func:`mlfabric.emu.launcher.emulated_launch`: shaped NICs, and
``MLFABRIC_TOPOLOGY`` so that ``bcube`` runs BML with level l on NIC l), and every mlfabric
algorithm's row carries the simulator's time for the same schedule on the same topology and
rate (:func:`simulated_allreduce_s`). :func:`run_bml_comparison` (``--compare-star``) then
runs ring and the P2P parameter server on a star of as many hosts and reports BML's speedup
over both (BML §4: GST(star) / GST(BML), 2x in theory on BCube(n,2)).

With ``ranks_per_host`` (``--ranks-per-host R``) every emulated host runs R ranks in its
namespace (``placement``: consecutive or interleaved ranks, :func:`mlfabric.emu.launcher.rank_hosts`);
ranks of one host talk through shared memory, others through the host's NIC.
:func:`run_hierarchy_comparison` (``--compare-flat``) then sets issue #27's check side by
side: the hierarchical allreduce on H hosts x R ranks, ring on the H hosts one rank each, and
a flat ring over the H x R ranks with every ring neighbour on another host.
"""

from __future__ import annotations

import contextlib

import dataclasses
import datetime as _dt
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from mlfabric.bench.procs import ALIGN_MARGIN_S, LaunchConfig, aligned_start, rank_env, report, run_ranks, sleep_until

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "AllreduceBenchConfig", "AllreduceBenchResult", "AllreduceMeasurement", "BenchmarkError",
    "BmlComparison", "GLOO", "HierarchyComparison", "STAR_ALGORITHMS", "bus_factor", "collect_metadata",
    "compare_star_config", "flat_comparison_configs", "render_hierarchy", "run_hierarchy_comparison",
    "format_bandwidth", "render_comparison", "render_table", "run_allreduce_bench", "run_bml_comparison",
    "simulated_allreduce_s",
]

GLOO = "gloo"
ELEMENT_BYTES = 4  # float32
#: The BML issue's check: emulated and simulated GST agree within 10%.
SIM_AGREEMENT = 0.10
#: What --compare-star runs on the star of the same hosts: BML §4's baselines.
STAR_ALGORITHMS = ("ring", "ps")
#: The simulator's rate of the host-internal (shared-memory) hop on emulated hosts with
#: several ranks: 4 GB/s, the 2-rank shared-memory ring's algbw at 64 MB on the 2-core VM
#: the figures come from (docs/results.md); the NICs dominate at emulated rates anyway.
HOST_INTERNAL_RATE_BPS = 32e9


class BenchmarkError(RuntimeError):
    """A benchmark produced a wrong result or could not run."""


@dataclass(frozen=True, kw_only=True)
class AllreduceBenchConfig:
    """What to measure. Sizes are in bytes (rounded down to whole float32 elements)."""

    world_size: int = 4
    algorithms: tuple[str, ...] = ("ring", "halving_doubling", "tree", GLOO)
    sizes: tuple[int, ...] = (4_000, 1_000_000, 64_000_000)
    iters: int = 10
    warmup: int = 2
    transport: str = "tcp"
    timeout_s: float = 600.0
    seed: int = 0
    # Run the ranks on an emulated cluster (root): a topology spec such as "star:n=8" and the
    # per-NIC rate in bit/s. None: local processes on loopback.
    emulate_topology: str | None = None
    emulate_rate_bps: float | None = None
    # Emulated runs: first measure one TCP flow's goodput between hosts 0 and 1 of the same
    # cluster (the emulator issue's reference: busbw is compared with it in the same run).
    measure_goodput: bool = True
    # When a timed call starts: "aligned" (default): on every rank at one instant,
    # align_margin_s after the last rank got there (ranks share the machine's clock), and
    # each rank's time counts from that instant, as in the simulator, where all ranks start
    # at 0; "barrier": when the rank leaves a gloo barrier, whose exit reaches the ranks up to
    # ~30 ms apart on 2 cores (that skew then counts in the slowest rank's time).
    start: str = "aligned"
    align_margin_s: float = ALIGN_MARGIN_S
    # Emulated runs: ranks per host (world_size = hosts x ranks_per_host) and their placement
    # (mlfabric.emu.launcher.RANK_PLACEMENTS).
    ranks_per_host: int = 1
    placement: str = "consecutive"

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.collectives import ALLREDUCE_ALGORITHMS
        from mlfabric.topo.spec import TopologySpec

        if self.world_size < 2:
            raise ValueError(f"the allreduce benchmark needs world_size >= 2, got {self.world_size}")
        if not self.algorithms:
            raise ValueError("no algorithms to benchmark")
        known = (*ALLREDUCE_ALGORITHMS, "auto", GLOO)
        for name in self.algorithms:
            if name not in known:
                raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(known)}")
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError(f"algorithms repeat: {', '.join(self.algorithms)}")
        spec = None if self.emulate_topology is None else TopologySpec.parse(self.emulate_topology)
        if "bcube" in self.algorithms and (spec is None or spec.kind != "bcube"):
            raise ValueError("algorithm bcube (BML) runs on a BCube: use --emulate --topology bcube:n=3,k=2 "
                             f"(the topology here is {spec})")
        if "hierarchical" in self.algorithms and spec is None:
            raise ValueError("algorithm hierarchical needs the cluster's switch hierarchy: use --emulate --topology ...")
        if not self.sizes:
            raise ValueError("no sizes to benchmark")
        for size in self.sizes:
            if size < ELEMENT_BYTES:
                raise ValueError(f"size {size} B is smaller than one float32 element ({ELEMENT_BYTES} B)")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={self.iters}, warmup={self.warmup}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.start not in ("aligned", "barrier") or not self.align_margin_s >= 0:
            raise ValueError(f"start must be aligned or barrier and align_margin_s >= 0, got {self.start!r}, "
                             f"{self.align_margin_s}")
        from mlfabric.emu.launcher import rank_hosts

        rank_hosts(1, self.ranks_per_host, self.placement)  # raises on a bad count or placement
        if self.ranks_per_host > 1:
            if spec is None:
                raise ValueError("--ranks-per-host runs several ranks on each emulated host: add --emulate")
            shaped = {"bcube", "hierarchical"} & set(self.algorithms)
            if shaped:
                raise ValueError(f"{', '.join(sorted(shaped))} run one rank per host; drop them or --ranks-per-host")

    @property
    def hosts(self) -> tuple[int, ...] | None:
        """The host of every rank on an emulated cluster (None on loopback)."""
        if self.emulate_topology is None:
            return None
        from mlfabric.emu.launcher import rank_hosts

        return tuple(rank_hosts(self.world_size // self.ranks_per_host, self.ranks_per_host, self.placement))


@dataclass(frozen=True, kw_only=True)
class AllreduceMeasurement:
    """One (size, algorithm) cell. Times in seconds, bandwidths in bytes per second."""

    algorithm: str
    size_bytes: int            # as requested
    nbytes: int                # as reduced: whole float32 elements
    count: int                 # float32 elements
    times_s: tuple[float, ...]  # per timed iteration, slowest rank
    median_s: float
    min_s: float
    max_s: float
    algbw: float               # nbytes / median_s
    busbw: float               # algbw * 2(N-1)/N
    busbw_vs_gloo: float | None  # busbw / gloo's busbw at this size (None without gloo)
    correct: bool
    # Emulated runs: the simulator's time for the same schedule on the same topology and NIC
    # rate (mlfabric.sim), and median_s / simulated_s. None for gloo (no schedule) and for
    # runs on loopback.
    simulated_s: float | None = None
    emulated_vs_simulated: float | None = None
    # Emulated runs: busbw (in bit/s) / the two-host TCP goodput measured in the same run.
    busbw_vs_goodput: float | None = None


@dataclass(frozen=True, kw_only=True)
class AllreduceBenchResult:
    config: AllreduceBenchConfig
    measurements: tuple[AllreduceMeasurement, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Emulated runs: one TCP flow's goodput (bit/s) from host 0 to host 1, measured on the
    #: cluster just before the ranks started (None: not measured).
    two_host_goodput_bps: float | None = None

    def get(self, size_bytes: int, algorithm: str) -> AllreduceMeasurement:
        for m in self.measurements:
            if m.size_bytes == size_bytes and m.algorithm == algorithm:
                return m
        raise KeyError(f"no measurement for {algorithm} at {size_bytes} B")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: metadata, config and every measurement (raw per-iteration times too)."""
        return {
            "benchmark": "allreduce",
            "metadata": self.metadata,
            "config": {**asdict(self.config), "algorithms": list(self.config.algorithms),
                       "sizes": list(self.config.sizes)},
            "units": {"time": "s", "size": "bytes", "algbw": "bytes/s", "busbw": "bytes/s",
                      "busbw_factor": "2(N-1)/N"},
            "two_host_goodput_bps": self.two_host_goodput_bps,
            "results": [{**asdict(m), "times_s": list(m.times_s)} for m in self.measurements],
        }


def bus_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus bandwidth factor 2(N-1)/N."""
    return 2.0 * (world_size - 1) / world_size


def collect_metadata(config: AllreduceBenchConfig, argv: Sequence[str] | None = None) -> dict[str, Any]:
    import torch

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": shlex.join(argv if argv is not None else sys.argv),
        "world_size": config.world_size,
        "transport": config.transport,
        "dtype": "float32",
        "start": config.start,
    }


@contextlib.contextmanager
def _launch_config(config: AllreduceBenchConfig, capture_output: bool,
                   goodput: dict[str, float] | None = None) -> Iterator[LaunchConfig]:
    """Local ranks on loopback, or one rank per host of an emulated cluster (torn down after).
    With ``goodput`` (a dict), an emulated cluster first measures its two-host TCP goodput
    into ``goodput["bps"]``."""
    if config.emulate_topology is None:
        yield LaunchConfig(world_size=config.world_size, timeout_s=config.timeout_s,
                           capture_output=capture_output)
        return
    from mlfabric.emu.launcher import emulated_launch

    if config.emulate_rate_bps is None:
        raise ValueError("an emulated benchmark needs a NIC rate")
    def measure(plan: Any) -> None:
        from mlfabric.emu.goodput import two_host_goodput_bps

        if goodput is not None and plan.n_hosts >= 2:
            goodput["bps"] = two_host_goodput_bps(plan)

    with emulated_launch(config.emulate_topology, config.emulate_rate_bps, on_built=measure,
                         timeout_s=config.timeout_s, capture_output=capture_output,
                         ranks_per_host=config.ranks_per_host, placement=config.placement) as launch:
        if launch.world_size != config.world_size:
            raise ValueError(f"topology {config.emulate_topology} with {config.ranks_per_host} rank(s) per host "
                             f"has {launch.world_size} ranks but the benchmark asks for {config.world_size}")
        yield launch


def simulated_allreduce_s(algorithm: str, topology: str, rate_bps: float, nbytes: int,
                          hosts: Sequence[int] | None = None) -> float | None:
    """The simulator's time (s) for mlfabric's ``algorithm`` on ``nbytes`` of float32 on
    ``topology`` (rank r on host r, or on ``hosts[r]``: then hosts also have their internal
    link at :data:`HOST_INTERNAL_RATE_BPS`) with every NIC at ``rate_bps``: the same schedule,
    with the same options, as the communicator runs there (BML's and the PS's parts from the
    emulator's pipelining chunk). None for gloo, which has no schedule."""
    if algorithm == GLOO:
        return None
    from mlfabric.collectives import choose_allreduce, pipeline_parts
    from mlfabric.collectives.bcube import hierarchy_of, shape_options
    from mlfabric.emu.cluster import pipeline_chunk_bytes
    from mlfabric.sim.workloads import simulate_collective
    from mlfabric.topo.spec import TopologySpec

    spec = TopologySpec.parse(topology)
    chunk = pipeline_chunk_bytes(rate_bps) // ELEMENT_BYTES
    if hosts is not None and len(hosts) != math.prod(hierarchy_of(spec)):
        from mlfabric.collectives.hierarchical import allreduce_options
        from mlfabric.topo import parse_topology

        name = choose_allreduce(algorithm, nbytes, len(hosts), None, tuple(hosts))
        options: dict[str, Any] = allreduce_options(nbytes, hosts, chunk) if name == "host_hierarchical" else {}
        topo = parse_topology(str(spec), rate_bps).with_host_links(HOST_INTERNAL_RATE_BPS)
        return simulate_collective(name, topo, size_bytes=nbytes, itemsize=ELEMENT_BYTES, ranks=len(hosts),
                                   placement=list(hosts), **options).time_s
    world_size = math.prod(hierarchy_of(spec))
    name = choose_allreduce(algorithm, nbytes, world_size, str(spec))
    options = shape_options(name, spec)
    options.update(pipeline_parts(name, nbytes // ELEMENT_BYTES, world_size, chunk, **options))
    return simulate_collective(name, str(spec), rate_bps, size_bytes=nbytes, itemsize=ELEMENT_BYTES,
                               **options).time_s


def run_allreduce_bench(config: AllreduceBenchConfig, *, argv: Sequence[str] | None = None,
                        on_progress: Callable[[int, int], None] | None = None,
                        capture_output: bool = False) -> AllreduceBenchResult:
    """Run the benchmark on ``config.world_size`` local ranks and summarize it.

    ``on_progress(done, total)`` is called as rank 0 finishes each (size, repetition).
    """
    total = len(config.sizes) * (config.warmup + config.iters)

    def on_report(rank: int, payload: Any) -> None:
        if on_progress is not None and rank == 0:
            on_progress(int(payload), total)

    goodput: dict[str, float] = {}
    with _launch_config(config, capture_output, goodput if config.measure_goodput else None) as launch:
        per_rank: list[_RankTimes] = run_ranks(_rank_main, config=launch, args=(config,),
                                               on_report=on_report)
    reference_bps = goodput.get("bps")
    factor = bus_factor(config.world_size)
    measurements: list[AllreduceMeasurement] = []
    for size in config.sizes:
        count = size // ELEMENT_BYTES
        nbytes = count * ELEMENT_BYTES
        medians: dict[str, float] = {}
        cells = []
        for algorithm in config.algorithms:
            series = [per_rank[r].times[(size, algorithm)] for r in range(config.world_size)]
            times = tuple(max(ts) for ts in zip(*series))
            medians[algorithm] = statistics.median(times)
            cells.append((algorithm, times))
        for algorithm, times in cells:
            median = medians[algorithm]
            correct = all((size, algorithm) in r.verified for r in per_rank)
            algbw = nbytes / median
            ratio = medians[GLOO] / median if GLOO in medians else None  # busbw ratio = inverse time ratio
            simulated = None
            if config.emulate_topology is not None and config.emulate_rate_bps is not None:
                simulated = simulated_allreduce_s(algorithm, config.emulate_topology, config.emulate_rate_bps,
                                                  nbytes, config.hosts if config.ranks_per_host > 1 else None)
            measurements.append(AllreduceMeasurement(
                algorithm=algorithm, size_bytes=size, nbytes=nbytes, count=count, times_s=times,
                median_s=median, min_s=min(times), max_s=max(times), algbw=algbw,
                busbw=algbw * factor, busbw_vs_gloo=ratio, correct=correct, simulated_s=simulated,
                emulated_vs_simulated=None if not simulated else median / simulated,
                busbw_vs_goodput=None if reference_bps is None else algbw * factor * 8 / reference_bps))
    metadata = collect_metadata(config, argv)
    if config.start == "aligned":
        metadata["late_starts"] = sum(r.late for r in per_rank)
    return AllreduceBenchResult(config=config, measurements=tuple(measurements),
                                metadata=metadata, two_host_goodput_bps=reference_bps)


# --------------------------------------------------------------------------- BML vs star


#: BML §4.3 / the BML issue: BML's GST at least this many times faster than ring and PS on the
#: star (theory: k = 2).
BML_SPEEDUP_BAR = 1.7


@dataclass(frozen=True, kw_only=True)
class BmlComparison:
    """``--compare-star``: the algorithms on the emulated BCube, then ring and the P2P
    parameter server on a star of the same hosts with the same per-NIC rate (BML §4.2's
    Fat-Tree: one non-blocking switch, one NIC per host)."""

    bcube: AllreduceBenchResult
    star: AllreduceBenchResult
    metadata: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """Every (cluster, size, algorithm): GST (median), simulated GST and their ratio."""
        rows = []
        for result in (self.bcube, self.star):
            for m in result.measurements:
                rows.append({"cluster": result.config.emulate_topology, "algorithm": m.algorithm,
                             "size_bytes": m.size_bytes, "nbytes": m.nbytes, "gst_s": m.median_s,
                             "min_s": m.min_s, "max_s": m.max_s, "simulated_s": m.simulated_s,
                             "emulated_vs_simulated": m.emulated_vs_simulated, "busbw": m.busbw,
                             "correct": m.correct})
        return rows

    def speedups(self) -> list[dict[str, Any]]:
        """Per size: BML on the BCube vs ring and vs PS on the star, measured and simulated."""
        out = []
        for size in self.bcube.config.sizes:
            bml = self.bcube.get(size, "bcube")
            ring, ps = self.star.get(size, "ring"), self.star.get(size, "ps")
            entry: dict[str, Any] = {
                "size_bytes": size, "bml_s": bml.median_s, "ring_star_s": ring.median_s, "ps_star_s": ps.median_s,
                "bml_vs_ring_star": ring.median_s / bml.median_s, "bml_vs_ps_star": ps.median_s / bml.median_s,
                "simulated_bml_vs_ring_star": None, "simulated_bml_vs_ps_star": None}
            if bml.simulated_s and ring.simulated_s and ps.simulated_s:
                entry["simulated_bml_vs_ring_star"] = ring.simulated_s / bml.simulated_s
                entry["simulated_bml_vs_ps_star"] = ps.simulated_s / bml.simulated_s
            out.append(entry)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "allreduce-bml-vs-star",
            "metadata": self.metadata,
            "units": {"time": "s", "size": "bytes", "busbw": "bytes/s", "speedup": "star GST / BML GST"},
            "bars": {"bml_speedup_min": BML_SPEEDUP_BAR, "emulated_vs_simulated_within": SIM_AGREEMENT},
            "rows": self.rows(),
            "speedups": self.speedups(),
            "runs": {"bcube": self.bcube.to_dict(), "star": self.star.to_dict()},
        }


def compare_star_config(config: AllreduceBenchConfig) -> AllreduceBenchConfig:
    """The star run of ``--compare-star`` for a BCube ``config`` (ValueError if it is none)."""
    from mlfabric.topo.spec import TopologySpec

    if config.emulate_topology is None or TopologySpec.parse(config.emulate_topology).kind != "bcube":
        raise ValueError("--compare-star compares BML on an emulated BCube with a star: use --emulate "
                         f"--topology bcube:n=3,k=2 (got {config.emulate_topology})")
    if "bcube" not in config.algorithms:
        raise ValueError("--compare-star compares BML with the star: include bcube in --algorithms")
    return dataclasses.replace(config, algorithms=STAR_ALGORITHMS,
                               emulate_topology=f"star:n={config.world_size}")


def run_bml_comparison(config: AllreduceBenchConfig, *, argv: Sequence[str] | None = None,
                       on_progress: Callable[[int, int], None] | None = None,
                       capture_output: bool = False) -> BmlComparison:
    """``config`` on its emulated BCube, then :func:`compare_star_config` on a star (one
    cluster after the other, each torn down after its run)."""
    star_config = compare_star_config(config)
    per_run = len(config.sizes) * (config.warmup + config.iters)

    def progress(offset: int) -> Callable[[int, int], None] | None:
        if on_progress is None:
            return None
        return lambda done, total: on_progress(offset + done, 2 * per_run)

    bcube = run_allreduce_bench(config, argv=argv, on_progress=progress(0), capture_output=capture_output)
    star = run_allreduce_bench(star_config, argv=argv, on_progress=progress(per_run), capture_output=capture_output)
    return BmlComparison(bcube=bcube, star=star, metadata=collect_metadata(config, argv))


# --------------------------------------------------------------------------- hierarchical vs flat

#: Issue #27's bars: the hierarchical allreduce within 10% of ring on the hosts alone (the
#: network carries only the inter-host part), and at least 1.5x faster than a flat ring over
#: all ranks with neighbours on other hosts.
HIERARCHY_WITHIN = 0.10
FLAT_SPEEDUP_BAR = 1.5


@dataclass(frozen=True, kw_only=True)
class HierarchyComparison:
    """``--compare-flat``: ``hierarchical`` (the configured run: H hosts x R ranks,
    consecutive), ``hosts`` (ring on the H hosts, one rank each) and ``flat`` (ring over the
    H x R ranks, interleaved: every ring neighbour on another host), one cluster after the
    other at the same NIC rate."""

    hierarchical: AllreduceBenchResult
    hosts: AllreduceBenchResult
    flat: AllreduceBenchResult
    metadata: dict[str, Any] = field(default_factory=dict)

    def speedups(self) -> list[dict[str, Any]]:
        out = []
        for size in self.hierarchical.config.sizes:
            hier = self.hierarchical.get(size, "host_hierarchical")
            ring_hosts, flat = self.hosts.get(size, "ring"), self.flat.get(size, "ring")
            out.append({"size_bytes": size, "hierarchical_s": hier.median_s, "ring_hosts_s": ring_hosts.median_s,
                        "flat_ring_s": flat.median_s, "hierarchical_vs_ring_hosts": hier.median_s / ring_hosts.median_s,
                        "flat_vs_hierarchical": flat.median_s / hier.median_s,
                        "simulated_hierarchical_s": hier.simulated_s, "simulated_ring_hosts_s": ring_hosts.simulated_s,
                        "simulated_flat_ring_s": flat.simulated_s})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "allreduce-hierarchical-vs-flat",
            "metadata": self.metadata,
            "units": {"time": "s", "size": "bytes"},
            "bars": {"hierarchical_vs_ring_hosts_max": 1 + HIERARCHY_WITHIN, "flat_vs_hierarchical_min": FLAT_SPEEDUP_BAR},
            "speedups": self.speedups(),
            "runs": {"hierarchical": self.hierarchical.to_dict(), "hosts": self.hosts.to_dict(),
                     "flat": self.flat.to_dict()},
        }


def flat_comparison_configs(config: AllreduceBenchConfig) -> tuple[AllreduceBenchConfig, AllreduceBenchConfig]:
    """The ``hosts`` and ``flat`` runs of ``--compare-flat`` for ``config`` (ValueError if it
    does not run host_hierarchical on several ranks per emulated host)."""
    if config.emulate_topology is None or config.ranks_per_host < 2 or "host_hierarchical" not in config.algorithms:
        raise ValueError("--compare-flat compares host_hierarchical on several ranks per emulated host with rings: "
                         "use --emulate --topology star:n=4 --ranks-per-host 2 --algorithms host_hierarchical,...")
    hosts = dataclasses.replace(config, algorithms=("ring",), ranks_per_host=1, placement="consecutive",
                                world_size=config.world_size // config.ranks_per_host)
    flat = dataclasses.replace(config, algorithms=("ring",), placement="interleaved")
    return hosts, flat


def run_hierarchy_comparison(config: AllreduceBenchConfig, *, argv: Sequence[str] | None = None,
                             on_progress: Callable[[int, int], None] | None = None,
                             capture_output: bool = False) -> HierarchyComparison:
    """``config``, then the two rings of :func:`flat_comparison_configs`, each on a fresh cluster."""
    runs = (config, *flat_comparison_configs(config))
    per_run = len(config.sizes) * (config.warmup + config.iters)
    results = []
    for index, run in enumerate(runs):
        progress = None if on_progress is None else (
            lambda done, total, offset=index * per_run: on_progress(offset + done, len(runs) * per_run))
        results.append(run_allreduce_bench(run, argv=argv, on_progress=progress, capture_output=capture_output))
    return HierarchyComparison(hierarchical=results[0], hosts=results[1], flat=results[2],
                               metadata=collect_metadata(config, argv))


def render_hierarchy(comparison: HierarchyComparison) -> Table:
    """One row per size: the three times and the two ratios against issue #27's bars."""
    from rich import box
    from rich.table import Table

    from mlfabric.units import format_size

    config = comparison.hierarchical.config
    hosts = config.world_size // config.ranks_per_host
    table = Table(title=f"allreduce on emulated {config.emulate_topology} x {config.ranks_per_host} ranks at "
                        f"{(config.emulate_rate_bps or 0) / 1e6:g} Mbit/s, {config.transport}, median of {config.iters}; "
                        f"bars: hier/ring({hosts} hosts) <= {1 + HIERARCHY_WITHIN:g}, flat/hier >= {FLAT_SPEEDUP_BAR:g}",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("size", "hier ms", f"ring {hosts} hosts ms", f"flat ring {config.world_size} ms",
                 "hier / ring hosts", "flat / hier", "sim: hier, ring hosts, flat ms"):
        table.add_column(name, justify="right", no_wrap=True)
    for entry in comparison.speedups():
        near = entry["hierarchical_vs_ring_hosts"] <= 1 + HIERARCHY_WITHIN
        fast = entry["flat_vs_hierarchical"] >= FLAT_SPEEDUP_BAR
        simulated = [entry[k] for k in ("simulated_hierarchical_s", "simulated_ring_hosts_s", "simulated_flat_ring_s")]
        table.add_row(format_size(entry["size_bytes"]), f"{entry['hierarchical_s'] * 1e3:.1f}",
                      f"{entry['ring_hosts_s'] * 1e3:.1f}", f"{entry['flat_ring_s'] * 1e3:.1f}",
                      f"[{'green' if near else 'red'}]{entry['hierarchical_vs_ring_hosts']:.3f}[/]",
                      f"[{'green' if fast else 'red'}]{entry['flat_vs_hierarchical']:.2f}x[/]",
                      ", ".join("" if s is None else f"{s * 1e3:.1f}" for s in simulated))
    return table


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _RankTimes:
    times: dict[tuple[int, str], list[float]]  # (size, algorithm) -> this rank's timed iterations
    verified: frozenset[tuple[int, str]]       # cells whose result matched gloo's on every rank
    late: int = 0                              # aligned starts reached after the instant


def _rank_main(config: AllreduceBenchConfig) -> _RankTimes:
    """One rank: per (size, algorithm), its own time of every timed iteration."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mlfabric

    env = rank_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
    # On an emulated cluster the topology is in MLFABRIC_TOPOLOGY too; passing it says which
    # cluster this benchmark was configured for (BML's digits and channels come from it).
    comm = mlfabric.init(transport=config.transport, timeout=min(config.timeout_s, 300.0),
                         topology=config.emulate_topology if config.ranks_per_host == 1 else None)
    times: dict[tuple[int, str], list[float]] = {}
    verified: set[tuple[int, str]] = set()
    done = 0
    late = 0  # aligned starts this rank reached only after the instant (its time counts from it)
    try:
        for size in config.sizes:
            count = size // ELEMENT_BYTES
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + env.rank * 7919 + size)
            # Integer-valued float32: sums are exact whatever the order of additions.
            source = torch.randint(-1000, 1000, (count,), generator=gen).to(torch.float32)
            reference = source.clone()
            dist.all_reduce(reference)
            work = torch.empty_like(source)
            for algorithm in config.algorithms:
                times[(size, algorithm)] = []
            for rep in range(config.warmup + config.iters):
                for algorithm in config.algorithms:
                    work.copy_(source)
                    if config.start == "aligned":
                        start = aligned_start(_latest_over_ranks, config.align_margin_s)
                        late += not sleep_until(start)
                    else:
                        dist.barrier()
                        start = time.monotonic()
                    if algorithm == GLOO:
                        dist.all_reduce(work)
                    else:
                        comm.allreduce(work, algorithm=algorithm)
                    elapsed = time.monotonic() - start
                    if rep >= config.warmup:
                        times[(size, algorithm)].append(elapsed)
                    if rep == 0:
                        _verify(work, reference, algorithm, size, env.rank)
                        verified.add((size, algorithm))
                done += 1
                if env.rank == 0:
                    report(done)
            del source, reference, work
    finally:
        comm.close()
        dist.destroy_process_group()
    return _RankTimes(times=times, verified=frozenset(verified), late=late)


def _latest_over_ranks(t: float) -> float:
    """The largest ``t`` over the ranks (gloo allreduce, float64: monotonic seconds)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


def _verify(result: Any, reference: Any, algorithm: str, size: int, rank: int) -> None:
    """Compare with gloo's result; every rank learns every rank's verdict and, on any
    mismatch, all raise the same error naming the wrong ranks."""
    import torch
    import torch.distributed as dist

    problem = None
    if not torch.equal(result, reference):
        diff = (result - reference).abs()
        first = int(torch.nonzero(diff)[0].item())
        problem = (f"rank {rank}: {int(torch.count_nonzero(diff).item())} of {result.numel()} elements "
                   f"differ (first at index {first}: got {result[first].item()}, gloo "
                   f"{reference[first].item()}; max abs diff {diff.max().item()})")
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    problems = [p for p in verdicts if p is not None]
    if problems:
        raise BenchmarkError(f"allreduce {algorithm} of {size} B differs from gloo's result on the same "
                             f"input; the algorithm is wrong. " + "; ".join(problems))


# --------------------------------------------------------------------------- presentation


def render_table(result: AllreduceBenchResult) -> Table:
    """A rich table: one row per (size, algorithm); busbw relative to gloo in the same run."""
    from rich import box
    from rich.table import Table

    from mlfabric.units import format_size

    config = result.config
    where = "" if config.emulate_topology is None else (
        f" on emulated {config.emulate_topology} at {(config.emulate_rate_bps or 0) / 1e6:g} Mbit/s per NIC")
    if result.two_host_goodput_bps is not None:
        where += f" (two-host TCP goodput {result.two_host_goodput_bps / 1e6:.1f} Mbit/s)"
    table = Table(title=f"allreduce: {config.world_size} ranks{where}, {config.transport} transport, float32, "
                        f"median of {config.iters}", title_justify="left", box=box.SIMPLE_HEAD)
    simulated = any(m.simulated_s is not None for m in result.measurements)
    columns = [("size", "right"), ("algorithm", "left"), ("time ms", "right")]
    if simulated:
        columns += [("sim ms", "right"), ("emu/sim", "right")]
    columns += [("algbw", "right"), ("busbw", "right"), ("vs gloo", "right")]
    if result.two_host_goodput_bps is not None:
        columns.append(("vs goodput", "right"))
    columns.append(("ok", "center"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    last_size = None
    for m in result.measurements:
        if last_size is not None and m.size_bytes != last_size:
            table.add_section()
        ratio = "" if m.busbw_vs_gloo is None else f"{m.busbw_vs_gloo:.2f}x"
        if m.busbw_vs_gloo is not None and m.algorithm != GLOO:
            ratio = f"[{'green' if m.busbw_vs_gloo >= 1.0 else 'red'}]{ratio}[/]"
        cells = [format_size(m.size_bytes) if m.size_bytes != last_size else "", m.algorithm,
                 f"{m.median_s * 1e3:.3f}"]
        if simulated:
            cells += _simulated_cells(m)
        cells += [format_bandwidth(m.algbw), format_bandwidth(m.busbw), ratio]
        if result.two_host_goodput_bps is not None:
            cells.append("" if m.busbw_vs_goodput is None else f"{m.busbw_vs_goodput:.3f}")
        cells.append("yes" if m.correct else "[red]NO[/]")
        table.add_row(*cells)
        last_size = m.size_bytes
    return table


def _simulated_cells(m: AllreduceMeasurement) -> list[str]:
    if m.simulated_s is None or m.emulated_vs_simulated is None:
        return ["", ""]
    ratio = m.emulated_vs_simulated
    colour = "green" if abs(ratio - 1.0) <= SIM_AGREEMENT else "red"
    return [f"{m.simulated_s * 1e3:.3f}", f"[{colour}]{ratio:.3f}[/]"]


def render_comparison(comparison: BmlComparison) -> list[Table]:
    """Two rich tables: every (cluster, algorithm) row, then BML's speedups over the star."""
    from rich import box
    from rich.table import Table

    from mlfabric.topo.spec import TopologySpec
    from mlfabric.units import format_size

    config = comparison.bcube.config
    rate = (config.emulate_rate_bps or 0) / 1e6
    rows = Table(title=f"allreduce GST: emulated {config.emulate_topology} vs star:n={config.world_size}, "
                       f"{rate:g} Mbit/s per NIC, {config.transport} transport, median of {config.iters}",
                 title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("cluster", "left"), ("size", "right"), ("algorithm", "left"), ("GST ms", "right"),
                          ("sim ms", "right"), ("emu/sim", "right"), ("ok", "center")):
        rows.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for index, result in enumerate((comparison.bcube, comparison.star)):
        if index:
            rows.add_section()
        for m in result.measurements:
            rows.add_row(str(result.config.emulate_topology), format_size(m.size_bytes), m.algorithm,
                         f"{m.median_s * 1e3:.1f}", *_simulated_cells(m), "yes" if m.correct else "[red]NO[/]")
    levels = TopologySpec.parse(str(config.emulate_topology)).int_param("k")
    speed = Table(title=f"BML (bcube on {config.emulate_topology}) vs the star: GST(star) / GST(BML); "
                        f"theory {levels}x (k), bar {BML_SPEEDUP_BAR:g}x", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("size", "BML ms", "ring@star", "PS@star", "vs ring", "vs PS", "sim: vs ring, PS"):
        speed.add_column(name, justify="right", no_wrap=True)
    for entry in comparison.speedups():
        def cell(value: float) -> str:
            return f"[{'green' if value >= BML_SPEEDUP_BAR else 'red'}]{value:.2f}x[/]"

        simulated = ""
        if entry["simulated_bml_vs_ring_star"] is not None:
            simulated = f"{entry['simulated_bml_vs_ring_star']:.2f}x, {entry['simulated_bml_vs_ps_star']:.2f}x"
        speed.add_row(format_size(entry["size_bytes"]), f"{entry['bml_s'] * 1e3:.1f}",
                      f"{entry['ring_star_s'] * 1e3:.1f}", f"{entry['ps_star_s'] * 1e3:.1f}",
                      cell(entry["bml_vs_ring_star"]), cell(entry["bml_vs_ps_star"]), simulated)
    return [rows, speed]


def format_bandwidth(bytes_per_s: float) -> str:
    """Three significant digits in B/s, KB/s, MB/s or GB/s (powers of 1000)."""
    for factor, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if bytes_per_s >= factor:
            return f"{bytes_per_s / factor:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"
