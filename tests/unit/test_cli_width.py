"""Output that reads well in a file or a pipe (issue #39 item 6): tables at their natural
width there (never squeezed to 80 columns, no column name cut), captions and long titles on
lines of their own, text not wrapped; help pages with their sentences broken by the width
they print at, never by the source's line breaks.

    .venv/bin/python -m pytest tests/unit/test_cli_width.py -q

tests/local/test_cli_output.py pipes a benchmark with rank processes (bench partial).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from rich import box
from rich.table import Table
from typer.main import get_command

from mlfabric.cli import OutputConsole, app

MLFABRIC = str(Path(sys.executable).with_name("mlfabric"))
NAMES = ["variant", "mean ms", "median ms", "p90 ms", "vs synchronous", "paper", "active", "ok", "a long column name"]
CAPTION = ("speedup in time to the same applied updates (simulated); after <=: the most any scheduler could reach "
           "with one level of aggregation and distribution")


def _table() -> Table:
    table = Table(title="a title that is longer than the table: " + "and longer " * 20,
                  caption=CAPTION, box=box.SIMPLE_HEAD)
    for name in NAMES:
        table.add_column(name, justify="right")
    table.add_row(*(f"{1234.5678 * (i + 1):.4f}" for i in range(len(NAMES))))
    return table


def _print_to_file(*objects: object, width: int = 80) -> list[str]:
    out = io.StringIO()
    console = OutputConsole(file=out, width=width)
    assert not console.is_terminal
    console.print(*objects)
    return out.getvalue().splitlines()


def test_a_table_in_a_file_keeps_its_natural_width_and_names() -> None:
    lines = _print_to_file(_table(), width=40)
    header = next(line for line in lines if "variant" in line)
    assert all(f" {name} " in f" {header} " for name in NAMES), header  # every name whole, on one line
    assert "…" not in "".join(lines)
    rows = [line for line in lines if "1234.5678" in line]
    assert len(rows) == 1 and len(rows[0].rstrip()) > 80  # not squeezed to 40 (or 80) columns
    assert CAPTION in lines  # the caption on one line of its own
    assert lines[0] == _table().title


def test_text_in_a_file_is_not_wrapped() -> None:
    text = "word " * 60
    assert _print_to_file(text.strip(), width=40) == [text.strip()]


def test_on_a_terminal_it_is_rich_as_usual() -> None:
    out = io.StringIO()
    console = OutputConsole(file=out, width=60, force_terminal=True, color_system=None)
    console.print(_table())
    assert max(len(line) for line in out.getvalue().splitlines()) <= 60


def test_simulate_mlfabric_into_a_pipe_keeps_its_caption_whole() -> None:
    """The issue's case: `simulate mlfabric > out.txt` wrapped the caption to the table's ~40 columns."""
    out = subprocess.run([MLFABRIC, "simulate", "mlfabric", "--workers", "4", "--updates", "40", "--update-size", "1MB",
                          "--inject", "C1", "--churn", "none,N1", "--sync", "allreduce,mlfabric-a:30"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    caption = next(line for line in lines if line.startswith("speedup in time"))
    assert caption.endswith("in brackets: the paper's MLfabric-A-30"), lines
    assert any(" N1 " in line and "compute" in line for line in lines)


def test_help_paragraphs_are_not_broken_by_hand() -> None:
    def walk(group):
        for command in group.commands.values():
            yield from walk(command) if hasattr(command, "commands") else [command]

    for command in walk(get_command(app)):
        for paragraph in (command.help or "").split("\n\n"):
            assert "\n" not in paragraph, (command.name, paragraph)


def test_help_into_a_pipe_keeps_its_sentences() -> None:
    out = subprocess.run([MLFABRIC, "bench", "allreduce", "--help"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert ("Emulated runs also show the simulator's time for each mlfabric algorithm (emu/sim) and, with --goodput, "
            "busbw relative to the two-host TCP goodput measured in the same run.") in text
