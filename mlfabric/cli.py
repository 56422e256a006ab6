"""The ``mlfabric`` command line: ``demo``, the ``bench`` family and ``simulate`` (more commands slot in).

    mlfabric demo [--quick]
    mlfabric bench allreduce --world-size 4 --algorithms ring,halving_doubling,tree,gloo \\
        --sizes 4KB,1MB,64MB --iters 10 --warmup 2 --transport zmq --json out.json
    mlfabric bench allreduce --emulate --topology bcube:n=3,k=2 --rate 500mbit --algorithms bcube,ring,gloo \\
        --sizes 64MB --compare-star --json out.json          # root: BML vs ring and PS on a star
    mlfabric bench bml-job --iterations 100 --batches 32,128 --rate 500mbit --json out.json   # root: BML Fig. 6
    mlfabric bench sim [--quick] [--json out.json]
    mlfabric bench partial --world-size 32 --skew linear:1ms..32ms --iterations 64 --json out.json  # eager-SGD Fig. 9
    mlfabric bench tictac --model inception --width 4 --workers 4 --ordering none,random,tio,tao --emulate \\
        --rate 1gbit --forward-only --json out.json                  # root: TicTac §6 on the PS
    mlfabric train --workload hyperplane --workers 8 --sync allreduce,eager-solo --inject one-random:300ms
    mlfabric simulate collective --topology bcube:n=4,k=2 --link 10Gbps --algorithm ring --size 100MB [--json -]
    mlfabric simulate ps --topology fat-tree:k=16,oversub=4 --workers 800 --servers 50 --strategy rack [--json -]
    mlfabric simulate bml [--servers 16,1024] [--json out.json]
    mlfabric simulate mlnet [--servers 50,100,200,300,400] [--oversub 1,4] [--seeds 0] [--quick] [--json out.json]
    mlfabric trace merge DIR [--out merged.json]      # after a run with MLFABRIC_TRACE=DIR

Each command is a thin shell: it parses options into the frozen config dataclass of the
module that does the work (``mlfabric.bench.allreduce``, ``mlfabric.demo``), runs it, prints
a rich table and optionally writes JSON. Each option is stated once, in the command's
signature: :func:`config_from` hands the config every option named like one of its fields,
and the command line a JSON records is :func:`invocation`, rebuilt from the parse. Sizes,
rates, counts and timeouts go through one set of checks (:func:`size_option`,
:func:`rate_option`, ``min=`` on integer options, :func:`timeout_seconds`,
:func:`check_processes`). Into a file or a pipe, tables keep their natural width
(:class:`OutputConsole`). The module imports no torch: each command imports what it runs
(``mlfabric --help`` starts in a fraction of a second; tests/unit/test_cli_startup.py).
Every command that writes JSON takes ``--json PATH`` (:data:`JsonOption`; ``--json -``: the
JSON on standard output, the tables on standard error, so ``mlfabric simulate ... --json - |
python -m json.tool`` works). Long commands show a
progress bar (:func:`mlfabric.progress.progress_bar`) on standard error when it is a
terminal; ``--quiet`` turns it off. A new command family is a sub-typer registered with
``app.add_typer`` (like ``bench_app``); a new benchmark is a command on ``bench_app``.
Errors in the options exit with status 2, failures of a run with status 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from rich.console import Console

from mlfabric.emu.cli import LAUNCH_CONTEXT, emu_app
from mlfabric.emu.cli import launch as emu_launch
from mlfabric.progress import progress_bar, step_reporter

__all__ = ["app", "bench_app", "main", "simulate_app"]

app = typer.Typer(
    name="mlfabric",
    help="mlfabric: a network-aware communication layer for distributed ML on PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks on local ranks: each prints a table and can write JSON (--json PATH, - for standard output).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
simulate_app = typer.Typer(
    help="Flow-level simulation on a topology (max-min fair sharing): prints a table and can write JSON "
         "(--json PATH, - for standard output).",
    no_args_is_help=True,
)
app.add_typer(simulate_app, name="simulate")
app.add_typer(emu_app, name="emu")
app.command("launch", context_settings=LAUNCH_CONTEXT)(emu_launch)
trace_app = typer.Typer(
    help="Timelines of collectives and transfers recorded with MLFABRIC_TRACE=DIR (Chrome/Perfetto JSON).",
    no_args_is_help=True,
)
app.add_typer(trace_app, name="trace")

class OutputConsole(Console):
    """The console of every command's tables and messages. On a terminal: rich's own (fits
    the terminal). Into a file or a pipe there is no width to fit (#39 item 6: `simulate
    mlfabric > out.txt` wrapped a caption to ~32 columns, `bench partial` cut its column names):
    a table is printed at its natural width, never squeezed, its caption (and a title wider
    than the table) on lines of their own; text is not wrapped (the pager or terminal that
    shows the file does that)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self.is_terminal or not objects:
            super().print(*objects, **kwargs)
            return
        import copy

        from rich.measure import Measurement
        from rich.table import Table

        kwargs.setdefault("soft_wrap", True)
        for item in objects:
            if not isinstance(item, Table):
                super().print(item, **kwargs)
                continue
            table, caption = copy.copy(item), item.caption
            table.caption = None
            wide = self.options.update(max_width=100_000)
            natural = Measurement.get(self, wide, table).maximum
            if item.title is not None and Measurement.get(self, wide, item.title).maximum > natural:
                table.title = None  # a title wider than the table: on its own line, not wrapped to the table
                super().print(item.title, style=item.title_style or "table.title", **kwargs)
            width = self._width
            self.width = natural  # print(width=) cannot go beyond the console's width
            try:
                super().print(table, **{**kwargs, "soft_wrap": False})
            finally:
                self._width = width
            if caption:
                super().print(caption, style=table.caption_style or "table.caption", **kwargs)


console = OutputConsole()
T = TypeVar("T")


def split_list(text: str, what: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; empty items are an error."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise typer.BadParameter(f"expected a comma-separated list of {what}, got {text!r}")
    return items


# --------------------------------------------------------------------------- sizes, rates, counts
# Every size, rate, count and timeout a command takes is checked the same way (#39: `simulate
# collective --size 3` of float32 simulated a 0-byte allreduce and exited 0): zero, negative,
# not a whole number of elements, or more than this machine can hold or start is a usage error
# (exit 2) that names the option. Integer counts state their range in their typer.Option
# (min=...), which click checks before the command runs.

#: Bytes of the float32 elements the benchmarks move.
FLOAT32 = 4
#: A local rank imports torch: ~220 MiB resident each (measured on the 2-core VM, torch 2.13);
#: more processes than RAM / this cannot start (and would take the machine down trying).
RANK_MEMORY_BYTES = 200 * 2**20


def _usage(option: str, message: str) -> typer.BadParameter:
    return typer.BadParameter(f"{option} {message}")


def size_option(text: str, option: str, *, itemsize: int | None = FLOAT32) -> int:
    """A size in bytes (``4KB``, ``1MiB``): at least one element, and with ``itemsize`` a whole
    number of ``itemsize``-byte elements (float32 by default; ``None``: any byte count > 0)."""
    from mlfabric.units import format_size, parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise _usage(option, str(exc)) from None
    unit = itemsize or 1
    element = f"one {unit}-byte element" if itemsize else "one byte"
    if size < unit:
        raise _usage(option, f"{text!r} is {size} bytes, less than {element}: nothing would be moved; give at least "
                             f"{unit} bytes")
    if size % unit:
        below, above = size - size % unit, size - size % unit + unit
        raise _usage(option, f"{text!r} ({size} bytes) is not a whole number of {unit}-byte elements: give a "
                             f"multiple of {unit}, e.g. {below} or {above} ({format_size(above)})")
    return size


def sizes_option(text: str, option: str, *, itemsize: int | None = FLOAT32) -> list[int]:
    """A comma-separated list of :func:`size_option` sizes."""
    return [size_option(item, option, itemsize=itemsize) for item in split_list(text, "sizes")]


def rate_option(text: str, option: str, *, emulated: bool = False) -> float:
    """A rate in bit/s (``1gbit``, ``10Gbps``): positive, and at least what tc can shape
    (8 kbit/s) when it is an emulated NIC's."""
    from mlfabric.units import parse_rate

    try:
        rate = parse_rate(text)
    except ValueError as exc:
        raise _usage(option, str(exc)) from None
    if not rate > 0:
        raise _usage(option, f"{text!r} is a rate of 0: nothing would ever arrive; give a positive rate, e.g. 1gbit")
    if emulated and rate < 8000:
        raise _usage(option, f"{text!r} is below 8 kbit/s, the least rate tc shapes")
    return rate


def timeout_seconds(value: Optional[float]) -> Optional[float]:
    """The check of every ``--timeout`` (seconds): positive, and at most what Python can wait
    (``threading.TIMEOUT_MAX``, ~292 years: beyond it every wait raises OverflowError)."""
    import threading

    if value is not None and not 0 < value <= threading.TIMEOUT_MAX:
        raise typer.BadParameter(f"must be > 0 and at most {threading.TIMEOUT_MAX:.3g} s, got {value:g}")
    return value


def physical_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_processes(count: int, option: str) -> None:
    """``count`` local processes (each imports torch) must fit in this machine's memory."""
    from mlfabric.units import format_size

    memory = physical_memory_bytes()
    if count * RANK_MEMORY_BYTES > memory:
        raise _usage(option, f"asks for {count:,} local processes; each imports torch "
                             f"(~{format_size(RANK_MEMORY_BYTES, binary=True)}) and this machine has "
                             f"{format_size(memory, binary=True)}: at most {memory // RANK_MEMORY_BYTES:,}")


def check_memory(nbytes: float, option: str, what: str) -> None:
    """What a run would hold (``nbytes``, described by ``what``) must fit in this machine's memory."""
    from mlfabric.units import format_size

    memory = physical_memory_bytes()
    if nbytes > memory:
        raise _usage(option, f"needs {what} = {format_size(nbytes)}, more than this machine's memory "
                             f"({format_size(memory, binary=True)})")


def check_buffers(nbytes: int, processes: int, option: str, *, copies: int = 2) -> None:
    """``processes`` local processes each holding ``copies`` buffers of ``nbytes`` (input and
    result) must fit in this machine's memory."""
    from mlfabric.units import format_size

    check_memory(copies * nbytes * processes, option,
                 f"{format_size(nbytes)} x {copies} buffers x {processes} processes")


def make_config(factory: Callable[..., T], **fields: Any) -> T:
    """Build a config dataclass; its validation errors become usage errors (exit 2)."""
    try:
        return factory(**fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# Each option is stated once, in the command's signature (#35): the config takes the options
# named like its fields from the parsed command line (config_from), and the command line the
# JSON records is rebuilt from the same parse (invocation); neither repeats an option's name.


def config_from(ctx: typer.Context, factory: Callable[..., T], /, **converted: Any) -> T:
    """``factory``'s config (a dataclass) from the running command's options: every option
    named like one of its fields is passed as parsed; ``converted`` gives the others (options
    parsed from text, renamed or resolved). Validation errors are usage errors (exit 2)."""
    import dataclasses
    import typing

    params = ctx.params
    fields = {field.name for field in dataclasses.fields(factory)}  # type: ignore[arg-type]
    same = {name: value for name, value in params.items() if name in fields and name not in converted}
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):  # an annotation that cannot be resolved here: no check
        hints = {}
    def takes_text(hint: Any) -> bool:  # str, Any, Optional[str], Literal["a", "b"], ...
        args = typing.get_args(hint)
        return hint in (str, Any, object) or any(isinstance(arg, str) or takes_text(arg) for arg in args)

    for name, value in same.items():
        hint = hints.get(name)
        if isinstance(value, str) and hint is not None and not takes_text(hint):
            # A programming error, not a usage one: the option's text needs parsing first.
            raise TypeError(f"--{name.replace('_', '-')} is text; {getattr(factory, '__name__', factory)}.{name} "
                            f"wants {hint}: pass it parsed, as a keyword of config_from")
    return make_config(factory, **same, **converted)


def invocation(ctx: typer.Context, /, **resolved: Any) -> list[str]:
    """The command line that reproduces the running command, from its parsed options: every
    option with its value, defaults included, in the order the command declares them (``--json``
    last); a switch only when it is not its default; ``resolved`` replaces values the command
    worked out (the world size an emulated topology implies). The command line of every JSON."""
    unknown = set(resolved) - set(ctx.params)
    if unknown:
        raise KeyError(f"invocation: no option {', '.join(sorted(unknown))}")
    names, parent = [], ctx
    while parent.parent is not None:
        names.append(parent.info_name)
        parent = parent.parent
    argv, tail = ["mlfabric", *reversed(names)], []
    values = {**ctx.params, **resolved}
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name == "quiet":
            continue
        value = values[param.name]
        flag = max((opt for opt in param.opts if opt.startswith("--")), key=len)
        into = tail if param.name == "json_path" else argv
        if param.is_flag:
            if value != param.default:
                into.append(flag if value else param.secondary_opts[0])
        elif value is not None:
            for item in value if param.multiple else [value]:
                into += [flag, repr(item) if isinstance(item, float) else str(item)]
    return argv + tail


#: What ``--json`` takes to mean standard output.
STDOUT = "-"


def to_stdout(json_path: Optional[Path]) -> bool:
    """Whether ``--json`` sends the JSON to standard output: then nothing else may go there,
    rank processes included (their output goes to log files, shown if a rank fails)."""
    return json_path is not None and str(json_path) == STDOUT


def _json_destination(ctx: typer.Context, value: Optional[Path]) -> Optional[Path]:
    """The ``--json`` option's check: a file, or ``-`` for standard output. With ``-`` the
    command's tables and messages go to standard error for this invocation, so that standard
    output holds the JSON alone (``... --json - | python -m json.tool`` works)."""
    if value is None:
        return None
    text = str(value)
    if to_stdout(value):
        console.stderr = True
        ctx.call_on_close(lambda: setattr(console, "stderr", False))
    elif text.startswith("-"):
        # Also what the old `simulate ... --json` switch turns into: `--json --links none`.
        raise typer.BadParameter(f"takes a file PATH, or - for standard output; got {text!r} (the old "
                                 f"`--json` switch is now `--json -`)")
    return value


#: ``--json PATH``, the one JSON option of every command (``-``: standard output).
JsonOption = Annotated[Optional[Path], typer.Option(
    "--json", metavar="PATH", callback=_json_destination,
    help="Write all figures and metadata as JSON to PATH; - writes them to standard output (the tables then go "
         "to standard error).")]
#: ``--quiet``, for every command that shows progress.
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display (shown on standard error, "
                                                                 "and only when it is a terminal).")]

#: ``--workers-per-host`` and ``--trees`` (issue #36), the same in ``simulate mlfabric`` and
#: ``train``; each command gives its default (the simulator plans trees by default, the
#: runtime does not yet: docs/mlfabric_scheduler.md, "At runtime", says why).
WorkersPerHostOption = Annotated[int, typer.Option(
    "--workers-per-host", min=1,
    help="Co-located workers per host (MLfabric's setup: 2): the MLfabric modes sum a host's updates on the host "
         "(no NIC) and the model reaches the host once; allreduce (RR-Sync) reduces in the host, then rings across "
         "hosts. train: local ranks grouped into hosts, or with --emulate that many worker ranks per emulated host "
         "(servers on hosts of their own).")]
TreesOption = Annotated[bool, typer.Option(
    "--trees/--no-trees", help="MLfabric modes: aggregate down pipelined multi-level trees chosen per batch and "
                               "multicast each model version down pipelined trees (issue #36); --no-trees: Alg. 3's "
                               "one level of aggregators and §10.3's one level of distributors.")]


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path``, or to standard output when ``path`` is
    ``-`` (the ``--json`` convention); a file is announced on the console."""
    text = json.dumps(data, indent=2) + "\n"
    if to_stdout(path):
        typer.echo(text, nl=False)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    console.print(f"wrote {path}")


def run_or_exit(fn: Callable[[], T], errors: tuple[type[BaseException], ...] | None = None) -> T:
    """Run a workload; print an expected failure (default: a rank failing or timing out, its
    traceback included) as one error line and exit 1."""
    if errors is None:
        from mlfabric.bench.procs import RankFailedError, RankTimeoutError

        errors = (RankFailedError, RankTimeoutError)
    try:
        return fn()
    except errors as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None


# --------------------------------------------------------------------------- bench


@bench_app.command("allreduce")
def bench_allreduce(
    ctx: typer.Context,
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of local ranks.")] = 4,
    algorithms: Annotated[str, typer.Option(
        help="Comma-separated: ring, halving_doubling, tree, ps, bcube (BML; on --topology bcube:...), "
             "hierarchical, auto (mlfabric) and gloo (torch.distributed, the reference).")]
        = "ring,halving_doubling,tree,gloo",
    sizes: Annotated[str, typer.Option(
        help="Comma-separated message sizes: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.")]
        = "4KB,1MB,64MB",
    iters: Annotated[int, typer.Option(min=1, help="Timed repetitions per size.")] = 10,
    start: Annotated[str, typer.Option(help="aligned: every call starts at one instant on all ranks and "
                                            "is timed from it (as simulated); barrier: from each rank's "
                                            "exit of a gloo barrier (its exit skew counts).")] = "aligned",
    warmup: Annotated[int, typer.Option(min=0, help="Untimed repetitions per size, before the timed ones.")] = 2,
    transport: Annotated[str, typer.Option(help="mlfabric transport: tcp (default), zmq or torch.")] = "tcp",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole run is killed.")]
        = 600.0,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the input tensors.")] = 0,
    emulate: Annotated[bool, typer.Option("--emulate", help="Run each rank on a host of an emulated "
                                          "cluster (root; see `mlfabric emu doctor`).")] = False,
    hosts: Annotated[Optional[int], typer.Option("--hosts", min=2, help="With --emulate: hosts of a star "
                                                 "(sets --world-size).")] = None,
    topology: Annotated[Optional[str], typer.Option(help="With --emulate: topology spec, e.g. "
                                                    "star:n=8, racks:r=2,h=4,oversub=4, bcube:n=3,k=2.")] = None,
    rate: Annotated[str, typer.Option(help="With --emulate: NIC rate, e.g. 1gbit, 500mbit.")] = "1gbit",
    compare_star: Annotated[bool, typer.Option("--compare-star", help="With --emulate --topology bcube:...: "
                                               "then run ring and ps on a star of the same hosts at the same "
                                               "NIC rate and report BML's speedup (BML §4).")] = False,
    goodput: Annotated[bool, typer.Option("--goodput/--no-goodput", help="With --emulate: first measure one TCP "
                                          "flow between hosts 0 and 1 (2.5 s) and show busbw relative to it.")] = True,
    ranks_per_host: Annotated[int, typer.Option("--ranks-per-host", min=1, help="With --emulate: ranks on every host "
                                                "(they share memory; --world-size becomes hosts x this).")] = 1,
    placement: Annotated[str, typer.Option(help="With --ranks-per-host: consecutive (ranks h*R.. on host h) or "
                                                "interleaved (rank r on host r mod hosts).")] = "consecutive",
    compare_flat: Annotated[bool, typer.Option("--compare-flat", help="With --ranks-per-host and "
                                               "host_hierarchical: then ring on the hosts alone and a flat ring over "
                                               "all ranks, interleaved (issue #27's bars).")] = False,
) -> None:
    """Allreduce time, algbw and busbw of mlfabric's algorithms vs gloo, interleaved per repetition.

    Emulated runs also show the simulator's time for each mlfabric algorithm (emu/sim) and,
    with --goodput, busbw relative to the two-host TCP goodput measured in the same run."""
    from mlfabric.bench.allreduce import (AllreduceBenchConfig, compare_star_config, render_comparison,
                                          render_table, run_allreduce_bench, run_bml_comparison)

    emulate_topology = None
    emulate_rate = rate_option(rate, "--rate", emulated=True)  # checked even where unused: a typo is caught
    if emulate:
        from mlfabric.emu.cluster import plan_cluster
        from mlfabric.emu.launcher import resolve_topology

        # A full spec (bcube:n=3,k=2) sets the number of ranks; a bare "star" takes --hosts or --world-size.
        given = hosts if hosts is not None or (topology and ":" in topology) else world_size
        spec = make_config(resolve_topology, topology=topology or "star", hosts=given)
        emulate_topology = str(spec)
        world_size = plan_cluster(spec, emulate_rate).n_hosts * ranks_per_host
    check_processes(world_size, "--world-size")
    size_list = sizes_option(sizes, "--sizes")
    check_buffers(max(size_list), world_size, "--sizes")
    config = config_from(ctx, AllreduceBenchConfig, world_size=world_size, emulate_topology=emulate_topology,
                         emulate_rate_bps=emulate_rate if emulate else None,
                         algorithms=tuple(split_list(algorithms, "algorithms")),
                         sizes=tuple(size_list), timeout_s=timeout, measure_goodput=goodput)
    command = invocation(ctx, world_size=world_size, algorithms=",".join(config.algorithms),
                         sizes=sizes.replace(" ", ""), topology=emulate_topology)
    if compare_flat:
        from mlfabric.bench.allreduce import flat_comparison_configs

        make_config(flat_comparison_configs, config=config)  # usage errors before anything runs
    if compare_star:
        make_config(compare_star_config, config=config)  # usage errors before anything runs
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"allreduce on {world_size} ranks", total=None)
        from mlfabric.bench.allreduce import render_hierarchy, run_hierarchy_comparison

        run = run_bml_comparison if compare_star else run_hierarchy_comparison if compare_flat else run_allreduce_bench
        result = run_or_exit(lambda: run(
            config, argv=command, capture_output=to_stdout(json_path),
            on_progress=lambda done, total: progress.update(task, completed=done, total=total)))
    if compare_flat:
        console.print(render_hierarchy(result))
    elif compare_star:
        for table in render_comparison(result):
            console.print(table)
    else:
        console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())


@bench_app.command("bml-job")
def bench_bml_job(
    ctx: typer.Context,
    iterations: Annotated[int, typer.Option(min=1, help="Training iterations per run.")] = 100,
    batches: Annotated[str, typer.Option(help="Comma-separated sub-minibatch sizes (per rank).")] = "32,128",
    rate: Annotated[str, typer.Option(help="Rate of every emulated NIC, e.g. 500mbit.")] = "500mbit",
    topology: Annotated[str, typer.Option(help="BML's BCube; PS runs on a star of as many hosts.")]
        = "bcube:n=3,k=2",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before one run is killed.")]
        = 1800.0,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the model, data and batches.")] = 0,
) -> None:
    """BML Fig. 6 (root): LeNet-5 JCT, BML (bcube) on an emulated BCube vs PS (ps) on a star."""
    from mlfabric.train.bml_job import BmlJobConfig, render_job_table, run_bml_job

    sizes = [_parse_or_usage(int, item) for item in split_list(batches, "batch sizes")]
    config = config_from(ctx, BmlJobConfig, batches=tuple(sizes), bcube=topology,
                         rate_bps=rate_option(rate, "--rate", emulated=True), timeout_s=timeout)
    if max(sizes) > config.train_samples:
        raise _usage("--batches", f"{max(sizes):,} is more than the {config.train_samples:,} training samples")
    command = invocation(ctx, batches=",".join(map(str, sizes)))
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task("LeNet-5", total=iterations)
        result = run_or_exit(lambda: run_bml_job(
            config, argv=command, capture_output=to_stdout(json_path),
            on_step=lambda label, done, total: progress.update(task, description=label, completed=done, total=total)))
    console.print(render_job_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())


@bench_app.command("sim")
def bench_sim(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option("--quick", help="Skip the naive solver and the 500k-flow instances.")] = False,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the placement and of ECMP.")] = 0,
) -> None:
    """Max-min solver and event-engine timings on MLNET's 1,024-host fat-tree (800x50 and 624x400 PS)."""
    from mlfabric.flow.bench import BenchmarkConfig, benchmark_solver, format_benchmark
    from mlfabric.sim.bench import EngineBenchConfig, benchmark_engine, format_engine_benchmark

    solver_config = BenchmarkConfig(seed=seed, include_naive=not quick, include_large=not quick,
                                    include_drain=not quick, repeats=1 if quick else 3)
    engine_config = EngineBenchConfig(seed=seed, sizes=((800, 50),) if quick else ((800, 50), (624, 400)),
                                      naive_workers=0 if quick else 300)
    with progress_bar(quiet=quiet) as progress:
        on_step = step_reporter(progress, progress.add_task("max-min solver benchmark", total=None))
        solver = benchmark_solver(solver_config, on_step=lambda label: on_step(f"max-min solver: {label}"))
    console.print(format_benchmark(solver), highlight=False, soft_wrap=True)
    with progress_bar(quiet=quiet) as progress:
        on_step = step_reporter(progress, progress.add_task("event engine benchmark", total=None))
        engine = benchmark_engine(engine_config, on_step=lambda label: on_step(f"event engine: {label}"))
    console.print(format_engine_benchmark(engine), highlight=False, soft_wrap=True)
    naive_40k = solver.get("push_40k", {}).get("naive_wall_s")
    if naive_40k:
        for run in engine["runs"]:
            if "wall_s" in run:
                run["wall_vs_one_naive_40k_solve"] = run["wall_s"] / naive_40k
        first = next((run for run in engine["runs"] if "wall_s" in run), None)
        if first:
            console.print(f"  one whole {first['workers']} x {first['servers']} iteration ({first['barrier']} barrier) "
                          f"= {first['wall_vs_one_naive_40k_solve']:.2f} x one naive solve of its 40k push flows "
                          f"({naive_40k:.2f}s)", highlight=False, soft_wrap=True)
    if json_path is not None:
        write_json(json_path, {"command": " ".join(invocation(ctx)), "solver": solver, "engine": engine})


@bench_app.command("partial")
def bench_partial(
    ctx: typer.Context,
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of local ranks (processes).")]
        = 32,
    skew: Annotated[str, typer.Option(help="Delay before each call: linear:FIRST..LAST (rank 0 waits FIRST, the "
                                           "last rank LAST), none, or skew:FIRST[,STEP].")] = "linear:1ms..32ms",
    iterations: Annotated[int, typer.Option(min=1, help="Timed iterations (each runs all three variants).")] = 64,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed iterations before them.")] = 2,
    size: Annotated[str, typer.Option(help="Message size (float32): KB/MB powers of 1000, KiB/MiB of 1024.")] = "1KB",
    algorithm: Annotated[str, typer.Option(help="Reduction schedule of all three variants: tree, halving_doubling, "
                                               "ring, ps or auto.")] = "tree",
    transport: Annotated[str, typer.Option(help="mlfabric transport: tcp, zmq or torch.")] = "tcp",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole run is killed.")]
        = 900.0,
    seed: Annotated[int, typer.Option(min=0, help="Seed of majority's initiator draws.")] = 0,
) -> None:
    """Solo and majority allreduce vs synchronous under a linear skew (eager-SGD §6.1, Fig. 8/9).

    Every iteration: a barrier, rank r sleeps its skew, then calls the collective; latency is
    measured per rank from the call to its return and averaged over ranks and iterations."""
    from mlfabric.bench.partial import PartialBenchConfig, render_table, run_partial_bench

    check_processes(world_size, "--world-size")
    size_bytes = size_option(size, "--size")
    check_buffers(size_bytes, world_size, "--size")
    config = config_from(ctx, PartialBenchConfig, size_bytes=size_bytes, timeout_s=timeout)
    command = invocation(ctx)
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"partial allreduce on {world_size} ranks (start-up first)", total=None)
        result = run_or_exit(lambda: run_partial_bench(
            config, argv=command, capture_output=True,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total)))
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())
    if not all(s.correct for s in result.summaries):
        console.print("[bold red]error:[/] a variant's sums were wrong: " + "; ".join(result.metadata["problems"]))
        raise typer.Exit(1)


@bench_app.command("ps")
def bench_ps(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, help="Workers, one per emulated host after the servers'.")] = 8,
    servers: Annotated[int, typer.Option(min=1, help="Servers, on hosts 0..S-1 (the model is sharded over them).")] = 1,
    model_size: Annotated[str, typer.Option("--model-size", help="Model size (float32): KB/MB powers of 1000, "
                                            "KiB/MiB of 1024.")] = "64MB",
    rate: Annotated[str, typer.Option(help="Rate of every emulated NIC, e.g. 1gbit, 500mbit.")] = "1gbit",
    iterations: Annotated[int, typer.Option(min=1, help="Push+pull iterations, warm-up included.")] = 3,
    warmup: Annotated[int, typer.Option(min=0, help="Leading iterations not counted.")] = 1,
    transport: Annotated[str, typer.Option(help="mlfabric transport: tcp, zmq or torch.")] = "tcp",
    goodput: Annotated[bool, typer.Option("--goodput/--no-goodput", help="First measure one TCP flow between hosts "
                                          "0 and 1 (2.5 s) and also simulate at that rate.")] = True,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole run is killed.")]
        = 900.0,
) -> None:
    """PS incast (root): W workers push and pull a model through S servers on an emulated star, BSP.

    Reports the server NIC's ingress (push) and egress (pull) goodput as fractions of the NIC
    rate, and the iteration time against the simulator's for the same job (mlfabric.sim)."""
    from mlfabric.bench.ps import PSBenchConfig, render_tables, run_ps_bench
    from mlfabric.emu.cmd import EmuUnavailableError

    check_processes(workers + servers, "--workers")
    model_bytes = size_option(model_size, "--model-size")
    check_buffers(model_bytes, workers + servers, "--model-size")
    config = config_from(ctx, PSBenchConfig, model_bytes=model_bytes,
                         rate_bps=rate_option(rate, "--rate", emulated=True),
                         measure_goodput=goodput, timeout_s=timeout)
    command = invocation(ctx)
    from mlfabric.bench.procs import RankFailedError, RankTimeoutError

    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"ps: {workers} workers -> {servers} server(s)", total=iterations)
        result = run_or_exit(lambda: run_ps_bench(
            config, argv=command, capture_output=True,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total)),
            (RankFailedError, RankTimeoutError, EmuUnavailableError))
    for table in render_tables(result):
        console.print(table)
    if json_path is not None:
        write_json(json_path, result.to_dict())
    if not result.summary()["correct"]:
        console.print("[bold red]error:[/] a pulled model differed from the exact BSP result")
        raise typer.Exit(1)


@bench_app.command("mlnet-priorities")
def bench_mlnet_priorities(
    ctx: typer.Context,
    jobs: Annotated[int, typer.Option(min=1, help="Concurrent PS jobs (2-7), each with its own priority in the "
                                      "priority scenario.")] = 4,
    workers: Annotated[int, typer.Option(min=1, help="Workers per job; worker i of every job on host 1 + i, every "
                                         "server on host 0.")] = 3,
    model_size: Annotated[str, typer.Option("--model-size", help="Model size (float32) of every job.")] = "1MB",
    rate: Annotated[str, typer.Option(help="Rate of every emulated NIC.")] = "100mbit",
    iterations: Annotated[int, typer.Option(min=1, help="BSP iterations of every job.")] = 8,
    routing: Annotated[str, typer.Option(help="direct or mlnet (binary trees).")] = "direct",
    scenario: Annotated[str, typer.Option(help="Comma-separated: fair, priority, alone.")] = "fair,priority,alone",
    seed: Annotated[int, typer.Option(min=0, help="Draws the jobs' priorities (a permutation of J..1).")] = 0,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds any wait of a job may take.")]
        = 300.0,
) -> None:
    """MLNET's job priorities (root): J PS jobs at once on one emulated star, fair vs priority.

    Reports every job's completion time per scenario, the median and tail JCT of priority
    against fair sharing (paper: -25% / +2%) and the top job's iteration time against alone."""
    from mlfabric.bench.mlnet_priorities import PriorityBenchConfig, render_table, run_priority_bench
    from mlfabric.emu.cmd import EmuUnavailableError

    processes = jobs * (workers + 1)  # every job: its workers and a server
    check_processes(processes, "--jobs x --workers")
    model_bytes = size_option(model_size, "--model-size")
    check_buffers(model_bytes, processes, "--model-size")
    config = config_from(ctx, PriorityBenchConfig, model_bytes=model_bytes,
                         rate_bps=rate_option(rate, "--rate", emulated=True),
                         scenarios=tuple(split_list(scenario, "scenarios")), timeout_s=timeout)
    command = invocation(ctx)
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task("mlnet priorities", total=len(config.scenarios))
        result = run_or_exit(lambda: run_priority_bench(
            config, argv=command, capture_output=True,
            on_scenario=lambda name: progress.update(task, description=f"mlnet priorities: {name}", advance=1)),
            (RuntimeError, EmuUnavailableError))
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())
    if not all(j.correct for s in result.scenarios.values() for j in s.jobs):
        console.print("[bold red]error:[/] a pulled model differed from the exact BSP result")
        raise typer.Exit(1)


@bench_app.command("tictac")
def bench_tictac(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="inception, vgg, alexnet, par32 or seq32 (mlfabric.order.models).")]
    = "inception",
    workers: Annotated[int, typer.Option(min=1, help="Workers (one server besides them).")] = 4,
    ordering: Annotated[str, typer.Option(help="Comma-separated: none (one flat reply), random (per tensor, a fresh "
                                          "random order), tio, tao (TicTac's priorities).")] = "none,random,tio,tao",
    emulate: Annotated[bool, typer.Option("--emulate", help="Run on an emulated star (root): 1 + workers hosts, "
                                          "NICs at --rate.")] = False,
    rate: Annotated[str, typer.Option(help="NIC rate when emulated; also sizes the emulated device (S = 1).")]
    = "1gbit",
    forward_only: Annotated[bool, typer.Option("--forward-only", help="Forward passes only (inference); default: "
                                               "forward + backward + push.")] = False,
    width: Annotated[int, typer.Option(min=1, help="Channel multiplier of the model (parameters ~ width^2).")] = 1,
    batch: Annotated[Optional[int], typer.Option(min=1, help="Synthetic batch size of the real compute (default: 8 "
                                                  "for vgg and alexnet, 1 for the others: bench/tictac.py "
                                                  "DEFAULT_BATCH).")] = None,
    device: Annotated[str, typer.Option(help="emulated: each module's forward padded to its device time (S = 1); "
                                        "cpu: the real compute only.")] = "emulated",
    dag: Annotated[str, typer.Option(help="The DAG TIO/TAO are computed on: eager (the one PyTorch runs: ops in "
                                     "program order) or dataflow (the paper's TensorFlow executor).")] = "eager",
    pace: Annotated[str, typer.Option(help="Pace ordered answers at equal shares of the server's NIC: auto "
                                      "(emulated forward passes only), on, off.")] = "auto",
    iterations: Annotated[int, typer.Option(min=1, help="Iterations per ordering, warm-up included.")] = 50,
    warmup: Annotated[int, typer.Option(min=0, help="Leading iterations not counted.")] = 5,
    chrome: Annotated[Optional[Path], typer.Option(help="Write a Chrome/Perfetto trace per ordering (the last "
                                                   "iterations of every worker) into this directory.")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Model weights, inputs and random orders.")] = 0,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole run is killed.")]
        = 1800.0,
) -> None:
    """TicTac on the PS (§6): step time, E and stragglers per transfer ordering, enforced at the sender.

    Reports steps/s against none and random, p50/p95 step, median ordering efficiency E, the
    straggler effect (max wait / step) and the simulated makespan under the traced oracle."""
    from mlfabric.bench.procs import RankFailedError, RankTimeoutError
    from mlfabric.bench.tictac import TicTacBenchConfig, render_table, run_tictac_bench
    from mlfabric.emu.cmd import EmuUnavailableError

    check_processes(workers + 1, "--workers")
    orderings = tuple(split_list(ordering, "orderings"))
    config = config_from(ctx, TicTacBenchConfig, orderings=orderings,
                         rate_bps=rate_option(rate, "--rate", emulated=emulate),
                         chrome_dir=None if chrome is None else str(chrome), timeout_s=timeout)
    command = invocation(ctx, batch=config.batch)
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"tictac {model}", total=iterations * len(orderings))
        done: dict[str, int] = {}

        def on_progress(name: str, k: int) -> None:
            done[name] = k
            progress.update(task, description=f"tictac {model}: {name}", completed=sum(done.values()))

        result = run_or_exit(lambda: run_tictac_bench(config, argv=command, capture_output=True,
                                                      on_progress=on_progress),
                             (RankFailedError, RankTimeoutError, EmuUnavailableError))
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())
    if not all(r.correct for r in result.results):
        console.print("[bold red]error:[/] workers were handed different models in one BSP iteration")
        raise typer.Exit(1)


@bench_app.command("grad-order")
def bench_grad_order(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="inception, vgg, alexnet, par32 or seq32 (mlfabric.order.models).")]
    = "vgg",
    workers: Annotated[int, typer.Option(min=1, help="Data-parallel ranks (ring allreduce).")] = 4,
    ordering: Annotated[str, typer.Option(help="Comma-separated: ddp (first come first served, step after every "
                                          "update), fifo (same order, per-layer forward), bytescheduler (priority = "
                                          "declaration order), tio, tao (TicTac's priorities); the last three with "
                                          "the per-layer forward.")] = "ddp,fifo,bytescheduler,tio,tao",
    emulate: Annotated[bool, typer.Option("--emulate", help="Run on an emulated star (root): workers hosts, NICs "
                                          "at --rate.")] = False,
    rate: Annotated[str, typer.Option(help="NIC rate when emulated; also sizes the emulated device (S = 1).")]
    = "1gbit",
    width: Annotated[int, typer.Option(min=1, help="Channel multiplier of the model (parameters ~ width^2).")] = 1,
    batch: Annotated[int, typer.Option(min=1, help="Synthetic batch size of the real compute.")] = 1,
    device: Annotated[str, typer.Option(help="emulated: forward and backward padded to device times (S = 1); cpu: "
                                        "the real compute only.")] = "emulated",
    partition: Annotated[str, typer.Option(help="Partition size of the gradients (ByteScheduler's), e.g. 1MiB.")]
    = "512KiB",
    credit: Annotated[int, typer.Option(min=1, help="Partitions in flight at once.")] = 2,
    iterations: Annotated[int, typer.Option(min=1, help="Iterations per ordering, warm-up (and calibration) included.")]
    = 40,
    warmup: Annotated[int, typer.Option(min=0, help="Leading iterations not counted (>= 2: the first calibrate).")] = 5,
    rounds: Annotated[int, typer.Option(min=1, help="The orderings take turns, iterations / rounds at a time (a "
                                        "drift of the machine falls on all).")] = 1,
    seed: Annotated[int, typer.Option(min=0, help="Model weights and inputs.")] = 0,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole run is killed.")]
        = 1800.0,
) -> None:
    """TicTac's priorities on allreduce training (ByteScheduler-style): step time per gradient order.

    Reports steps/s against ddp, p50/p95 step and the host's wait for updates per ordering;
    fails if the orderings or the ranks end with different parameters."""
    from mlfabric.bench.grad_order import GradOrderBenchConfig, render_table, run_grad_order_bench
    from mlfabric.bench.procs import RankFailedError, RankTimeoutError
    from mlfabric.emu.cmd import EmuUnavailableError

    check_processes(workers, "--workers")
    config = config_from(ctx, GradOrderBenchConfig, orderings=tuple(split_list(ordering, "orderings")),
                         rate_bps=rate_option(rate, "--rate", emulated=emulate),
                         partition_bytes=size_option(partition, "--partition"), timeout_s=timeout)
    command = invocation(ctx)
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"grad-order {model}", total=iterations * len(config.orderings))
        done: dict[str, int] = {}

        def on_progress(name: str, k: int) -> None:
            done[name] = k
            progress.update(task, description=f"grad-order {model}: {name}", completed=sum(done.values()))

        result = run_or_exit(lambda: run_grad_order_bench(config, argv=command, capture_output=True,
                                                          on_progress=on_progress),
                             (RankFailedError, RankTimeoutError, EmuUnavailableError))
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result.to_dict())
    if not all(r.correct for r in result.results):
        console.print("[bold red]error:[/] the ranks or the orderings ended with different parameters")
        raise typer.Exit(1)


@bench_app.command("scheduler")
def bench_scheduler(
    ctx: typer.Context,
    updates: Annotated[str, typer.Option(help="Comma-separated batch sizes |U| (MLfabric §7.4).")] = "100,500,1000",
    repeats: Annotated[int, typer.Option(min=1, help="Batches per |U| for the fast scheduler (median reported).")] = 5,
    reference_repeats: Annotated[int, typer.Option(min=0, help="How many of them the reference also plans.")] = 1,
    aggregators: Annotated[int, typer.Option(min=0, help="Aggregators (hosts 1..k) for Alg. 3.")] = 2,
    mode: Annotated[str, typer.Option(help="async (MLfabric-A: Alg. 2 + 3) or sync (MLfabric-S).")] = "async",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the batches and NIC rates.")] = 0,
    trees: Annotated[bool, typer.Option("--trees/--no-trees", help="Also plan each batch with #36's pipelined "
                                        "trees (the same ordering), timed beside.")] = False,
) -> None:
    """MLfabric §7.4: ms per batch of the update scheduler vs its plain reference, same batches."""
    from mlfabric.ps.scheduler.bench import SchedulerBenchConfig, render_table, run_scheduler_bench

    sizes = tuple(_parse_or_usage(int, item) for item in split_list(updates, "batch sizes"))
    config = config_from(ctx, SchedulerBenchConfig, updates=sizes)
    command = invocation(ctx, updates=",".join(map(str, sizes)))
    with progress_bar(quiet=quiet) as progress:
        steps = len(sizes) * (repeats + min(reference_repeats, repeats))
        on_step = step_reporter(progress, progress.add_task("scheduler benchmark", total=steps))
        result = run_or_exit(lambda: run_scheduler_bench(config, argv=command, on_step=on_step), errors=())
    console.print(render_table(result))
    if json_path is not None:
        write_json(json_path, result)
    if any(r["identical"] is False for r in result["results"]):
        console.print("[bold red]error:[/] the fast scheduler's decisions differ from the reference's")
        raise typer.Exit(1)


# --------------------------------------------------------------------------- simulate


def _parse_or_usage(parse: Callable[[str], T], value: str) -> T:
    try:
        return parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _sim_topology(spec: str, link: str) -> Any:
    from mlfabric.topo import parse_topology

    rate = rate_option(link, "--link")
    try:
        return parse_topology(spec, rate)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


ProgressLinesOption = Annotated[bool, typer.Option("--progress", help="Print a status line (events, simulated "
                                                "time, rate) every 2 s on standard error, also into a pipe.")]


def _check_sim_limits(estimate: Callable[[], Any]) -> None:
    """Refuse, before building anything, a simulation that will not fit in memory (exit code 2;
    mlfabric.sim.limits sizes it from the arguments)."""
    from mlfabric.sim.limits import SimulationTooLarge, check_fits

    try:
        check_fits(estimate())
    except SimulationTooLarge as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _status_lines(progress: bool, what: str) -> Any:
    from mlfabric.progress import status_lines

    return status_lines(what) if progress else None


def _compute_model(compute: str, straggler: str, speed_range: Optional[str]) -> Any:
    from mlfabric.sim import ComputeModel, straggler_preset
    from mlfabric.units import parse_duration

    seconds = _parse_or_usage(parse_duration, compute)
    model = _parse_or_usage(straggler_preset, straggler)
    speeds = None
    if speed_range:
        parts = split_list(speed_range, "speeds (low,high)")
        if len(parts) != 2:
            raise typer.BadParameter(f"--speed-range takes low,high (e.g. 1,2), got {speed_range!r}")
        speeds = (_parse_or_usage(float, parts[0]), _parse_or_usage(float, parts[1]))
    if seconds == 0 and model is None and speeds is None:
        return None
    return make_config(ComputeModel, compute_s=seconds, straggler=model, speed_range=speeds)


def _sim_output(kind: str, result: Any, extra: dict[str, Any], *, json_path: Optional[Path],
                plot: Optional[Path], links: str, command: list[str], rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    from mlfabric.sim.report import plot_results, summary_rows

    label = extra.pop("label", kind)
    data = {"command": " ".join(command), "kind": kind, **extra, **result.to_dict(links=links)}
    data["time_s"] = extra.get("time_s", result.time_s)
    if plot is not None:
        plot_results([(label, result)], plot, title=f"{kind} {label} on {result.topology.spec}")
        data["plot"] = str(plot)
    table = Table(title=f"mlfabric simulate {kind}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for name, value in rows + summary_rows(result):
        table.add_row(name, value)
    console.print(table)
    if plot is not None:
        console.print(f"wrote {plot}")
    if json_path is not None:
        write_json(json_path, data)


def _run_sim(fn: Callable[[], T]) -> T:
    """Run a simulation; a stalled run or an invalid schedule is one error line and exit 1."""
    from mlfabric.schedule import ScheduleError
    from mlfabric.sim import SimulationStalled

    return run_or_exit(fn, (SimulationStalled, ScheduleError))


def _check_sim_output(plot: Optional[Path], routing: str, links: str) -> None:
    """The output and routing options every ``simulate`` command shares."""
    _check_plot(plot)
    _check_choice(routing, ("ecmp", "spray"), "--routing")
    _check_choice(links, ("nonzero", "all", "none"), "--links")


def _check_plot(plot: Optional[Path]) -> None:
    if plot is None:
        return
    from mlfabric.sim.report import require_matplotlib

    try:
        require_matplotlib()
    except RuntimeError as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None


TopologyOption = Annotated[str, typer.Option("--topology", help="Topology spec: star:n=16, fat-tree:k=16,oversub=4, "
                                                               "racks:r=4,h=8,oversub=4, bcube:n=4,k=2, edges:FILE.")]
LinkOption = Annotated[str, typer.Option("--link", help="Host link rate (bit/s): 10Gbps, 1e10, 25gbit.")]
RoutingOption = Annotated[str, typer.Option(help="ecmp (seeded per-flow hashing) or spray (per-packet, even split).")]
PlotOption = Annotated[Optional[Path], typer.Option("--plot", help="Draw link-load CDF and makespans here "
                                                                  "(needs matplotlib).")]
LinksOption = Annotated[str, typer.Option("--links", help="Per-link byte counts in the JSON: nonzero, all or none.")]
LatencyOption = Annotated[str, typer.Option(help="Latency added to every network message.")]
StragglerOption = Annotated[str, typer.Option(help="Straggler model: none, C1, C2, C3 or probability,slowdown.")]
SpeedRangeOption = Annotated[Optional[str], typer.Option("--speed-range", help="Relative speeds drawn uniformly "
                                                                              "from low,high (e.g. 1,2).")]


def _check_choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{option} must be one of {', '.join(choices)}, got {value!r}")
    return value


@simulate_app.command("collective")
def simulate_collective_cmd(
    ctx: typer.Context,
    topology: TopologyOption,
    link: LinkOption = "10Gbps",
    algorithm: Annotated[str, typer.Option(help="ring, halving_doubling, tree (allreduce), or a collective kind: "
                                                "broadcast, reduce, reduce_scatter, allgather, allreduce:<alg>.")]
        = "ring",
    size: Annotated[str, typer.Option(help="Buffer size in bytes (KB/MB = powers of 1000, KiB/MiB of 1024).")]
        = "100MB",
    itemsize: Annotated[int, typer.Option(min=1, help="Bytes per element (4 = float32).")] = 4,
    ranks: Annotated[Optional[int], typer.Option(min=2, help="Number of ranks (default: every host).")] = None,
    placement: Annotated[str, typer.Option(help="Rank -> host: sequential (rank r on host r) or random.")]
        = "sequential",
    ranks_per_host: Annotated[int, typer.Option("--ranks-per-host", min=1, help="Ranks on every host (ranks h*R.. on "
                                                "host h; host_hierarchical gets this layout).")] = 1,
    host_rate: Annotated[Optional[str], typer.Option("--host-rate", help="Rate of each host's internal link "
                                                     "(the shared-memory hop), e.g. 32Gbps; default: free.")] = None,
    routing: RoutingOption = "ecmp",
    seed: Annotated[int, typer.Option(min=0, help="Seed of ECMP, placement and compute draws.")] = 0,
    channel: Annotated[Optional[str], typer.Option(help="Channel of every message; on BCube channel 'l' = NIC l.")]
        = None,
    chunks: Annotated[Optional[int], typer.Option(min=1, help="Pipelining chunks per segment (builder default).")]
        = None,
    latency: LatencyOption = "0s",
    compute: Annotated[str, typer.Option(help="Compute time of each rank before the collective.")] = "0s",
    speed_range: SpeedRangeOption = None,
    straggler: StragglerOption = "none",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    progress_lines: ProgressLinesOption = False,
    plot: PlotOption = None,
    links: LinksOption = "nonzero",
) -> None:
    """Simulate one collective built by mlfabric.collectives (the runtime's schedules) on a topology."""
    from mlfabric.collectives.bcube import closed_form_gst
    from mlfabric.sim import EngineConfig, collective_kind, ring_closed_form_s, simulate_collective
    from mlfabric.units import format_size, parse_duration

    _check_sim_output(plot, routing, links)
    _check_choice(placement, ("sequential", "random"), "--placement")
    size_bytes = size_option(size, "--size", itemsize=itemsize)
    from mlfabric.sim.limits import estimate_collective, topology_size

    _check_sim_limits(lambda: estimate_collective(
        topology, collective_kind(algorithm), size_bytes=size_bytes, itemsize=itemsize, chunks=chunks,
        ranks=ranks if ranks_per_host <= 1 else topology_size(topology)[0] * ranks_per_host))
    topo = _sim_topology(topology, link)
    config = config_from(ctx, EngineConfig, latency_s=_parse_or_usage(parse_duration, latency))
    model = _compute_model(compute, straggler, speed_range)
    kind = collective_kind(algorithm)
    options: dict[str, Any] = {}
    if channel is not None:
        options["channel"] = channel
    if chunks is not None:
        options["chunks"] = chunks
    rank_placement: str | list[int] = placement
    if ranks_per_host > 1:
        from mlfabric.emu.launcher import rank_hosts

        hosts = _parse_or_usage(lambda n: rank_hosts(n, ranks_per_host), topo.n_hosts)
        rank_placement, ranks = hosts, len(hosts)
        if "host_hierarchical" in kind:
            options["hosts"] = tuple(hosts)
    if host_rate is not None:
        topo = topo.with_host_links(rate_option(host_rate, "--host-rate"))
    try:
        quiet = quiet or progress_lines  # --progress prints lines instead of the bar
        with progress_bar(quiet=quiet) as progress:
            task = progress.add_task(f"simulating {kind}: tasks done", total=None)
            result = _run_sim(lambda: simulate_collective(
                kind, topo, size_bytes=size_bytes, itemsize=itemsize, ranks=ranks, placement=rank_placement,
                compute=model, config=config, **options,
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
                on_status=_status_lines(progress_lines, f"simulate collective {kind}")))
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from None
    world = ranks or topo.n_hosts
    extra: dict[str, Any] = {"algorithm": kind, "ranks": world, "size_bytes": size_bytes, "itemsize": itemsize,
                             "label": kind}
    rows = [("collective", f"{kind} of {format_size(size_bytes)} on {world} ranks ({placement} placement)")]
    if kind.startswith("allreduce:"):
        closed = ring_closed_form_s(world, size_bytes, topo.link_rate_bps)
        label = "2(N-1)/N x T_F (BML §2)"
        if kind == "allreduce:bcube" and topo.spec.kind == "bcube" and world == topo.n_hosts:
            closed = closed_form_gst(topo.spec.int_param("n"), topo.spec.int_param("k"),
                                     size_bytes * 8.0 / topo.link_rate_bps)
            label = "2(N-1)/(kN) x T_F (BML §3.2)"
        if model is not None:
            # Ranks start when their compute ends: the collective cannot end before the
            # slowest rank's compute plus its own time.
            slowest = float(model.compute_times(1, world, seed)[0].max())
            extra["slowest_compute_s"] = slowest
            closed, label = closed + slowest, f"slowest compute + {label}"
        extra["closed_form_s"] = closed
        extra["time_vs_closed_form"] = result.time_s / closed if closed else None
        rows.append((label, f"{closed:.6g} s (simulated / closed form = {result.time_s / closed:.4f})" if closed else "0"))
    _sim_output("collective", result, extra, json_path=json_path, plot=plot, links=links,
                command=invocation(ctx), rows=rows)


@simulate_app.command("ps")
def simulate_ps_cmd(
    ctx: typer.Context,
    topology: TopologyOption,
    workers: Annotated[int, typer.Option(min=1, help="Workers (W).")],
    servers: Annotated[int, typer.Option(min=1, help="Parameter servers (S); the model is split evenly across them.")],
    link: LinkOption = "10Gbps",
    strategy: Annotated[str, typer.Option(help="baseline (direct), binary (trees of in-degree 2), rack (one "
                                               "aggregator per rack) or tree (with --degree).")] = "baseline",
    degree: Annotated[Optional[int], typer.Option(min=1, help="In-degree d of --strategy tree.")] = None,
    model_size: Annotated[str, typer.Option("--model-size", help="Model (= gradient) size in bytes.")] = "100MB",
    placement: Annotated[str, typer.Option(help="random (seeded, disjoint), sequential, colocated "
                                                "(worker i and server i on host i: the P2P PS), or launch "
                                                "(servers on hosts 0..S-1, then the workers: an emulated "
                                                "train launch's placement).")] = "random",
    routing: RoutingOption = "ecmp",
    seed: Annotated[int, typer.Option(min=0, help="Seed of placement, ECMP and compute draws.")] = 0,
    iterations: Annotated[int, typer.Option(min=1, help="Iterations to simulate.")] = 1,
    staleness: Annotated[int, typer.Option(min=0, help="SSP staleness bound s (0 = BSP).")] = 0,
    barrier: Annotated[str, typer.Option(help="server (a server pulls once its pushes arrived) or global "
                                              "(pull phase after the whole push phase).")] = "server",
    compute: Annotated[str, typer.Option(help="Compute time of one iteration at nominal speed.")] = "0s",
    speed_range: SpeedRangeOption = None,
    straggler: StragglerOption = "none",
    jobs: Annotated[int, typer.Option(min=1, help="Concurrent copies of the job, placed independently.")] = 1,
    priorities: Annotated[str, typer.Option(help="With --jobs: none (fair sharing) or random (distinct "
                                                 "strict priorities, MLNET §3).")] = "none",
    latency: LatencyOption = "0s",
    batch_rtol: Annotated[float, typer.Option("--batch-rtol", help="Flows finishing within this relative time "
                                                                   "of each other finish together (speed vs "
                                                                   "accuracy; default exact to ~1e-9).")] = 1e-9,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    progress_lines: ProgressLinesOption = False,
    plot: PlotOption = None,
    links: LinksOption = "nonzero",
) -> None:
    """Simulate parameter-server iterations: push then pull, BSP or SSP, direct or over MLNET trees."""
    import numpy as np

    from mlfabric.sim import EngineConfig, PSConfig, iteration_times, simulate_ps
    from mlfabric.units import format_size, parse_duration

    _check_sim_output(plot, routing, links)
    _check_choice(priorities, ("none", "random"), "--priorities")
    if jobs < 1:
        raise typer.BadParameter(f"--jobs must be >= 1, got {jobs}")
    from mlfabric.sim.limits import estimate_ps

    _check_sim_limits(lambda: estimate_ps(topology, workers=workers, servers=servers, iterations=iterations, jobs=jobs))
    topo = _sim_topology(topology, link)
    model_bytes = size_option(model_size, "--model-size", itemsize=None)
    config = config_from(ctx, EngineConfig, latency_s=_parse_or_usage(parse_duration, latency))
    ps = config_from(ctx, PSConfig, model_bytes=model_bytes, compute=_compute_model(compute, straggler, speed_range))
    prios = None
    if priorities == "random":
        prios = np.random.default_rng(np.random.SeedSequence([seed, 4])).permutation(jobs).tolist()
    try:
        quiet = quiet or progress_lines  # --progress prints lines instead of the bar
        with progress_bar(quiet=quiet) as progress:
            task = progress.add_task(f"simulating {strategy} PS: tasks done", total=None)
            result = _run_sim(lambda: simulate_ps(
                topo, ps=ps, config=config, jobs=jobs, priorities=prios,
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
                on_status=_status_lines(progress_lines, f"simulate ps {strategy}")))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    ends = iteration_times(result, iterations, workers) if jobs == 1 else None
    extra: dict[str, Any] = {
        "workers": workers, "servers": servers, "strategy": strategy, "degree": ps.tree_degree,
        "model_bytes": model_bytes, "placement": placement, "iterations": iterations, "staleness": staleness,
        "barrier": barrier, "jobs_count": jobs, "priorities": prios,
        "makespan_s": result.time_s, "time_s": result.time_s / iterations, "label": strategy,
    }
    if ends is not None:
        extra["iteration_end_s"] = ends.tolist()
    rows = [
        ("workload", (f"{jobs} jobs of " if jobs > 1 else "") + f"{workers} workers x {servers} servers, "
                     f"{format_size(model_bytes)} model, {strategy}"
                     + (f" (d={ps.tree_degree})" if ps.tree_degree else "")
                     + (f", SSP s={staleness}" if staleness else ", BSP") + f", {placement} placement"),
        ("time per iteration", f"{result.time_s / iterations:.6g} s (makespan {result.time_s:.6g} s over "
                               f"{iterations} iteration{'s' if iterations > 1 else ''})"),
    ]
    _sim_output("ps", result, extra, json_path=json_path, plot=plot, links=links,
                command=invocation(ctx), rows=rows)


def _parse_bcube_cases(text: str) -> list[tuple[int, int]]:
    """``"4x2,3x2"`` -> ``[(4, 2), (3, 2)]`` (BCube(n,k) as ``nxk``)."""
    cases = []
    for item in split_list(text, "BCube sizes nxk (e.g. 4x2,8x3)"):
        n, sep, k = item.lower().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise typer.BadParameter(f"expected BCube(n,k) as nxk (e.g. 4x2), got {item!r}")
        if int(n) < 2 or int(k) < 1:
            raise typer.BadParameter(f"BCube(n,k) needs n >= 2 and k >= 1, got {item!r}")
        cases.append((int(n), int(k)))
    return cases


@simulate_app.command("bml")
def simulate_bml_cmd(
    ctx: typer.Context,
    servers: Annotated[str, typer.Option(help="Fig. 5 panels: 16 (BCube(4,2), Fat-Tree(4)) and/or 1024 "
                                              "(BCube(32,2), Fat-Tree(16): ~4 min, ~16 GB peak for PS/Fat-Tree).")]
        = "16,1024",
    checks: Annotated[str, typer.Option(help="BCube(n,k) of the GST check (nxk, comma-separated): simulated BML "
                                             "GST within --rtol of 2(N-1)/(kN) x T_F.")] = "4x2,3x2,32x2,8x3",
    rtol: Annotated[float, typer.Option(help="Relative tolerance of the GST check.")] = 1e-3,
    link: LinkOption = "10Gbps",
    routing: Annotated[str, typer.Option(help="spray (per-packet, the non-blocking fluid model of the paper's "
                                              "theory) or ecmp (seeded per-flow hashing).")] = "spray",
    json_path: JsonOption = None,
    quiet: QuietOption = False,
) -> None:
    """BML Fig. 5: simulated GST (x T_F) of BML and PS on BCube, hierarchical and PS on Fat-Tree; GST checks."""
    from rich import box
    from rich.table import Table

    from mlfabric.sim.bml import BARS, FIG5_SETUPS, figure5, gst_checks
    from mlfabric.units import format_rate

    _check_choice(routing, ("ecmp", "spray"), "--routing")
    panels = []
    for item in split_list(servers, "server counts"):
        if not item.isdigit() or int(item) not in FIG5_SETUPS:
            raise typer.BadParameter(f"--servers takes {', '.join(map(str, FIG5_SETUPS))}, got {item!r}")
        panels.append(int(item))
    cases = _parse_bcube_cases(checks)
    if not 0 < rtol < 1:
        raise typer.BadParameter(f"--rtol must be > 0 and < 1 (a relative error of 1 or more passes anything), "
                                 f"got {rtol:g}")
    rate = rate_option(link, "--link")
    with progress_bar(quiet=quiet) as progress:
        on_step = step_reporter(progress, progress.add_task("BML Fig. 5", total=len(panels) * len(BARS) + len(cases)))
        rows = _run_sim(lambda: figure5(panels, rate=rate, routing=routing, on_bar=lambda count, label: on_step(
            f"Fig. 5, {count} servers: {label}")))
        results = _run_sim(lambda: gst_checks(cases, rtol=rtol, rate=rate, routing=routing, on_case=lambda n, k: on_step(
            f"GST check: BML on BCube({n},{k})")))
    table = Table(title=f"BML Fig. 5: GST in T_F (gradient x 8 / link rate), {format_rate(rate)}, {routing}",
                  caption="ratio = simulated / paper's theory", box=box.SIMPLE_HEAD)
    for name in ("N", "bar", "GST/T_F", "theory", "ratio", "flows", "wall s"):
        table.add_column(name, justify="left" if name == "bar" else "right", no_wrap=True)
    for row in rows:
        table.add_row(str(row["servers"]), row["name"],
                      f"{row['gst_tf']:.4f}", f"{row['theory_tf']:.4f}", f"{row['sim_vs_theory']:.4f}",
                      f"{row['flows']:,}", f"{row['wall_s']:.1f}")
    console.print(table)
    bounds = [f"{row['bound_tf']:.4f} ({row['servers']})" for row in rows if "bound_tf" in row]
    if bounds:
        console.print(f"PS/BCube theory is the paper's 2 x BML (§3.3); the uplink-load bound of its all-to-all, "
                      f"2(n-1)/n, is {', '.join(bounds)}.", highlight=False)
    check_table = Table(title=f"GST check: simulated BML within {rtol:g} of 2(N-1)/(kN) x T_F", box=box.SIMPLE_HEAD)
    for name in ("BCube(n,k)", "N", "simulated", "2(N-1)/(kN)", "rel. error", "ok", "wall s"):
        check_table.add_column(name, justify="left" if name == "BCube(n,k)" else "right")
    for check in results:
        check_table.add_row(f"BCube({check.n},{check.k})", str(check.n**check.k), f"{check.simulated_tf:.6f}",
                            f"{check.closed_form_tf:.6f}", f"{check.rel_error:.1e}",
                            "[green]yes[/]" if check.ok else "[bold red]NO[/]", f"{check.wall_s:.1f}")
    console.print(check_table)
    ok = all(check.ok for check in results)
    if json_path is not None:
        command = invocation(ctx, servers=",".join(map(str, panels)), checks=",".join(f"{n}x{k}" for n, k in cases))
        write_json(json_path, {"command": " ".join(command), "link_rate_bps": rate, "routing": routing,
                               "figure5": rows, "gst_checks": [check.to_dict() for check in results], "ok": ok})
    if not ok:
        console.print("[bold red]error:[/] a GST check failed", markup=True, highlight=False)
        raise typer.Exit(1)


def _fmt_change(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:+.1%}"


@simulate_app.command("mlfabric")
def simulate_mlfabric_cmd(
    ctx: typer.Context,
    workers: Annotated[int, typer.Option(min=1, help="Workers (the server on its own host).")] = 30,
    workers_per_host: WorkersPerHostOption = 1,
    trees: TreesOption = True,
    chunk_size: Annotated[str, typer.Option("--chunk-size", help="The trees' cut-through chunk.")] = "1MiB",
    update_size: Annotated[str, typer.Option("--update-size", help="Update (= model) size.")] = "100MB",
    rate: Annotated[str, typer.Option(help="Every NIC's rate before churn.")] = "10gbit",
    compute: Annotated[str, typer.Option(help="A worker's compute per update at nominal speed.")] = "100ms",
    compute_jitter: Annotated[float, typer.Option(
        "--compute-jitter", min=0.0, max=0.99,
        help="A step's compute varies uniformly by up to this fraction either way (keeps identical async "
             "workers from staying in phase in the fluid model; 0: off).")] = 0.1,
    control_latency: Annotated[str, typer.Option(
        "--control-latency", help="MLfabric modes: one-way time of each control message (request, decision); "
                                  "0: free, as the paper's model.")] = "0s",
    inject: Annotated[str, typer.Option(help="Compute settings, comma-separated: C1, C2, C3 (MLfabric §7), "
                                             "none.")] = "C1,C2,C3",
    # Not the config's one `churn`: the grid's settings (config_from takes options named like fields).
    churn_grid: Annotated[str, typer.Option("--churn", help="Network settings, comma-separated: N1, N2, N3, "
                                                              "none.")] = "N1,N2,N3",
    churn_period: Annotated[str, typer.Option("--churn-period", help="Seconds between NIC rate redraws.")] = "5s",
    sync: Annotated[str, typer.Option(help="Modes: allreduce (RR-Sync), tree-allreduce (Tr-Sync), ps-async, "
                                           "mlfabric-a:TAU, mlfabric-s, mlfabric-allreduce (§6, on a worker root).")] =
        "allreduce,tree-allreduce,ps-async,mlfabric-a:30,mlfabric-s",
    updates: Annotated[int, typer.Option(min=1, help="Worker updates every mode must apply (the work to the "
                                              "target).")] = 3000,
    updates_needed: Annotated[Optional[str], typer.Option(
        "--updates-needed", help="Per mode, overriding --updates: MODE=N,... (e.g. what an emulated run needed "
                                 "to reach its target).")] = None,
    aggregators: Annotated[int, typer.Option(min=0, help="k: aggregators (worker hosts) per server.")] = 2,
    distributors: Annotated[int, typer.Option(min=0, help="k°: distributors per batch of pulls.")] = 2,
    interval: Annotated[str, typer.Option(help="The scheduler's batching period.")] = "100ms",
    lag: Annotated[str, typer.Option(help="The network monitor's lag (t_lag).")] = "200ms",
    pull_after: Annotated[str, typer.Option("--pull-after", help="MLfabric-A: a pull is answered once the "
                                                                  "worker's update is applied (applied, as the "
                                                                  "runtime) or at once (request).")] = "applied",
    seed: Annotated[int, typer.Option(min=0, help="Seed of compute and churn draws.")] = 0,
    emulated: Annotated[Optional[list[Path]], typer.Option(
        help="Instead of the grid: the cells of these emulated train JSONs (train --emulate --churn N --target "
             "T), each mode timed to the updates it needed there; emulated vs simulated speedups. Repeatable; "
             "give --update-size of that run (each mode computes as its run measured; --compute and "
             "--compute-jitter for runs that did not record it).")] = None,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
) -> None:
    """MLfabric §7, Table 2 from the simulator: each mode's time to apply the same worker
    updates under compute (C1-C3) and network (N1-N3) settings, as speedup over RR-Sync. The
    MLfabric modes run the runtime's scheduler and model distribution (mlfabric.sim.mlfabric)."""
    from rich import box
    from rich.table import Table

    from mlfabric.sim.mlfabric import PAPER_TABLE2, MLfabricSimConfig, simulate_table2, table2
    from mlfabric.units import parse_duration

    _check_choice(pull_after, ("applied", "request"), "--pull-after")
    needed: dict[str, int] = {}
    for item in split_list(updates_needed, "MODE=N") if updates_needed else []:
        mode, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit():
            raise typer.BadParameter(f"--updates-needed: expected MODE=N, got {item!r}")
        needed[mode.strip()] = int(count)
    modes = split_list(sync, "modes")
    config = config_from(ctx, MLfabricSimConfig,
                         update_bytes=float(size_option(update_size, "--update-size", itemsize=None)),
                         chunk_bytes=int(size_option(chunk_size, "--chunk-size", itemsize=None)),
                         rate_bps=rate_option(rate, "--rate"), compute_s=_parse_or_usage(parse_duration, compute),
                         control_latency_s=_parse_or_usage(parse_duration, control_latency),
                         churn_period_s=_parse_or_usage(parse_duration, churn_period), updates_needed=needed,
                         interval_s=_parse_or_usage(parse_duration, interval),
                         monitor_lag_s=_parse_or_usage(parse_duration, lag))
    if emulated:
        _compare_emulated(config, emulated, json_path)
        return
    injects = split_list(inject, "compute settings")
    churns = [None if c.lower() == "none" else c for c in split_list(churn_grid, "network settings")]
    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"MLfabric Table 2: {len(injects) * len(churns)} cells x {len(modes)} modes",
                                 total=len(injects) * len(churns))
        try:
            rows = _run_sim(lambda: simulate_table2(config, modes, injects, churns,
                                                    on_cell=lambda done, total: progress.update(task, completed=done)))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    names = [c or "none" for c in churns]
    for mode in [m for m in modes if m != "allreduce"]:
        grid = table2(rows, mode)
        ceiling_key = "ceiling_trees" if config.trees else "ceiling_one_level"
        ceilings = {(r["inject"], r["churn"]): r.get(ceiling_key) for r in rows if r["mode"] == mode}
        design = ("with trees and multicast (the batch wait, an update's and a model's transfer in every cycle)"
                  if config.trees else "with one level of aggregation and distribution and this --pull-after")
        table = Table(title=f"{mode} vs RR-Sync", title_justify="left", box=box.SIMPLE_HEAD,
                      caption="speedup in time to the same applied updates (simulated)"
                              + (f"; after <=: the most any scheduler could reach {design} "
                                 "(docs/mlfabric_scheduler.md, Table 2); in brackets: the paper's MLfabric-A-30"
                                 if mode.startswith("mlfabric-a:") else ""),
                      caption_justify="left")
        table.add_column("compute")
        for name in names:
            table.add_column(name, justify="right")
        for inj in injects:
            cells = []
            for name in names:
                value = grid.get(inj, {}).get(name)
                paper = PAPER_TABLE2.get(inj, {}).get(name) if mode.startswith("mlfabric-a:") else None
                ceiling = ceilings.get((inj, name))
                cells.append(("-" if value is None else f"{value:.2f}") + (f" <={ceiling:.2f}" if ceiling else "")
                             + (f" [{paper:.2f}]" if paper else ""))
            table.add_row(inj, *cells)
        console.print(table)
    _print_cycle_parts(rows)
    if json_path is not None:
        import dataclasses
        import shlex

        write_json(json_path, {"benchmark": "simulate-mlfabric", "command": shlex.join(invocation(ctx)),
                               "config": dataclasses.asdict(config), "runs": rows,
                               "table2": {m: table2(rows, m) for m in modes}, "paper_table2": PAPER_TABLE2})


def _print_cycle_parts(rows: list[dict[str, Any]]) -> None:
    """simulate mlfabric: where the PS modes' time went, per cell (check 2 of #36)."""
    from rich import box
    from rich.table import Table

    table = Table(title="where the PS modes' time went", title_justify="left", box=box.SIMPLE_HEAD,
                  caption="upd/xfer: worker updates per update transfer into the server; busy: the server NIC's "
                          "busy share (in/out); waits: a worker's mean wait for its batch, its update applied, "
                          "its model (seconds); dropped: worker updates dropped by the delay bound",
                  caption_justify="left")
    for name in ("compute", "network", "mode", "upd/xfer", "busy in/out", "batch", "commit", "model", "dropped",
                 "max delay"):
        table.add_column(name, justify="left" if name in ("compute", "network", "mode") else "right")
    for r in rows:
        if "server_busy" not in r:
            continue
        table.add_row(r["inject"], r["churn"], r["mode"], f"{r.get('updates_per_server_transfer', 1.0):.2f}",
                      f"{r['server_busy_in']:.2f}/{r['server_busy_out']:.2f}",
                      *(f"{r[k]:.3f}" if k in r else "-" for k in ("batch_wait_s", "commit_wait_s", "model_wait_s")),
                      str(r["dropped"]), str(r["max_delay"]))
    console.print(table)


def _compare_emulated(config: Any, paths: list[Path], json_path: Optional[Path]) -> None:
    """simulate mlfabric --emulated: simulated vs emulated speedups over RR-Sync, per cell."""
    from rich import box
    from rich.table import Table

    from mlfabric.sim.mlfabric import across_launches, compare_with_emulation

    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"--emulated {path}: {exc}") from None
        if not (data.get("metadata", {}).get("emulation") and data.get("comparisons")):
            raise typer.BadParameter(f"--emulated {path}: not the JSON of an emulated `mlfabric train` run")
        rows += compare_with_emulation(config, data, base_dir=Path(path).parent)
    table = Table(title="emulated vs simulated speedup over RR-Sync", title_justify="left", box=box.SIMPLE_HEAD,
                  caption="each mode timed to the worker updates its emulated run needed to reach the target",
                  caption_justify="left")
    for name in ("compute", "network", "mode", "updates", "emulated", "simulated", "sim/emu"):
        table.add_column(name, justify="left" if name in ("compute", "network", "mode") else "right")
    for r in rows:
        if r["mode"] == "allreduce":
            continue
        table.add_row(r["inject"], r["churn"], r["mode"], str(r["updates"]),
                      "-" if r["emulated_speedup"] is None else f"{r['emulated_speedup']:.2f}",
                      f"{r['simulated_speedup']:.2f}", "-" if r["sim_over_emu"] is None else f"{r['sim_over_emu']:.3f}")
    console.print(table)
    cells = across_launches(rows)
    if len(paths) > 1:
        table = Table(title=f"over the {len(paths)} launches: median speedups", title_justify="left",
                      box=box.SIMPLE_HEAD)
        for name in ("compute", "network", "mode", "reached", "emulated", "simulated", "sim/emu"):
            table.add_column(name, justify="left" if name in ("compute", "network", "mode") else "right")
        for c in cells:
            table.add_row(c["inject"], c["churn"], c["mode"], f"{c['reached']} of {c['launches']}",
                          "-" if c["emulated_speedup"] is None else f"{c['emulated_speedup']:.2f}",
                          "-" if c["simulated_speedup"] is None else f"{c['simulated_speedup']:.2f}",
                          "-" if c["sim_over_emu"] is None else
                          f"{c['sim_over_emu']:.3f}{'' if c['within'] else ' (outside 15%)'}")
        console.print(table)
    compared = [c for c in cells if c["sim_over_emu"] is not None]
    console.print(f"within 15%: {sum(c['within'] for c in compared)} of {len(compared)} cells"
                  + (" (medians over the launches)" if len(paths) > 1 else ""))
    if json_path is not None:
        import dataclasses

        write_json(json_path, {"benchmark": "simulate-mlfabric-vs-emulated", "config": dataclasses.asdict(config),
                               "emulated_runs": [str(p) for p in paths], "rows": rows, "cells": cells})


@simulate_app.command("mlnet")
def simulate_mlnet_cmd(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option("--quick", help="Scaled down ~8x: k=8 fat-tree, 100 workers; 20 jobs of "
                                                        "25 x 6 (~1 min; the paper's figures do not apply).")]
        = False,
    servers: Annotated[Optional[str], typer.Option(help="Parameter-server counts of the sweep (default "
                                                        "50,100,200,300,400; with --quick 6,12,25,38,50).")] = None,
    oversub: Annotated[str, typer.Option(help="ToR-uplink oversubscription ratios: 1 (full bisection), 4 (1:4).")]
        = "1,4",
    seeds: Annotated[str, typer.Option(help="Seeds of placement, ECMP and priorities (ratios are averaged).")] = "0",
    strategies: Annotated[str, typer.Option(help="Sweep strategies: baseline (required), binary, rack.")]
        = "baseline,binary,rack",
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep", help="Run the strategy sweep (Fig. 1).")] = True,
    jobs_experiment: Annotated[bool, typer.Option("--jobs-experiment/--no-jobs-experiment", help="Run 20 concurrent "
                                                  "jobs, fair vs random priorities (Fig. 3).")] = True,
    update_size: Annotated[str, typer.Option("--update-size", help="Bytes each worker pushes (and pulls) per "
                                                                   "iteration (default: 65e9 float32 = 260GB).")]
        = "260GB",
    compute: Annotated[str, typer.Option(help="Compute before each push (MLNET: every 30 s).")] = "30s",
    batch_rtol: Annotated[float, typer.Option("--batch-rtol", help="Flows finishing within this relative time "
                                                                   "finish together (1e-3: < 0.5% on makespans, "
                                                                   "5-25x faster than the exact 1e-9).")] = 1e-3,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
) -> None:
    """MLNET §4: BINARY/RACK makespan vs BASELINE on the 1,024-host fat-tree, and flow priorities across 20 jobs."""
    import dataclasses

    from rich import box
    from rich.table import Table

    from mlfabric.sim.mlnet import JobsConfig, SweepConfig, quick_configs, run_mlnet
    from mlfabric.units import format_size, parse_duration

    if not sweep and not jobs_experiment:
        raise typer.BadParameter("nothing to run: give --sweep or --jobs-experiment")
    sweep_base, jobs_base = quick_configs() if quick else (SweepConfig(), JobsConfig())
    server_list = (tuple(_parse_or_usage(int, s) for s in split_list(servers, "server counts"))
                   if servers is not None else sweep_base.servers)
    oversub_list = tuple(_parse_or_usage(float, o) for o in split_list(oversub, "oversubscription ratios"))
    seed_list = tuple(_parse_or_usage(int, s) for s in split_list(seeds, "seeds"))
    common = {"update_bytes": float(size_option(update_size, "--update-size", itemsize=None)),
              "compute_s": _parse_or_usage(parse_duration, compute), "seeds": seed_list, "batch_rtol": batch_rtol}
    sweep_config = make_config(lambda **kw: dataclasses.replace(sweep_base, **kw), servers=server_list, oversub=oversub_list,
                               strategies=tuple(split_list(strategies, "strategies")), **common)
    jobs_config = make_config(lambda **kw: dataclasses.replace(jobs_base, **kw), **common)
    command = invocation(ctx, servers=",".join(map(str, server_list)), oversub=oversub.replace(" ", ""),
                         seeds=",".join(map(str, seed_list)), strategies=",".join(sweep_config.strategies))
    runs = ((len(sweep_config.oversub) * len(sweep_config.servers) * len(sweep_config.seeds)
             * len(sweep_config.strategies) if sweep else 0)
            + (len(jobs_config.seeds) * len(jobs_config.strategies) * 2 if jobs_experiment else 0))  # fair, priorities
    with progress_bar(quiet=quiet) as progress:
        on_run = step_reporter(progress, progress.add_task("MLNET", total=runs))
        result = _run_sim(lambda: run_mlnet(sweep_config if sweep else None, jobs_config if jobs_experiment else None,
                                            argv=command, on_run=on_run))
    paper_note = " (--quick: scaled down, the paper's column is for the full setup)" if quick else ""
    if result["sweep"] is not None:
        cfg = sweep_config
        rows = {(row["oversub"], row["servers"], row["strategy"]): row for row in result["sweep"]["summary"]}
        others = [s for s in cfg.strategies if s != "baseline"]
        for ratio in cfg.oversub:
            table = Table(title=f"MLNET Fig. 1{'a' if ratio == 1 else 'b'}: makespan / BASELINE's, 1:{ratio:g}, "
                                f"{cfg.workers} workers on fat-tree:k={cfg.k}, {format_size(cfg.update_bytes)} update, "
                                f"{cfg.compute_s:g} s compute",
                          caption="comm: the same without the compute phase (independent of the update size)"
                                  + paper_note, box=box.SIMPLE_HEAD)
            table.add_column("servers", justify="right")
            table.add_column("BASELINE s", justify="right")
            for name in others:
                for column in (name.upper(), "comm", "paper"):
                    table.add_column(column, justify="right", no_wrap=True)
            for count in cfg.servers:
                cells = [str(count), f"{rows[(ratio, count, 'baseline')]['makespan_s']:.1f}"]
                for name in others:
                    row = rows[(ratio, count, name)]
                    spread = (f" ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})" if len(row["seeds"]) > 1 else "")
                    cells += [f"{row['ratio']:.3f}{spread}", f"{row['comm_ratio']:.3f}", row["paper"]]
                table.add_row(*cells)
            console.print(table)
    if result["jobs"] is not None:
        cfg_j = jobs_config
        stats = Table(title=f"MLNET Fig. 3: makespans of {cfg_j.jobs} concurrent jobs of {cfg_j.workers} x "
                            f"{cfg_j.servers} on fat-tree:k={cfg_j.k} (oversub 1:{cfg_j.oversub:g})",
                      box=box.SIMPLE_HEAD)
        for name in ("condition", "median s", "p95 s", "max s", "mean s"):
            stats.add_column(name, justify="left" if name == "condition" else "right")
        for key, row in result["jobs"]["summary"]["conditions"].items():
            stats.add_row(key, f"{row['median_s']:.1f}", f"{row['p95_s']:.1f}", f"{row['max_s']:.1f}",
                          f"{row['mean_s']:.1f}")
        console.print(stats)
        changes = Table(title="Relative changes (negative = shorter)" + paper_note, box=box.SIMPLE_HEAD)
        for name in ("comparison", "ours", "paper"):
            changes.add_column(name, justify="left" if name == "comparison" else "right")
        for change in result["jobs"]["summary"]["changes"]:
            changes.add_row(change["what"], _fmt_change(change["ours"]), _fmt_change(change["paper"]))
        console.print(changes)
    console.print(f"wall time {result['wall_s']:.1f} s", highlight=False)
    if json_path is not None:
        write_json(json_path, result)


# --------------------------------------------------------------------------- train


@app.command("train")
def train(
    ctx: typer.Context,
    workload: Annotated[str, typer.Option(help="hyperplane (eager-SGD §6.2.1), lstm (§6.3), lenet5 (BML's LeNet-5 "
                                               "on synthetic MNIST-shaped images), mlp (an MLP on a "
                                               "random-teacher classification) or lda (distributed LDA by "
                                               "collapsed Gibbs sampling, MLfabric §7).")] = "hyperplane",
    workers: Annotated[int, typer.Option(min=1, help="Number of local ranks (processes).")] = 8,
    sync: Annotated[Optional[str], typer.Option(help="Comma-separated modes: allreduce (synchronous SGD over --algorithm; "
                                           "ring: MLfabric's RR-Sync), tree-allreduce (Tr-Sync), eager-solo, "
                                           "eager-majority; parameter server: ps-bsp, ps-ssp:S (staleness S), "
                                           "ps-async (vanilla Async), mlfabric-a:TAU (MLfabric-A, delay bound TAU), "
                                           "mlfabric-s (MLfabric-S), mlnet-binary, mlnet-rack, mlnet-tree:D "
                                           "(MLNET's trees; +ssp:S for SSP in the tree, e.g. mlnet-rack+ssp:2). "
                                           "Default: allreduce,eager-solo; lda: "
                                           "allreduce,ps-async,mlfabric-a:8.")] = None,
    servers: Annotated[int, typer.Option(min=1, help="PS modes: server processes (beside --workers workers).")] = 1,
    workers_per_host: WorkersPerHostOption = 1,
    trees: TreesOption = False,
    replicas: Annotated[int, typer.Option(min=0, help="PS modes: replica processes (replica i mirrors server i % "
                                               "servers).")] = 0,
    replication: Annotated[Optional[str], typer.Option(
        help="How replicas get the updates: chain (the server forwards each one; every PS mode) or network "
             "(mlfabric-a modes only: MLfabric §5.3, the workers send copies as the scheduler plans, within "
             "--div-max). Default: network with --div-max, else chain.")] = None,
    div_max: Annotated[Optional[str], typer.Option(
        "--div-max", help="Div_max of network replication (implies --replication network; mlfabric-a modes only): "
                          "the replica's largest divergence from its server at a batch end, a norm (0.5) or a "
                          "number of updates (30u).")] = None,
    measure_divergence: Annotated[bool, typer.Option(
        "--measure-divergence/--no-measure-divergence",
        help="mlfabric-a with --replicas: each server sends its model to its replicas at every batch end so that "
             "they measure max_divergence (costs a model per batch on the server's NIC: off for overhead "
             "measurements).")] = True,
    delay_bound: Annotated[Optional[int], typer.Option(
        "--delay-bound", min=0, help="ps-async: drop updates whose delay would exceed TAU (MLfabric's "
                                     "tau_max).")] = None,
    checkpoint_every: Annotated[int, typer.Option(
        "--checkpoint-every", min=0, help="PS modes: each server checkpoints its shard to a local file every N "
                                          "versions (0: never; the baseline of MLfabric's replication).")] = 0,
    fail: Annotated[Optional[str], typer.Option(
        "--fail", help="server:AT: SIGKILL server 0's process AT seconds into the (one) PS run; its replica takes "
                       "over (needs --replicas; reports failover_s, lost_divergence, lost_updates). With --elastic, "
                       "or with one of ps-bsp, ps-ssp:S, ps-async: worker:RANK@SECONDS[,...] SIGKILLs those workers "
                       "(RANK: 0..workers-1); with --elastic, churn:NxK a random one every N steps, K times.")] = None,
    elastic: Annotated[bool, typer.Option(
        "--elastic", help="--sync allreduce that survives lost workers: the survivors agree on a new membership and "
                          "go on; reports recovery_s, rejoin_s, steps_lost, members, parameters_equal "
                          "(mlfabric/train/elastic.py).")] = False,
    rejoin: Annotated[Optional[str], typer.Option(
        "--rejoin", metavar="AFTER_S", help="With --fail worker:... (--elastic, or a ps-bsp, ps-ssp:S or ps-async "
                                            "run): restart each killed worker AFTER_S seconds after its kill; it "
                                            "joins the running job (elastic: receives its state; PS: pulls the "
                                            "servers' model) and trains to the end.")] = None,
    inject: Annotated[Optional[list[str]], typer.Option(
        help="Delay injection, repeatable (each runs every mode): one-random:300ms (one random worker per step), "
             "random:300ms,2, skew:50ms,50ms,rotate, C1|C2|C3 (MLfabric's compute stragglers), none.")] = None,
    epochs: Annotated[Optional[int], typer.Option(min=1, help="Epochs (default: 48 hyperplane, 16 lstm, 4 lenet5, "
                                                       "8 mlp, 40 lda).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", min=1, help="Per worker (default: 256 "
                                                                         "hyperplane, 16 lstm, 32 lenet5, 64 mlp; "
                                                                         "lda: the worker's documents).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="SGD learning rate (default: 0.05 hyperplane, 0.1 lstm, "
                                                     "0.02 lenet5, 0.1 mlp; lda: 1, fixed).")] = None,
    momentum: Annotated[Optional[float], typer.Option(help="SGD momentum (default: 0 hyperplane and lda, 0.9 the "
                                                           "others).")] = None,
    sync_every_epochs: Annotated[Optional[int], typer.Option(
        "--sync-every-epochs", min=0, help="eager-SGD model average every N epochs (0: only at the end; default: 2 "
                                    "hyperplane, lenet5 and mlp, 10 lstm).")] = None,
    algorithm: Annotated[str, typer.Option(help="Reduction schedule: ring, halving_doubling, tree or ps.")] = "ring",
    dim: Annotated[int, typer.Option(min=1, help="hyperplane: input dimension.")] = 8192,
    train_samples: Annotated[Optional[int], typer.Option("--train-samples", min=1, help="Training set size (default: "
                                                                                "32768 hyperplane, 4096 lstm, 4096 "
                                                                                "lenet5, 32768 mlp).")] = None,
    frame_time: Annotated[str, typer.Option("--frame-time", help="lstm: emulated accelerator time per padded time "
                                                                 "step (sleep), e.g. 2ms; 0: CPU compute only.")] = "0",
    compute_time: Annotated[str, typer.Option("--compute-time", help="hyperplane, lenet5, mlp: emulated accelerator "
                                                                     "time per step (sleep after the CPU's), e.g. "
                                                                     "60ms.")] = "0",
    image_size: Annotated[Optional[int], typer.Option("--image-size", min=1, help="lenet5: image side (default 28; 16 "
                                                                           "makes a 1.1M-parameter model).")] = None,
    hidden: Annotated[Optional[int], typer.Option(min=1, help="mlp: the student's hidden width (default 256: 143k "
                                                       "parameters; 1024: 2.1M).")] = None,
    topics: Annotated[Optional[int], typer.Option(min=1, help="lda: topics K (default 20).")] = None,
    vocabulary: Annotated[Optional[int], typer.Option(min=1, help="lda: vocabulary size V (default 4000).")] = None,
    documents: Annotated[Optional[int], typer.Option(min=1, help="lda: training documents, sharded over the workers "
                                                          "(default 4096).")] = None,
    held_out: Annotated[Optional[int], typer.Option("--held-out", min=1, help="lda: held-out documents of the metric "
                                                                       "(default 256).")] = None,
    doc_length: Annotated[Optional[float], typer.Option("--doc-length", help="lda: mean tokens per document "
                                                                             "(Poisson; default 100).")] = None,
    alpha: Annotated[Optional[float], typer.Option(help="lda: document-topic Dirichlet prior (default 0.1).")] = None,
    beta: Annotated[Optional[float], typer.Option(help="lda: topic-word Dirichlet prior (default 0.05).")] = None,
    target: Annotated[Optional[float], typer.Option(help="Time every run to this validation metric (MLfabric Table 2: "
                                                         "time to a target accuracy); default: near allreduce's "
                                                         "final one.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Directory for curves.csv, curves.png and tensorboard/ "
                                                     "(default: runs/<workload>).")] = None,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw curves.png (needs matplotlib).")] = True,
    transport: Annotated[str, typer.Option(help="mlfabric transport: tcp (default), zmq or torch.")] = "tcp",
    timeout: Annotated[float, typer.Option(callback=timeout_seconds, help="Seconds before the whole launch is killed.")]
        = 3600.0,
    seed: Annotated[int, typer.Option(min=0, help="Seed of data, models, batches, injections and churn.")] = 0,
    emulate: Annotated[bool, typer.Option("--emulate", help="Root: run every rank of a launch on its own host of an "
                                                            "emulated star (star:n=<ranks of the launch>).")] = False,
    rate: Annotated[Optional[str], typer.Option(help="With --emulate: every NIC's rate, e.g. 1gbit, 100mbit "
                                                     "(default 1gbit).")] = None,
    churn: Annotated[Optional[str], typer.Option(help="With --emulate: bandwidth churn N1, N2, N3 (MLfabric §7) or "
                                                      "RATE:PROB,... relative to --rate.")] = None,
    churn_period: Annotated[Optional[str], typer.Option("--churn-period", help="With --churn: seconds between "
                                                                              "redraws, e.g. 5s (default).")] = None,
    topology: Annotated[Optional[str], typer.Option(help="With --emulate: the parameter-server launch's topology "
                                                         "instead of the star, e.g. racks:r=2,h=5,oversub=4 (one "
                                                         "host per rank, servers first; MLNET's rack trees use its "
                                                         "racks).")] = None,
) -> None:
    """eager-SGD and the parameter server vs synchronous SGD on local ranks (or, with --emulate,
    on an emulated network): throughput and validation metric vs wall time.

    All (injection, mode) runs share one launch and run one after the other; the table shows
    each eager mode's throughput and final metric relative to allreduce under the same injection."""
    from mlfabric.train.ps_rejoin import kills_ps_workers

    # A PS mode with --fail worker:... / --rejoin / --elastic: its workers killed and taken back
    # (mlfabric/train/ps_rejoin.py), with the config built below as for any PS run.
    ps_kills = kills_ps_workers(sync, fail, rejoin, elastic)
    if (elastic or rejoin is not None) and not ps_kills:
        from mlfabric.train.elastic import run_from_cli

        return run_from_cli(workload=workload, workers=workers, sync=sync, fail=fail, rejoin=rejoin,
                            algorithm=algorithm, dim=dim, train_samples=train_samples, epochs=epochs,
                            batch_size=batch_size, lr=lr,
                            momentum=momentum, compute_time=compute_time, seed=seed, timeout=timeout, emulate=emulate,
                            transport=transport, json_path=json_path, elastic=elastic, rate=rate)
    import dataclasses

    from mlfabric.train.ps_modes import is_ps_mode
    from mlfabric.train.harness import (EMULATE_NEEDS_ROOT, EagerTrainConfig, TrainEmulation, render_ps_table,
                                      render_table, run_eager_training, write_outputs)
    from mlfabric.train.lda import LdaSpec
    from mlfabric.train.workloads import HyperplaneSpec, LeNet5Spec, LstmSpec, MlpSpec
    from mlfabric.units import parse_duration

    if sync is None:
        sync = "allreduce,ps-async,mlfabric-a:8" if workload == "lda" else "allreduce,eager-solo"
    lda_options = {"topics": topics, "vocabulary": vocabulary, "documents": documents, "held_out": held_out,
                   "doc_length": doc_length, "alpha": alpha, "beta": beta}
    lda_given = {name: value for name, value in lda_options.items() if value is not None}
    if lda_given and workload != "lda":
        raise typer.BadParameter(f"--{next(iter(lda_given)).replace('_', '-')} applies to the lda workload, "
                                 f"not {workload}")
    if train_samples and workload == "lda":
        raise typer.BadParameter("lda counts documents: use --documents, not --train-samples")
    lda = make_config(LdaSpec, **lda_given)
    if replication is None:
        # The bound only means something to network replication (#39 item 9: it was refused
        # without --replication network although it implies it).
        replication = "network" if div_max is not None else "chain"
        if div_max is not None:
            console.print(f"note: --div-max {div_max} implies --replication network (MLfabric §5.3; the "
                          f"mlfabric-a:TAU modes support it, the other PS modes replicate by chain)", highlight=False)
    injects = tuple(inject) if inject else ("none",)
    modes = tuple(split_list(sync, "sync modes"))
    check_processes(workers + (servers + replicas if any(is_ps_mode(mode) for mode in modes) else 0),
                    "--workers + --servers + --replicas")
    samples = {"train_samples": train_samples} if train_samples else {}
    compute_s = _parse_or_usage(parse_duration, compute_time)
    hyper = make_config(HyperplaneSpec, dim=dim, **(samples if workload == "hyperplane" else {}),
                        **({"compute_time_s": compute_s} if workload == "hyperplane" else {}))
    if workload == "hyperplane":  # each rank draws its shard of the training set and the whole validation set
        rows = hyper.train_samples + hyper.val_samples * workers
        check_memory(FLOAT32 * hyper.dim * rows, "--dim",
                     f"the hyperplane data ({rows:,} rows x {hyper.dim:,} float32)")
    lstm = make_config(LstmSpec, frame_time_s=_parse_or_usage(parse_duration, frame_time),
                       **(samples if workload == "lstm" else {}))
    if compute_s and workload not in ("hyperplane", "lenet5", "mlp"):
        raise typer.BadParameter(f"--compute-time applies to hyperplane, lenet5 and mlp (lstm: --frame-time), "
                                 f"not {workload}")
    if image_size is not None and workload != "lenet5":
        raise typer.BadParameter(f"--image-size applies to lenet5, not {workload}")
    lenet5 = make_config(LeNet5Spec, compute_time_s=compute_s, **({"image_size": image_size} if image_size else {}),
                         **(samples if workload == "lenet5" else {}))
    if hidden is not None and workload != "mlp":
        raise typer.BadParameter(f"--hidden applies to mlp, not {workload}")
    mlp = make_config(MlpSpec, compute_time_s=compute_s, **(samples if workload == "mlp" else {}),
                      **({"hidden": hidden} if hidden else {}))
    out_dir = out if out is not None else Path("runs") / workload
    emulation = None
    if not emulate:
        for flag, value in (("--rate", rate), ("--churn", churn), ("--churn-period", churn_period),
                            ("--topology", topology)):
            if value is not None:
                raise typer.BadParameter(f"{flag} applies to an emulated run: add --emulate (root)")
    else:
        emulation = make_config(TrainEmulation, rate_bps=rate_option(rate or "1gbit", "--rate", emulated=True),
                                churn=churn,
                                churn_period_s=_parse_or_usage(parse_duration, churn_period or "5s"),
                                trace_dir=str(out_dir), ps_topology=topology)
        if churn_period is not None and churn is None:
            raise typer.BadParameter("--churn-period needs --churn N1|N2|N3")
    config = config_from(ctx, EagerTrainConfig, modes=modes, injects=injects, hyperplane=hyper, lstm=lstm,
                         lenet5=lenet5, mlp=mlp, lda=lda, timeout_s=timeout, emulation=emulation,
                         replication=replication, **({"fail": None} if ps_kills else {}))
    if ps_kills:
        from mlfabric.train.ps_rejoin import run_from_cli as run_ps_kills

        return run_ps_kills(config, fail=fail, rejoin=rejoin, elastic=elastic, json_path=json_path)
    if emulate:
        from mlfabric.emu.cmd import have_root

        if not have_root():
            console.print(f"[bold red]error:[/] {EMULATE_NEEDS_ROOT}", markup=True, highlight=False)
            raise typer.Exit(2)
    command = invocation(ctx, sync=sync, out=out_dir, replication=replication,
                         rate=rate or "1gbit" if emulate else None,
                         churn_period=churn_period or "5s" if churn is not None else None)
    from mlfabric.bench.procs import RankFailedError, RankTimeoutError
    from mlfabric.emu.cmd import EmuUnavailableError
    from mlfabric.train.failover import FailoverError

    with progress_bar(quiet=quiet) as progress:
        task = progress.add_task(f"{workload} on {workers} ranks: {len(config.runs())} runs (start-up first)",
                                 total=len(config.runs()))
        result = run_or_exit(lambda: run_eager_training(
            config, argv=command, capture_output=True,
            on_run=lambda done, total: progress.update(task, completed=done, total=total)),
            (RankFailedError, RankTimeoutError, EmuUnavailableError, FailoverError))
    files = write_outputs(result, out_dir, plot=plot)
    result = dataclasses.replace(result, files=files)
    console.print(render_table(result))
    if any(run.ps is not None for run in result.runs):
        console.print(render_ps_table(result))
    for kind, path in files.items():
        console.print(f"{'note' if kind.endswith('skipped') else 'wrote'} {kind.removesuffix('_skipped')}: {path}")
    if json_path is not None:
        write_json(json_path, result.to_dict())


# --------------------------------------------------------------------------- demo


@app.command("demo")
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="A smaller, faster run.")] = False,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    out: Annotated[Path, typer.Option("--out", help="Run directory: what the demo writes goes there (it says "
                                                    "so first).")] = Path("runs/demo"),
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Where the straggler scenario draws its MSE-vs-time "
                                                               "plot (needs matplotlib; default: OUT/stragglers.png).")]
        = None,
    stragglers: Annotated[bool, typer.Option("--stragglers/--no-stragglers", help="Run the straggler scenario "
                                             "(synchronous vs eager-SGD solo/majority on 8 ranks).")] = True,
) -> None:
    """Benchmark allreduce on 4 local ranks, train a small MLP with DDP + mlfabric on 2, then
    synchronous SGD vs eager-SGD (solo, majority) on 8 ranks with one straggler per step.

    It says first what each part starts and where it writes (OUT, runs/demo by default)."""
    import dataclasses

    from mlfabric.demo import demo_config, run_demo

    config = dataclasses.replace(demo_config(quick=quick), out_dir=str(out),
                                 plot_path=None if plot is None else str(plot))
    if not stragglers:
        config = dataclasses.replace(config, stragglers=None)
    result = run_or_exit(lambda: run_demo(config, console=console, quiet=quiet))
    if json_path is not None:
        write_json(json_path, result.to_dict())


# --------------------------------------------------------------------------- trace


@trace_app.command("merge")
def trace_merge(
    directory: Annotated[Path, typer.Argument(help="The MLFABRIC_TRACE directory of a run.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Merged file (default DIR/merged.json).")] = None,
) -> None:
    """Merge the ranks' timelines into one file to open in ui.perfetto.dev or chrome://tracing."""
    from mlfabric.runtime.trace import merge

    try:
        path, files = merge(directory, out)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"merged {files} rank file(s) into {path}: open it in https://ui.perfetto.dev", highlight=False)


def _unwrap_help(group: typer.Typer) -> None:
    """Each command's help (its docstring) as paragraphs that rich wraps to the width it
    prints at, not at the source's line breaks (#39 item 6: `--help` broke sentences where
    the docstring did); a blank line still separates paragraphs."""
    import inspect

    for info in group.registered_commands:
        if info.callback is not None and info.callback.__doc__:
            paragraphs = inspect.cleandoc(info.callback.__doc__).split("\n\n")
            info.callback.__doc__ = "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines())
                                                 for paragraph in paragraphs)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _unwrap_help(sub.typer_instance)


_unwrap_help(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
