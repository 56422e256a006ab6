"""The ``mlfabric`` command as a user runs it: ``--json -`` into a pipe, progress on a terminal
(a pseudo-terminal here) and never in a pipe or with ``--quiet``.

    .venv/bin/python -m pytest tests/local/test_cli_output.py -q
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

MLFABRIC = str(Path(sys.executable).with_name("mlfabric"))
#: A simulation of a few seconds with a counted progress bar (5 steps).
BML = ["simulate", "bml", "--servers", "16", "--checks", "4x2"]
PROGRESS_TEXT = b"GST check: BML on BCube(4,2)"  # the progress bar's description of the last step


def _run_with_stderr_on_a_terminal(args: list[str]) -> tuple[int, bytes, bytes]:
    """Run ``mlfabric ARGS`` with stdout a pipe and stderr a 100-column pseudo-terminal;
    return (status, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR", "COLUMNS"):
        env.pop(name, None)
    proc = subprocess.Popen([MLFABRIC, *args], stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                            env=env)
    os.close(slave)
    seen = bytearray()

    def drain() -> None:  # a full terminal buffer would block the command
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command closed its end
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, stdout, bytes(seen)


def test_json_dash_pipes_into_json_tool_with_the_tables_on_stderr() -> None:
    """The issue's spelling: ``mlfabric simulate ... --json - | python -m json.tool``."""
    simulate = subprocess.Popen([MLFABRIC, "simulate", "collective", "--topology", "bcube:n=3,k=2", "--link", "1Gbps",
                                 "--algorithm", "bcube", "--size", "72KB", "--json", "-"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tool = subprocess.run([sys.executable, "-m", "json.tool"], stdin=simulate.stdout, capture_output=True,
                          timeout=120)
    simulate.stdout.close()
    stderr = simulate.stderr.read().decode()
    simulate.stderr.close()
    assert simulate.wait(timeout=120) == 0 and tool.returncode == 0, stderr + tool.stderr.decode()
    data = json.loads(tool.stdout)
    assert data["algorithm"] == "allreduce:bcube" and data["time_vs_closed_form"] == pytest.approx(1.0, rel=1e-9)
    assert "mlfabric simulate collective" in stderr and "2(N-1)/(kN)" in stderr


def test_bench_json_dash_keeps_stdout_clean_of_the_ranks_and_tables(tmp_path: Path) -> None:
    """A benchmark with rank processes: stdout is exactly one JSON document, even when the
    ranks print (a sitecustomize makes every rank process print a line to its stdout)."""
    (tmp_path / "sitecustomize.py").write_text("import os\nif 'RANK' in os.environ:\n    print('rank noise')\n")
    env = {key: value for key, value in os.environ.items() if key != "RANK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    out = subprocess.run([MLFABRIC, "bench", "allreduce", "--world-size", "2", "--algorithms", "ring,gloo",
                          "--sizes", "4KB", "--iters", "1", "--warmup", "0", "--json", "-"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["metadata"]["command"].endswith("--json -")
    assert {(r["algorithm"], r["correct"]) for r in data["results"]} == {("ring", True), ("gloo", True)}
    assert "vs gloo" in out.stderr and "vs gloo" not in out.stdout  # the table


def test_progress_on_a_terminal_and_not_with_quiet() -> None:
    code, stdout, terminal = _run_with_stderr_on_a_terminal(BML)
    assert code == 0, terminal.decode(errors="replace")[-3000:]
    assert PROGRESS_TEXT in terminal  # shown while it ran (and erased after: transient)
    assert b"BML Fig. 5: GST" in stdout and PROGRESS_TEXT not in stdout  # the tables go to stdout
    code, stdout, terminal = _run_with_stderr_on_a_terminal([*BML, "--quiet"])
    assert code == 0 and b"BML Fig. 5: GST" in stdout
    assert PROGRESS_TEXT not in terminal and b"Fig. 5, 16 servers" not in terminal


def test_no_progress_when_stderr_is_not_a_terminal() -> None:
    out = subprocess.run([MLFABRIC, *BML, "--json", "-"], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["ok"] is True
    assert b"BML Fig. 5: GST" in out.stderr  # the tables, on stderr because of --json -
    assert PROGRESS_TEXT not in out.stderr and b"Fig. 5, 16 servers" not in out.stderr
    assert b"\x1b[?25l" not in out.stderr  # nor the progress display's hide-cursor code


def test_bench_partial_into_a_pipe_keeps_every_column_name() -> None:
    """Issue #39 item 6: into a pipe the table was squeezed to 80 columns and its names cut
    (``vs synchrono…``); now it keeps its natural width and the title its one line."""
    out = subprocess.run([MLFABRIC, "bench", "partial", "-n", "2", "--iterations", "2", "--warmup", "0", "--skew", "none",
                          "--quiet"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if "variant" in line)
    for name in ("mean ms", "median ms", "p90 ms", "vs synchronous", "paper", "active", "ok"):
        assert f" {name} " in f"{header} ", header
    assert "…" not in out.stdout
    assert any(line.startswith("partial allreduce: 2 ranks") and line.endswith("iterations x ranks") for line in lines)
