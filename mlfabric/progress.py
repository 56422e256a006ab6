"""The progress display of long commands (benchmarks, simulations, training, the demo).

    mlfabric simulate bml            # a bar on standard error while it runs, when that is a terminal
    mlfabric simulate bml --quiet    # none; nor in a pipe or a log file

One helper, so every command behaves alike: :func:`progress_bar` draws on standard error and
only when it is a terminal and the user did not pass ``--quiet``, so that standard output
(tables, or the JSON of ``--json -``) is never mixed with it. :func:`step_reporter` adapts
work that announces each step by a label (``on_step(label)``) to a counted bar.

Long simulations also print plain status lines with ``--progress`` (:func:`status_lines`):
one line every few seconds on standard error, *also when it is a pipe or a log file*
(``mlfabric simulate collective ... --progress 2>&1 | tee run.log``): events, simulated time
and the event rate, which a bar cannot show and a terminal-only display hides from batch runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar", "status_lines", "step_reporter"]


def progress_bar(*, quiet: bool = False, transient: bool = True) -> Progress:
    """A progress display on standard error, off when ``quiet`` or when standard error is not a
    terminal (then every call on it does nothing). ``transient``: it vanishes when done (the
    demo keeps its bars as a record of what ran). Standard output written meanwhile is shown
    above it when it is the terminal too, and left alone when it goes elsewhere (a pipe keeps
    its bytes)."""
    stderr = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=stderr, transient=transient, disable=quiet or not stderr.is_terminal,
                    redirect_stdout=sys.stdout.isatty())


def step_reporter(progress: Progress, task: TaskID) -> Callable[[str], None]:
    """``on_step(label)`` for work that announces each step before running it (simulations,
    benchmark instances): the bar shows the step's label and counts the steps before it done."""
    started = 0

    def on_step(label: str) -> None:
        nonlocal started
        progress.update(task, description=label, completed=started)
        started += 1

    return on_step


def status_lines(what: str, *, interval_s: float = 2.0, stream: TextIO | None = None) -> Callable[[Any], None]:
    """``on_status(status)`` printing one line per ``interval_s`` of wall time (and the last
    one) to ``stream`` (standard error), whether or not it is a terminal. ``status`` has the
    fields of :class:`mlfabric.sim.SimStatus`: ``tasks_done``, ``tasks``, ``events``,
    ``flows``, ``sim_time_s``, ``wall_s``, ``finished``."""
    last = -float("inf")

    def on_status(status: Any) -> None:
        nonlocal last
        now = time.monotonic()
        if not status.finished and now - last < interval_s:
            return
        last = now
        rate = status.events / status.wall_s if status.wall_s > 0 else 0.0
        out = stream if stream is not None else sys.stderr
        print(f"{what}: {status.tasks_done:,}/{status.tasks:,} tasks, {status.events:,} events ({rate:,.0f}/s), "
              f"{status.flows:,} flows, simulated {status.sim_time_s:.6g} s, wall {status.wall_s:.1f} s"
              + (" (done)" if status.finished else ""), file=out, flush=True)

    return on_status
