"""The ``mlfabric`` command line: ``demo`` and the ``bench`` family (more commands slot in).

    mlfabric demo [--quick]
    mlfabric bench allreduce --world-size 4 --algorithms ring,halving_doubling,tree,gloo \\
        --sizes 4KB,1MB,64MB --iters 10 --warmup 2 --transport zmq --json out.json

Each command is a thin shell: it parses options into the frozen config dataclass of the
module that does the work (``mlfabric.bench.allreduce``, ``mlfabric.demo``), runs it, prints
a rich table and optionally writes JSON. A new command family is a sub-typer registered with
``app.add_typer`` (like ``bench_app``); a new benchmark is a command on ``bench_app``.
Errors in the options exit with status 2, failures of a run with status 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["app", "bench_app", "main"]

app = typer.Typer(
    name="mlfabric",
    help="mlfabric: a network-aware communication layer for distributed ML on PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks on local ranks: each prints a table and can write JSON (--json).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

console = Console()
T = TypeVar("T")


def split_list(text: str, what: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; empty items are an error."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise typer.BadParameter(f"expected a comma-separated list of {what}, got {text!r}")
    return items


def parse_sizes(text: str) -> list[int]:
    from mlfabric.units import parse_size

    sizes = []
    for item in split_list(text, "sizes"):
        try:
            sizes.append(parse_size(item))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return sizes


def make_config(factory: Callable[..., T], **fields: Any) -> T:
    """Build a config dataclass; its validation errors become usage errors (exit 2)."""
    try:
        return factory(**fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {path}")


def run_or_exit(fn: Callable[[], T]) -> T:
    """Run a workload; print a failure (a rank's traceback included) and exit 1."""
    from mlfabric.bench.procs import RankFailedError, RankTimeoutError

    try:
        return fn()
    except (RankFailedError, RankTimeoutError) as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None


def progress_bar(transient: bool = True) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=transient)


# --------------------------------------------------------------------------- bench


@bench_app.command("allreduce")
def bench_allreduce(
    world_size: Annotated[int, typer.Option("--world-size", "-n", help="Number of local ranks.")] = 4,
    algorithms: Annotated[str, typer.Option(
        help="Comma-separated: ring, halving_doubling, tree, auto (mlfabric) and gloo "
             "(torch.distributed, the reference).")] = "ring,halving_doubling,tree,gloo",
    sizes: Annotated[str, typer.Option(
        help="Comma-separated message sizes: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.")]
        = "4KB,1MB,64MB",
    iters: Annotated[int, typer.Option(help="Timed repetitions per size.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed repetitions per size, before the timed ones.")] = 2,
    transport: Annotated[str, typer.Option(help="mlfabric transport: zmq or torch.")] = "zmq",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write all figures and metadata here.")]
        = None,
    timeout: Annotated[float, typer.Option(help="Seconds before the whole run is killed.")] = 600.0,
    seed: Annotated[int, typer.Option(help="Seed of the input tensors.")] = 0,
) -> None:
    """Allreduce time, algbw and busbw of mlfabric's algorithms vs gloo, interleaved per repetition."""
    from mlfabric.bench.allreduce import AllreduceBenchConfig, render_table, run_allreduce_bench

    config = make_config(AllreduceBenchConfig, world_size=world_size,
                         algorithms=tuple(split_list(algorithms, "algorithms")),
                         sizes=tuple(parse_sizes(sizes)), iters=iters, warmup=warmup,
                         transport=transport, timeout_s=timeout, seed=seed)
    command = ["mlfabric", "bench", "allreduce", "--world-size", str(world_size), "--algorithms",
               ",".join(config.algorithms), "--sizes", sizes.replace(" ", ""), "--iters", str(iters),
               "--warmup", str(warmup), "--transport", transport, "--seed", str(seed)]
    if json_path is not None:
        command += ["--json", str(json_path)]
    with progress_bar() as progress:
        task = progress.add_task(f"allreduce on {world_size} ranks", total=None)
        result = run_or_exit(lambda: run_allreduce_bench(
            config, argv=command, on_progress=lambda done, total: progress.update(task, completed=done, total=total)))
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())


# --------------------------------------------------------------------------- demo


@app.command("demo")
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="A smaller, faster run.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the demo's figures here.")] = None,
) -> None:
    """Benchmark allreduce on 4 local ranks, then train a small MLP with DDP + mlfabric on 2."""
    from mlfabric.demo import demo_config, run_demo

    result = run_or_exit(lambda: run_demo(demo_config(quick=quick), console=console))
    if json_path is not None:
        write_json(json_path, result.to_dict())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
