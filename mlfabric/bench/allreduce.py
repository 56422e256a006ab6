"""Allreduce benchmark: mlfabric's algorithms against gloo, side by side, on local ranks.

    mlfabric bench allreduce --world-size 4 --algorithms ring,halving_doubling,tree,gloo \\
        --sizes 4KB,1MB,64MB --iters 10 --warmup 2 --transport zmq --json out.json

Spawns ``world_size`` ranks (:mod:`mlfabric.bench.procs`); each joins a gloo process group
(the reference allreduce, and the barriers) and an mlfabric communicator. For every size,
each repetition runs every algorithm once, in the order given (rep 1: ring, hd, tree, gloo;
rep 2: ...), so drift on a shared machine hits all of them alike. Every call is preceded by
a gloo barrier and timed on every rank; an iteration's time is the slowest rank's. The
first call of each algorithm is checked against gloo's result on the same input (integer
valued float32, so sums are exact in any order) and the benchmark fails on any mismatch.

Reported per size and algorithm: the median iteration time, algbw = bytes / time and
busbw = algbw * 2(N-1)/N (as nccl-tests defines them), and busbw relative to gloo's in the
same run. :func:`run_allreduce_bench` returns it all as :class:`AllreduceBenchResult`.
"""

from __future__ import annotations

import contextlib

import datetime as _dt
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from mlfabric.bench.procs import LaunchConfig, rank_env, report, run_ranks

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "AllreduceBenchConfig", "AllreduceBenchResult", "AllreduceMeasurement", "BenchmarkError",
    "GLOO", "bus_factor", "collect_metadata", "format_bandwidth", "render_table", "run_allreduce_bench",
]

GLOO = "gloo"
ELEMENT_BYTES = 4  # float32


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
    transport: str = "zmq"
    timeout_s: float = 600.0
    seed: int = 0
    # Run the ranks on an emulated cluster (root): a topology spec such as "star:n=8" and the
    # per-NIC rate in bit/s. None: local processes on loopback.
    emulate_topology: str | None = None
    emulate_rate_bps: float | None = None

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.collectives import ALLREDUCE_ALGORITHMS

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


@dataclass(frozen=True, kw_only=True)
class AllreduceBenchResult:
    config: AllreduceBenchConfig
    measurements: tuple[AllreduceMeasurement, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

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
    }


@contextlib.contextmanager
def _launch_config(config: AllreduceBenchConfig, capture_output: bool) -> Iterator[LaunchConfig]:
    """Local ranks on loopback, or one rank per host of an emulated cluster (torn down after)."""
    if config.emulate_topology is None:
        yield LaunchConfig(world_size=config.world_size, timeout_s=config.timeout_s,
                           capture_output=capture_output)
        return
    from mlfabric.emu.cluster import Cluster, new_prefix, plan_cluster
    from mlfabric.emu.cmd import ns_exec_prefix
    from mlfabric.topo.spec import TopologySpec

    if config.emulate_rate_bps is None:
        raise ValueError("an emulated benchmark needs a NIC rate")
    plan = plan_cluster(TopologySpec.parse(config.emulate_topology), config.emulate_rate_bps,
                        prefix=new_prefix())
    if plan.n_hosts != config.world_size:
        raise ValueError(f"topology {config.emulate_topology} has {plan.n_hosts} hosts but the "
                         f"benchmark asks for {config.world_size} ranks")
    with Cluster.create(plan):
        yield LaunchConfig(
            world_size=config.world_size, timeout_s=config.timeout_s, capture_output=capture_output,
            # Host 0's namespace is brand new, so any port is free there (and free_port() could
            # not probe it from this namespace).
            master_addr=plan.master_addr, master_port=29500,
            command_prefix=[ns_exec_prefix(h.netns) for h in plan.hosts],
            # gloo picks its interface from the hostname, which a namespace cannot resolve.
            rank_env=[{"MLFABRIC_CHANNEL_ADDRS": h.channel_addrs(),
                       "GLOO_SOCKET_IFNAME": h.nics[0].host_dev} for h in plan.hosts])


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

    with _launch_config(config, capture_output) as launch:
        per_rank: list[_RankTimes] = run_ranks(_rank_main, config=launch, args=(config,),
                                               on_report=on_report)
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
            measurements.append(AllreduceMeasurement(
                algorithm=algorithm, size_bytes=size, nbytes=nbytes, count=count, times_s=times,
                median_s=median, min_s=min(times), max_s=max(times), algbw=algbw,
                busbw=algbw * factor, busbw_vs_gloo=ratio, correct=correct))
    return AllreduceBenchResult(config=config, measurements=tuple(measurements),
                                metadata=collect_metadata(config, argv))


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _RankTimes:
    times: dict[tuple[int, str], list[float]]  # (size, algorithm) -> this rank's timed iterations
    verified: frozenset[tuple[int, str]]       # cells whose result matched gloo's on every rank


def _rank_main(config: AllreduceBenchConfig) -> _RankTimes:
    """One rank: per (size, algorithm), its own time of every timed iteration."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mlfabric

    env = rank_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
    comm = mlfabric.init(transport=config.transport, timeout=min(config.timeout_s, 300.0))
    times: dict[tuple[int, str], list[float]] = {}
    verified: set[tuple[int, str]] = set()
    done = 0
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
                    dist.barrier()
                    start = time.perf_counter()
                    if algorithm == GLOO:
                        dist.all_reduce(work)
                    else:
                        comm.allreduce(work, algorithm=algorithm)
                    elapsed = time.perf_counter() - start
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
    return _RankTimes(times=times, verified=frozenset(verified))


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
    table = Table(title=f"allreduce: {config.world_size} ranks, {config.transport} transport, float32, "
                        f"median of {config.iters}", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("size", "right"), ("algorithm", "left"), ("time ms", "right"),
                          ("algbw", "right"), ("busbw", "right"), ("vs gloo", "right"),
                          ("ok", "center")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    last_size = None
    for m in result.measurements:
        if last_size is not None and m.size_bytes != last_size:
            table.add_section()
        ratio = "" if m.busbw_vs_gloo is None else f"{m.busbw_vs_gloo:.2f}x"
        if m.busbw_vs_gloo is not None and m.algorithm != GLOO:
            ratio = f"[{'green' if m.busbw_vs_gloo >= 1.0 else 'red'}]{ratio}[/]"
        table.add_row(format_size(m.size_bytes) if m.size_bytes != last_size else "", m.algorithm,
                      f"{m.median_s * 1e3:.3f}", format_bandwidth(m.algbw), format_bandwidth(m.busbw),
                      ratio, "yes" if m.correct else "[red]NO[/]")
        last_size = m.size_bytes
    return table


def format_bandwidth(bytes_per_s: float) -> str:
    """Three significant digits in B/s, KB/s, MB/s or GB/s (powers of 1000)."""
    for factor, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if bytes_per_s >= factor:
            return f"{bytes_per_s / factor:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"
