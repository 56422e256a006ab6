"""Partial-allreduce microbenchmark (eager-SGD §6.1, Fig. 8/9): solo and majority vs synchronous.

    mlfabric bench partial --world-size 32 --skew linear:1ms..32ms --iterations 64 --json out.json

Spawns ``world_size`` local ranks (:mod:`mlfabric.bench.procs`), over the tcp transport by
default: with 32 processes on two cores a round costs what the runtime spends per message, and
the tcp transport runs the schedule on the thread that received the message where zmq wakes
a progress thread for each (``--transport zmq`` measures that: docs/results.md).
Every iteration runs the three variants one after the other (synchronous, solo, majority, then
the next iteration), so drift on a shared machine hits them alike; each variant's iteration is
the paper's loop body (Fig. 8; the reference code is fflib2's ``rsgd.c``/``ssgd.c``):

1. the ranks meet (the reference ends every iteration with ``MPI_Reduce`` + ``MPI_Barrier``,
   so every iteration starts with the ranks aligned). By default (``start="aligned"``) every
   rank starts its skew at the same instant, ``align_margin_s`` after the last rank entered a
   barrier (local ranks share the clock): on 32 processes sharing two cores a barrier's exit
   takes tens of milliseconds to reach the last rank, which would blur a 1 ms skew step and
   overlap the measured collectives. ``start="barrier"`` sleeps from the barrier's exit, as
   the reference does;
2. rank ``r`` sleeps its skew (``linear:1ms..32ms``: 1 ms + r * 31 ms / (P - 1));
3. the rank's *latency* is the time from the call to the return of the collective, on that
   rank, with fresh data (all ones, "line 5"; a rank that has not called contributes what it
   has not contributed yet, zeros otherwise: "line 13").

All three variants use the same reduction schedule, by default the binomial tree: it sends
the fewest messages (2(P-1) per allreduce against halving-doubling's 2P log2 P), and with
many processes on few cores a round's cost is its messages' CPU. The barrier is a tree
allreduce too. The paper does not give the message size; the default is 1 KB (latency-bound).

Reported per variant: the mean latency over ranks and timed iterations (Fig. 9's bars), its
speedup over the synchronous allreduce (mlfabric's regular ``comm.allreduce``), and for solo
and majority the mean number of active processes, the ranks whose fresh data made it into
the round (Fig. 9's NAP). Every run is checked: the synchronous sum must be P each time, and
for the partial variants nothing may be lost: the rounds' sums plus one final flush round
must add up to P x iterations (stale contributions are carried, never dropped).

:func:`run_partial_bench` returns a :class:`PartialBenchResult` (``to_dict`` for JSON).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mlfabric.bench.procs import (ALIGN_MARGIN_S, LaunchConfig, aligned_start, check_choices, rank_env, report,
                                  run_ranks, sleep_until)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "PAPER_SPEEDUPS", "VARIANTS", "PartialBenchConfig", "PartialBenchResult", "VariantSummary",
    "parse_skew", "render_table", "run_partial_bench",
]

SYNCHRONOUS = "synchronous"
VARIANTS = (SYNCHRONOUS, "solo", "majority")
ELEMENT_BYTES = 4  # float32
#: eager-SGD §6.1 on 32 processes of a Cray XC50 (Cray MPICH): latency reduction over MPI_Allreduce.
PAPER_SPEEDUPS = {"solo": 53.32, "majority": 2.46}

_LINEAR = re.compile(r"^\s*linear\s*:\s*(?P<first>[^.]+?)\s*\.\.\s*(?P<last>\S+)\s*$", re.IGNORECASE)


def parse_skew(text: str, world_size: int) -> Any:
    """``linear:FIRST..LAST`` (rank 0 waits FIRST, rank P-1 waits LAST, linear in between),
    ``none``, or any :func:`mlfabric.emu.stragglers.imbalance_model` spelling (``skew:1ms``...).
    Returns an imbalance model with ``rows(workers, seed)`` (None for ``none``)."""
    from mlfabric.emu.stragglers import LinearSkew, imbalance_model
    from mlfabric.units import parse_duration

    match = _LINEAR.match(text)
    if match is None:
        return imbalance_model(text)
    first, last = parse_duration(match.group("first")), parse_duration(match.group("last"))
    if last < first:
        raise ValueError(f"skew {text!r}: the last rank's delay must not be below the first's")
    step = 0.0 if world_size < 2 else (last - first) / (world_size - 1)
    return LinearSkew(first_s=first, step_s=step)


@dataclass(frozen=True, kw_only=True)
class PartialBenchConfig:
    """What to measure. ``size_bytes`` is rounded down to whole float32 elements."""

    world_size: int = 32
    iterations: int = 64
    warmup: int = 2
    skew: str = "linear:1ms..32ms"
    size_bytes: int = 1024
    # The reduction's schedule, the same for all three variants. The binomial tree sends the
    # fewest messages (2(P-1) per allreduce, halving-doubling 2P log2 P): with 32 processes on
    # a few cores, per-message CPU is what a round costs.
    algorithm: str = "tree"
    variants: tuple[str, ...] = VARIANTS
    transport: str = "tcp"  # see the module docstring
    timeout_s: float = 900.0
    seed: int = 0  # majority's initiator draws
    # "aligned": every rank starts its skew at the same instant, align_margin_s after the last
    # rank entered a barrier; "barrier": when it leaves the barrier, like the reference code
    # (on an oversubscribed machine the barrier's exit wave then blurs the skew).
    start: str = "aligned"
    align_margin_s: float = ALIGN_MARGIN_S

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.collectives import choose_allreduce

        if self.world_size < 2:
            raise ValueError(f"the partial benchmark needs world_size >= 2, got {self.world_size}")
        if self.iterations < 1 or self.warmup < 0:
            raise ValueError(f"need iterations >= 1 and warmup >= 0, got {self.iterations}, {self.warmup}")
        if self.size_bytes < ELEMENT_BYTES:
            raise ValueError(f"size {self.size_bytes} B is smaller than one float32 element")
        check_choices(self.variants, VARIANTS, "variants", "variant")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.start not in ("aligned", "barrier") or not self.align_margin_s >= 0:
            raise ValueError(f"start must be aligned or barrier and align_margin_s >= 0, got {self.start}, "
                             f"{self.align_margin_s}")
        name = choose_allreduce(self.algorithm, self.size_bytes, self.world_size)
        if name in ("bcube", "hierarchical"):
            raise ValueError(f"algorithm {name!r} needs a topology; use ring, halving_doubling, tree or ps")
        parse_skew(self.skew, self.world_size)  # raises on a bad spelling

    @property
    def count(self) -> int:
        return self.size_bytes // ELEMENT_BYTES

    @property
    def resolved_algorithm(self) -> str:
        from mlfabric.collectives import choose_allreduce

        return choose_allreduce(self.algorithm, self.count * ELEMENT_BYTES, self.world_size)

    def delays(self) -> list[float]:
        """Each rank's skew in seconds (the first row of the model: linear skews do not move)."""
        model = parse_skew(self.skew, self.world_size)
        if model is None:
            return [0.0] * self.world_size
        return [float(d) for d in next(model.rows(self.world_size, self.seed))]


@dataclass(frozen=True, kw_only=True)
class VariantSummary:
    """One variant's figures. Times in seconds."""

    variant: str
    mean_s: float               # over ranks and timed iterations (Fig. 9)
    median_s: float
    p90_s: float
    max_s: float
    per_rank_mean_s: tuple[float, ...]
    per_iteration_mean_s: tuple[float, ...]
    speedup: float | None       # synchronous mean / this mean
    mean_active: float          # processes with fresh data per round (P for synchronous)
    active_per_round: tuple[int, ...]
    contributed_fraction: float  # calls whose tensor made it into the round they returned
    correct: bool


@dataclass(frozen=True, kw_only=True)
class PartialBenchResult:
    config: PartialBenchConfig
    summaries: tuple[VariantSummary, ...]
    delays_s: tuple[float, ...]
    startup_s: float  # launch to the first timed iteration, slowest rank
    wall_s: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def get(self, variant: str) -> VariantSummary:
        for s in self.summaries:
            if s.variant == variant:
                return s
        raise KeyError(f"no figures for variant {variant!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "partial-allreduce",
            "metadata": self.metadata,
            "config": {**asdict(self.config), "variants": list(self.config.variants),
                       "count": self.config.count, "algorithm_resolved": self.config.resolved_algorithm},
            "units": {"time": "s", "size": "bytes", "speedup": "synchronous mean latency / variant mean latency"},
            "delays_s": list(self.delays_s),
            "startup_s": self.startup_s,
            "wall_s": self.wall_s,
            "paper_speedups": PAPER_SPEEDUPS,
            "results": [{**asdict(s), "per_rank_mean_s": list(s.per_rank_mean_s),
                         "per_iteration_mean_s": list(s.per_iteration_mean_s),
                         "active_per_round": list(s.active_per_round)} for s in self.summaries],
        }


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _RankRecord:
    rank: int
    latencies: dict[str, list[float]]   # variant -> timed iterations
    active: dict[str, list[int]]
    contributed: dict[str, list[bool]]
    correct: dict[str, bool]
    problems: list[str]
    startup_s: float
    late: int  # aligned start: calls that could not wait their skew (the barrier ended too late)


def _rank_main(config: PartialBenchConfig, launched_at: float) -> _RankRecord:
    import logging

    import torch

    import mlfabric

    env = rank_env()
    comm = mlfabric.init(transport=config.transport, timeout=config.timeout_s)
    algorithm = config.resolved_algorithm
    delay = config.delays()[env.rank]
    fresh = torch.ones(config.count)
    work = torch.empty(config.count)
    latencies: dict[str, list[float]] = {v: [] for v in config.variants}
    active: dict[str, list[int]] = {v: [] for v in config.variants}
    contributed: dict[str, list[bool]] = {v: [] for v in config.variants}
    totals = {v: 0.0 for v in config.variants}
    problems: list[str] = []
    total = config.warmup + config.iterations
    token = torch.zeros(1, dtype=torch.int32)
    late = 0

    def barrier() -> None:  # a binomial-tree allreduce: 2(P-1) messages, not comm.barrier()'s 2P log2 P
        comm.allreduce(token, algorithm="tree")

    def start_time() -> float:
        """When every rank starts its skew: with ``start="barrier"`` when it leaves the barrier
        (the reference code); with ``"aligned"`` the same instant on every rank, a margin after
        the last one entered the barrier (local ranks share CLOCK_MONOTONIC)."""
        if config.start == "barrier":
            barrier()
            return time.monotonic()

        def latest(t: float) -> float:
            entered = torch.tensor([t], dtype=torch.float64)
            comm.allreduce(entered, algorithm="tree", op="max")
            return float(entered[0])

        return aligned_start(latest, config.align_margin_s)

    try:
        barrier()
        startup = time.time() - launched_at
        for it in range(total):
            timed = it >= config.warmup
            for variant in config.variants:
                if not sleep_until(start_time() + delay) and config.start == "aligned":
                    late += 1
                if variant == SYNCHRONOUS:
                    work.copy_(fresh)
                    start = time.perf_counter()
                    comm.allreduce(work, algorithm=algorithm)
                    elapsed = time.perf_counter() - start
                    value, n_active, fresh_in = float(work[0]), env.world_size, True
                    if value != env.world_size:
                        problems.append(f"synchronous iteration {it}: sum {value}, expected {env.world_size}")
                else:
                    start = time.perf_counter()
                    res = comm.partial_allreduce(fresh, variant, algorithm=algorithm, seed=config.seed)
                    elapsed = time.perf_counter() - start
                    value, n_active, fresh_in = float(res.tensor[0]), res.active, res.contributed
                    if res.round != it:
                        problems.append(f"{variant} iteration {it} returned round {res.round}")
                totals[variant] += value
                if timed:
                    latencies[variant].append(elapsed)
                    active[variant].append(n_active)
                    contributed[variant].append(fresh_in)
            if env.rank == 0:
                report(it + 1)
        # Flush: one more round of each partial variant with nothing fresh; every rank's
        # leftover (stale) contributions are in it, so the sums must add up to P x total.
        correct = {}
        for variant in config.variants:
            if variant != SYNCHRONOUS:
                barrier()
                totals[variant] += float(comm.partial_allreduce(torch.zeros(config.count), variant,
                                                                algorithm=algorithm, seed=config.seed).tensor[0])
            expected = float(env.world_size * total)
            correct[variant] = totals[variant] == expected and not any(p.startswith(variant) for p in problems)
            if totals[variant] != expected:
                problems.append(f"{variant}: the rounds add up to {totals[variant]}, expected {expected}")
        barrier()
    finally:
        # Ranks leave one by one: the partial collectives' notes about departed peers are noise here.
        logging.getLogger("mlfabric.runtime.partial").setLevel(logging.ERROR)
        comm.close()
    return _RankRecord(rank=env.rank, latencies=latencies, active=active, contributed=contributed,
                       correct=correct, problems=problems, startup_s=startup, late=late)


# --------------------------------------------------------------------------- in the parent


def run_partial_bench(config: PartialBenchConfig, *, argv: Sequence[str] | None = None,
                      on_progress: Callable[[int, int], None] | None = None,
                      capture_output: bool = False) -> PartialBenchResult:
    """Run the microbenchmark on ``config.world_size`` local ranks and summarize it.

    ``on_progress(done, total)`` follows rank 0's iterations (warm-up included)."""
    from mlfabric.bench.allreduce import collect_metadata

    total = config.warmup + config.iterations

    def on_report(rank: int, payload: Any) -> None:
        if on_progress is not None and rank == 0:
            on_progress(int(payload), total)

    launched = time.time()
    launch = LaunchConfig(world_size=config.world_size, timeout_s=config.timeout_s, capture_output=capture_output)
    records: list[_RankRecord] = run_ranks(_rank_main, config=launch, args=(config, launched), on_report=on_report)
    wall = time.time() - launched
    summaries = summarize(config, records)
    metadata = collect_metadata(config, argv)  # type: ignore[arg-type]  # reads world_size, transport
    metadata.update({"algorithm": config.resolved_algorithm, "count": config.count,
                     "late_calls": sum(r.late for r in records),
                     "problems": sorted({p for r in records for p in r.problems})[:20]})
    return PartialBenchResult(config=config, summaries=tuple(summaries), delays_s=tuple(config.delays()),
                              startup_s=max(r.startup_s for r in records), wall_s=wall, metadata=metadata)


def summarize(config: PartialBenchConfig, records: Sequence[_RankRecord]) -> list[VariantSummary]:
    base: float | None = None
    out = []
    for variant in config.variants:
        per_rank = [r.latencies[variant] for r in records]
        flat = sorted(t for series in per_rank for t in series)
        mean = statistics.fmean(flat)
        if variant == SYNCHRONOUS:
            base = mean
        actives = records[0].active[variant]
        calls = [c for r in records for c in r.contributed[variant]]
        out.append(VariantSummary(
            variant=variant, mean_s=mean, median_s=statistics.median(flat),
            p90_s=flat[min(len(flat) - 1, math.ceil(0.9 * len(flat)) - 1)], max_s=flat[-1],
            per_rank_mean_s=tuple(statistics.fmean(s) for s in per_rank),
            per_iteration_mean_s=tuple(statistics.fmean(it) for it in zip(*per_rank)),
            speedup=None, mean_active=statistics.fmean(actives), active_per_round=tuple(actives),
            contributed_fraction=sum(calls) / len(calls),
            correct=all(r.correct.get(variant, False) for r in records)))
    if base is not None:
        out = [VariantSummary(**{**asdict(s), "speedup": base / s.mean_s}) for s in out]
    return out


# --------------------------------------------------------------------------- presentation


def render_table(result: PartialBenchResult) -> Table:
    """A rich table in the shape of Fig. 9: mean latency, speedup, active processes."""
    from rich import box
    from rich.table import Table

    from mlfabric.units import format_size

    config = result.config
    delays = result.delays_s
    table = Table(title=f"partial allreduce: {config.world_size} ranks, {config.transport} transport, "
                        f"{format_size(config.count * ELEMENT_BYTES)} float32 ({config.resolved_algorithm}), "
                        f"skew {delays[0] * 1e3:.3g}..{delays[-1] * 1e3:.3g} ms, mean of {config.iterations} "
                        "iterations x ranks", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("variant", "mean ms", "median ms", "p90 ms", "vs synchronous", "paper", "active", "ok"):
        table.add_column(name, justify="left" if name == "variant" else "right", no_wrap=True)
    for s in result.summaries:
        speed = "" if s.speedup is None or s.variant == SYNCHRONOUS else f"{s.speedup:.2f}x"
        paper = f"{PAPER_SPEEDUPS[s.variant]:.2f}x" if s.variant in PAPER_SPEEDUPS else ""
        table.add_row(s.variant, f"{s.mean_s * 1e3:.2f}", f"{s.median_s * 1e3:.2f}", f"{s.p90_s * 1e3:.2f}",
                      speed, paper, f"{s.mean_active:.1f}", "yes" if s.correct else "[red]NO[/]")
    table.caption = (f"start-up {result.startup_s:.1f} s, whole run {result.wall_s:.1f} s; active = processes "
                     "whose fresh data is in the round (eager-SGD's NAP)")
    table.caption_justify = "left"
    return table
