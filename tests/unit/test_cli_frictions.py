"""Small frictions a new user met (issue #39 item 9): ``--div-max`` implies network
replication and says which modes support it; ``mlfabric demo`` says first what each part
starts and writes under a run directory it names, not into the current directory.

    .venv/bin/python -m pytest tests/unit/test_cli_frictions.py -q
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from mlfabric.cli import app

TRAIN = ["train", "--workload", "mlp", "--workers", "2", "--sync", "mlfabric-a:8", "--replicas", "1"]


@pytest.fixture()
def captured(monkeypatch: pytest.MonkeyPatch) -> list:
    """The config `mlfabric train` would run (it stops there)."""
    import mlfabric.train.harness

    seen: list = []

    def stop(config, **_kwargs):
        seen.append(config)
        raise typer.Exit(3)

    monkeypatch.setattr(mlfabric.train.harness, "run_eager_training", stop)
    return seen


def test_div_max_implies_network_replication_and_says_so(captured: list) -> None:
    result = CliRunner().invoke(app, [*TRAIN, "--div-max", "30u"], env={"COLUMNS": "300"})
    assert result.exit_code == 3, result.output
    (config,) = captured
    assert config.replication == "network" and config.div_max == "30u"
    note = " ".join(result.output.split())
    assert "--div-max 30u implies --replication network" in note and "mlfabric-a:TAU modes support it" in note


def test_without_div_max_replication_stays_chain(captured: list) -> None:
    result = CliRunner().invoke(app, TRAIN, env={"COLUMNS": "300"})
    assert result.exit_code == 3, result.output
    assert captured[0].replication == "chain" and "implies" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--replication", "chain", "--div-max", "1"], "add --replication network"),  # said chain: not overridden
    (["--div-max", "1", "--sync", "ps-async"], "run a mlfabric-a:TAU mode"),       # the modes that support it
])
def test_div_max_where_it_cannot_apply_is_refused(captured: list, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, [*TRAIN, *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert captured == []


def test_the_demo_says_what_it_starts_and_where_it_writes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import mlfabric.demo

    def stop(*_args, **_kwargs):
        raise RuntimeError("stopped before the first part")

    monkeypatch.setattr(mlfabric.demo, "run_allreduce_bench", stop)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", "there"], env={"COLUMNS": "300"})
    assert isinstance(result.exception, RuntimeError)
    text = " ".join(result.output.split())
    assert "writes to there/ (--out DIR); 3 parts, each starts local processes:" in text
    assert "1/3 allreduce benchmark: 4 local processes" in text
    assert "2/3 DDP training: 2 runs of 2 local processes" in text
    assert "3/3 stragglers: 8 local processes, one launch for 4 runs" in text and "plot there/stragglers.png" in text
    assert list(tmp_path.iterdir()) == []  # nothing written before it runs, nothing in the current directory


def test_the_straggler_plot_goes_under_the_run_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import dataclasses

    import mlfabric.demo
    import mlfabric.train.harness

    drawn: list[Path] = []
    monkeypatch.setattr(mlfabric.demo, "run_eager_training", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(mlfabric.train.harness, "plot_curves", lambda result, path: drawn.append(path) or path)
    monkeypatch.chdir(tmp_path)
    config = mlfabric.demo.demo_config(quick=True)
    assert config.out_dir == "runs/demo" and config.plot == "runs/demo/stragglers.png"
    _, plot = mlfabric.demo._run_stragglers(config, Console(file=io.StringIO()), True)
    assert drawn == [Path("runs/demo/stragglers.png")] and plot == "runs/demo/stragglers.png"
    assert (tmp_path / "runs" / "demo").is_dir()
    explicit = dataclasses.replace(config, plot_path=str(tmp_path / "p.png"))
    assert explicit.plot == str(tmp_path / "p.png")
