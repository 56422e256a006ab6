"""The demo: what mlfabric does today, in about a minute on a laptop.

    mlfabric demo            # or: make demo;  mlfabric demo --quick for a smaller run

1. The allreduce benchmark (:mod:`mlfabric.bench.allreduce`) on 4 local ranks: mlfabric's
   ring, halving-doubling and binomial-tree allreduce against gloo, interleaved, results
   checked against gloo's.
2. DDP training of a small MLP on a synthetic task (:mod:`mlfabric.train`) on 2 ranks, with
   mlfabric's comm hook carrying the gradients, and the same run with DDP's own gloo
   allreduce side by side (same seed: the loss curves should agree).
3. Stragglers (eager-SGD §6.2.1, small): hyperplane regression on 8 local ranks, one random
   worker delayed every step, trained with synchronous SGD (allreduce) and with eager-SGD
   (solo and majority partial allreduce, :mod:`mlfabric.train.harness`): throughput, final
   validation MSE and a plot of MSE vs wall time (needs matplotlib).
4. A summary: final loss, accuracy and steps/s of the DDP runs, and each algorithm's busbw
   relative to gloo per message size.

It says first what each part starts (local processes: 4, then 2 twice, then 8) and where it
writes (``runs/demo/``, ``--out DIR``: the straggler plot), never into the current directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mlfabric.bench.allreduce import (
    GLOO,
    AllreduceBenchConfig,
    AllreduceBenchResult,
    collect_metadata,
    render_table,
    run_allreduce_bench,
)
from mlfabric.progress import progress_bar
from mlfabric.train import BASELINE, TrainConfig, TrainResult, run_training
from mlfabric.train.harness import MODES, EagerTrainConfig, EagerTrainResult, run_eager_training
from mlfabric.units import format_size

__all__ = ["DemoConfig", "DemoResult", "demo_config", "run_demo"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    bench: AllreduceBenchConfig
    train: TrainConfig
    train_world_size: int = 2
    compare_baseline: bool = True  # also train with DDP's default allreduce
    stragglers: EagerTrainConfig | None = None  # synchronous vs eager-SGD under injected delays
    #: The run directory: what the demo writes goes there (it prints it first).
    out_dir: str = "runs/demo"
    #: The straggler scenario's plot; None: ``<out_dir>/stragglers.png``.
    plot_path: str | None = None

    @property
    def plot(self) -> str:
        return self.plot_path if self.plot_path is not None else str(PurePath(self.out_dir) / "stragglers.png")

    def plan(self) -> list[str]:
        """One line per part: what it runs and the local processes it starts."""
        runs = 2 if self.compare_baseline else 1
        lines = [f"allreduce benchmark: {self.bench.world_size} local processes (ranks), mlfabric vs gloo",
                 f"DDP training: {runs} run{'s' if runs > 1 else ''} of {self.train_world_size} local processes "
                 f"(mlfabric's hook{', then DDP with gloo' if runs > 1 else ''})"]
        if self.stragglers is not None:
            lines.append(f"stragglers: {self.stragglers.workers} local processes, one launch for "
                         f"{len(self.stragglers.runs())} runs ({', '.join(self.stragglers.modes)}); "
                         f"plot {self.plot}")
        return lines


def demo_config(*, quick: bool = False) -> DemoConfig:
    """The demo's settings; ``quick`` shrinks every part."""
    if quick:
        bench = AllreduceBenchConfig(world_size=4, sizes=(4_000, 1_000_000), iters=3, warmup=1)
        train = TrainConfig(steps=100, algorithm="ring")
    else:
        bench = AllreduceBenchConfig(world_size=4, sizes=(4_000, 1_000_000, 16_000_000), iters=5, warmup=1)
        train = TrainConfig(steps=300, algorithm="ring")
    return DemoConfig(bench=bench, train=train, stragglers=stragglers_config(quick=quick))


def stragglers_config(*, quick: bool = False) -> EagerTrainConfig:
    """The straggler scenario: a 1,024-dimensional hyperplane on 8 ranks, one random worker
    delayed 100 ms every step; allreduce vs eager-SGD solo vs majority."""
    from mlfabric.train.workloads import HyperplaneSpec

    return EagerTrainConfig(workload="hyperplane", workers=8, modes=MODES, injects=("one-random:100ms",),
                            epochs=8 if quick else 16, batch_size=128, lr=0.1, sync_every_epochs=2,
                            hyperplane=HyperplaneSpec(dim=1024, train_samples=8_192, val_samples=2_048))


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    config: DemoConfig
    bench: AllreduceBenchResult
    training: tuple[TrainResult, ...]  # mlfabric hook first, then the baseline if run
    stragglers: EagerTrainResult | None = None
    plot: str | None = None  # the straggler scenario's plot, when drawn
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "demo": True,
            "metadata": self.metadata,
            "bench": self.bench.to_dict(),
            "training": [{**run.summary(), "losses": list(run.losses), "step_times_s": list(run.step_times)}
                         for run in self.training],
            "stragglers": None if self.stragglers is None else self.stragglers.to_dict(),
            "stragglers_plot": self.plot,
        }


def run_demo(config: DemoConfig, *, console: Console | None = None, quiet: bool = False) -> DemoResult:
    """Run the benchmark and the training runs, printing what runs and the tables on
    ``console``; progress bars go to standard error when it is a terminal, unless ``quiet``."""
    console = console or Console()
    console.rule("[bold]mlfabric demo")
    parts = 3 if config.stragglers is not None else 2
    console.print(f"writes to {config.out_dir}/ (--out DIR); {parts} parts, each starts local processes:",
                  highlight=False)
    for number, line in enumerate(config.plan(), 1):
        console.print(f"  {number}/{parts}  {line}", highlight=False)
    console.print(f"[bold]1/{parts}[/]  allreduce on {config.bench.world_size} local ranks: "
                  f"{', '.join(format_size(s) for s in config.bench.sizes)}; "
                  f"{config.bench.iters} timed + {config.bench.warmup} warm-up reps")
    with _progress(quiet) as progress:
        task = progress.add_task("allreduce", total=None)
        bench = run_allreduce_bench(
            config.bench, argv=["mlfabric", "demo"], capture_output=True,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    console.print(render_table(bench))

    runs = [config.train]
    if config.compare_baseline:
        runs.append(dataclasses.replace(config.train, algorithm=BASELINE))
    console.print(f"[bold]2/{parts}[/]  DDP on {config.train_world_size} local ranks: MLP, synthetic "
                  f"{config.train.data.classes}-class task, {config.train.steps} steps")
    training = []
    for run in runs:
        label = _label(run)
        with _progress(quiet) as progress:
            task = progress.add_task(f"{label:<22} loss      ?", total=run.steps)

            def on_step(step: int, loss: float, task: Any = task, label: str = label, p: Progress = progress) -> None:
                p.update(task, completed=step, description=f"{label:<22} loss {loss:6.3f}")

            training.append(run_training(run, world_size=config.train_world_size, on_step=on_step,
                                         capture_output=True))
    stragglers, plot = None, None
    if config.stragglers is not None:
        stragglers, plot = _run_stragglers(config, console, quiet)
    result = DemoResult(config=config, bench=bench, training=tuple(training), stragglers=stragglers, plot=plot,
                        metadata=collect_metadata(config.bench, ["mlfabric", "demo"]))
    console.print(_training_table(result))
    console.print(_ratio_table(bench))
    if stragglers is not None:
        console.print(_stragglers_table(stragglers))
        if plot is not None:
            console.print(f"plot: {plot}")
    return result


def _run_stragglers(config: DemoConfig, console: Console, quiet: bool) -> tuple[EagerTrainResult, str | None]:
    from pathlib import Path

    from mlfabric.train.harness import plot_curves

    eager = config.stragglers
    assert eager is not None
    console.print(f"[bold]3/3[/]  stragglers: {eager.workload} ({eager.hyperplane.dim} dimensions) on {eager.workers} "
                  f"local ranks, one random worker delayed {eager.injects[0].split(':', 1)[1]} every step; "
                  f"{', '.join(eager.modes)}")
    with _progress(quiet) as progress:
        task = progress.add_task("stragglers", total=len(eager.runs()))
        result = run_eager_training(eager, argv=["mlfabric", "demo"], capture_output=True,
                                    on_run=lambda done, total: progress.update(task, completed=done, total=total))
    plot = None
    try:
        Path(config.plot).parent.mkdir(parents=True, exist_ok=True)
        plot = str(plot_curves(result, Path(config.plot)))
    except RuntimeError as exc:  # matplotlib is not installed
        console.print(f"[yellow]no plot:[/] {exc}")
    return result, plot


def _stragglers_table(result: EagerTrainResult) -> Table:
    base = result.get("allreduce")
    # Short headers, explained in the caption: all six columns fit an 80-column terminal (and
    # a pipe, which rich sizes at 80); longer ones were cut off there.
    table = Table(title=f"stragglers: {result.config.workers} ranks, {result.config.injects[0]}, "
                        f"{result.config.steps} steps per rank", title_justify="left", box=box.SIMPLE_HEAD,
                  caption="speedup and MSE change: against allreduce; val MSE: final validation MSE; "
                          "active: ranks whose fresh gradients a round used", caption_justify="left")
    for name in ("gradients via", "steps/s", "speedup", "val MSE", "MSE change", "active"):
        table.add_column(name, justify="left" if name == "gradients via" else "right", no_wrap=True)
    for run in result.runs:
        table.add_row(run.mode, f"{run.steps_per_s:.2f}", f"{run.steps_per_s / base.steps_per_s:.2f}x",
                      f"{run.final_metric:.3f}", f"{(run.final_metric / base.final_metric - 1) * 100:+.1f}%",
                      "" if run.mean_active is None else f"{run.mean_active:.1f} of {result.config.workers}")
    return table


def _label(run: TrainConfig) -> str:
    if run.algorithm == BASELINE:
        return "DDP default (gloo)"
    return f"mlfabric {run.algorithm} hook"


def _progress(quiet: bool) -> Progress:
    # The demo's bars stay once done: with the loss of each DDP run, they are part of its story.
    return progress_bar(quiet=quiet, transient=False)


def _training_table(result: DemoResult) -> Table:
    table = Table(title=f"DDP training: {result.config.train_world_size} ranks, "
                        f"{result.training[0].parameters:,} parameters, {result.config.train.steps} steps",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("gradients via", "loss start", "loss end", "test acc", "steps/s"):
        table.add_column(name, justify="left" if name == "gradients via" else "right", no_wrap=True)
    baseline = next((r for r in result.training if r.config.algorithm == BASELINE), None)
    if baseline is not None and len(result.training) > 1:
        table.add_column("vs gloo", justify="right", no_wrap=True)
        hooked = result.training[0]
        gap = max(abs(a - b) for a, b in zip(hooked.losses, baseline.losses))
        table.caption = f"loss curves, hook vs default: largest difference {gap:.2g}"
    table.caption_justify = "left"
    for run in result.training:
        row = [_label(run.config), f"{run.initial_loss:.3f}",
               f"{run.final_loss:.3f}", f"{run.accuracy:.1%}", f"{run.steps_per_s:.1f}"]
        if baseline is not None and len(result.training) > 1:
            row.append(f"{run.steps_per_s / baseline.steps_per_s:.2f}x")
        table.add_row(*row)
    return table


def _ratio_table(bench: AllreduceBenchResult) -> Table:
    sizes = bench.config.sizes
    table = Table(title="busbw vs gloo (>1: faster)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("algorithm", no_wrap=True)
    for size in sizes:
        table.add_column(format_size(size), justify="right", no_wrap=True)
    for algorithm in bench.config.algorithms:
        if algorithm == GLOO:
            continue
        cells = []
        for size in sizes:
            ratio = bench.get(size, algorithm).busbw_vs_gloo
            cells.append("" if ratio is None else
                         f"[{'green' if ratio >= 1 else 'red'}]{ratio:.2f}x[/]")
        table.add_row(algorithm, *cells)
    return table
