"""The demo: what mlfabric does today, in about a minute on a laptop.

    mlfabric demo            # or: make demo;  mlfabric demo --quick for a smaller run

1. The allreduce benchmark (:mod:`mlfabric.bench.allreduce`) on 4 local ranks: mlfabric's
   ring, halving-doubling and binomial-tree allreduce against gloo, interleaved, results
   checked against gloo's.
2. DDP training of a small MLP on a synthetic task (:mod:`mlfabric.train`) on 2 ranks, with
   mlfabric's comm hook carrying the gradients, and the same run with DDP's own gloo
   allreduce side by side (same seed: the loss curves should agree).
3. A summary: final loss, accuracy and steps/s of both runs, and each algorithm's busbw
   relative to gloo per message size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mlfabric.bench.allreduce import (
    GLOO,
    AllreduceBenchConfig,
    AllreduceBenchResult,
    collect_metadata,
    render_table,
    run_allreduce_bench,
)
from mlfabric.train import BASELINE, TrainConfig, TrainResult, run_training
from mlfabric.units import format_size

__all__ = ["DemoConfig", "DemoResult", "demo_config", "run_demo"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    bench: AllreduceBenchConfig
    train: TrainConfig
    train_world_size: int = 2
    compare_baseline: bool = True  # also train with DDP's default allreduce


def demo_config(*, quick: bool = False) -> DemoConfig:
    """The demo's settings; ``quick`` shrinks every part."""
    if quick:
        bench = AllreduceBenchConfig(world_size=4, sizes=(4_000, 1_000_000), iters=3, warmup=1)
        train = TrainConfig(steps=100, algorithm="ring")
    else:
        bench = AllreduceBenchConfig(world_size=4, sizes=(4_000, 1_000_000, 16_000_000), iters=5, warmup=1)
        train = TrainConfig(steps=300, algorithm="ring")
    return DemoConfig(bench=bench, train=train)


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    config: DemoConfig
    bench: AllreduceBenchResult
    training: tuple[TrainResult, ...]  # mlfabric hook first, then the baseline if run
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "demo": True,
            "metadata": self.metadata,
            "bench": self.bench.to_dict(),
            "training": [{**run.summary(), "losses": list(run.losses), "step_times_s": list(run.step_times)}
                         for run in self.training],
        }


def run_demo(config: DemoConfig, *, console: Console | None = None) -> DemoResult:
    """Run the benchmark and the training runs, printing progress and tables on ``console``."""
    console = console or Console()
    console.rule("[bold]mlfabric demo")
    console.print(f"[bold]1/2[/]  allreduce on {config.bench.world_size} local ranks: "
                  f"{', '.join(format_size(s) for s in config.bench.sizes)}; "
                  f"{config.bench.iters} timed + {config.bench.warmup} warm-up reps")
    with _progress(console) as progress:
        task = progress.add_task("allreduce", total=None)
        bench = run_allreduce_bench(
            config.bench, argv=["mlfabric", "demo"], capture_output=True,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    console.print(render_table(bench))

    runs = [config.train]
    if config.compare_baseline:
        runs.append(dataclasses.replace(config.train, algorithm=BASELINE))
    console.print(f"[bold]2/2[/]  DDP on {config.train_world_size} local ranks: MLP, synthetic "
                  f"{config.train.data.classes}-class task, {config.train.steps} steps")
    training = []
    for run in runs:
        label = _label(run)
        with _progress(console) as progress:
            task = progress.add_task(f"{label:<22} loss      ?", total=run.steps)

            def on_step(step: int, loss: float, task: Any = task, label: str = label, p: Progress = progress) -> None:
                p.update(task, completed=step, description=f"{label:<22} loss {loss:6.3f}")

            training.append(run_training(run, world_size=config.train_world_size, on_step=on_step,
                                         capture_output=True))
    result = DemoResult(config=config, bench=bench, training=tuple(training),
                        metadata=collect_metadata(config.bench, ["mlfabric", "demo"]))
    console.print(_training_table(result))
    console.print(_ratio_table(bench))
    return result


def _label(run: TrainConfig) -> str:
    if run.algorithm == BASELINE:
        return "DDP default (gloo)"
    return f"mlfabric {run.algorithm} hook"


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


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
