"""The CLI's conventions, checked on every command: ``--json PATH`` (``-``: standard output)
wherever JSON is written, ``--quiet`` wherever progress is shown, one progress helper.

    .venv/bin/python -m pytest tests/unit/test_cli_conventions.py -q

tests/local/test_cli_output.py runs the commands as a user does (pipes, a terminal).
"""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from mlfabric import cli
from mlfabric.cli import app
from tests.unit.cli_commands import leaf_commands

#: Commands that write JSON (newer ones are checked too: every --json option below).
JSON_COMMANDS = {
    "bench allreduce", "bench bml-job", "bench sim", "bench partial", "bench ps", "bench scheduler",
    "simulate collective", "simulate ps", "simulate bml", "simulate mlfabric", "simulate mlnet", "train", "demo",
}
SIMULATE_PS = ["simulate", "ps", "--topology", "fat-tree:k=4,oversub=4", "--workers", "8", "--servers", "2",
               "--strategy", "rack", "--model-size", "10MB", "--links", "none"]


def _option(command, flag: str):
    return next((p for p in command.params if flag in getattr(p, "opts", ())), None)


def test_every_json_option_takes_a_path_or_dash() -> None:
    with_json = {}
    for path, command in leaf_commands().items():
        option = _option(command, "--json")
        if option is not None:
            with_json[path] = option
        assert _option(command, "--output") is None, f"{path}: --json PATH replaces --output"
    assert JSON_COMMANDS <= set(with_json), f"lost --json: {JSON_COMMANDS - set(with_json)}"
    for path, option in with_json.items():
        assert not option.is_flag and option.nargs == 1, f"{path}: --json is a switch"
        assert option.metavar == "PATH" and "standard output" in option.help, path
        assert option.callback is not None, f"{path}: --json without the shared check (use cli.JsonOption)"


def test_every_command_with_progress_has_quiet_and_the_one_helper() -> None:
    with_progress = []
    for path, command in leaf_commands().items():
        source = inspect.getsource(command.callback)
        assert "console.status(" not in source and "Progress(" not in source, (
            f"{path}: show progress with cli.progress_bar (stderr, tty only, --quiet)")
        if "progress_bar(" in source:
            with_progress.append(path)
            assert _option(command, "--quiet") is not None, f"{path} shows progress but has no --quiet"
            assert "progress_bar(quiet=quiet)" in source, path
    assert {"bench allreduce", "bench sim", "simulate collective", "simulate ps", "simulate bml", "simulate mlnet",
            "train"} <= set(with_progress)
    import mlfabric.demo

    demo_source = inspect.getsource(mlfabric.demo)
    assert "Progress(" not in demo_source and "progress_bar(quiet=quiet" in demo_source
    assert _option(leaf_commands()["demo"], "--quiet") is not None


@pytest.mark.parametrize("args", [
    ["simulate", "collective", "--topology", "star:n=4", "--size", "1MB", "--json", "--links", "none"],
    ["simulate", "mlnet", "--json", "--quick"],
])
def test_the_old_json_switch_is_refused_with_a_hint(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "takes a file PATH, or - for standard output" in message and "is now `--json -`" in message


def test_json_at_the_end_without_a_value_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["simulate", "collective", "--topology", "star:n=4", "--json"])
    assert result.exit_code == 2 and "requires an argument" in result.output


def test_dash_puts_the_json_alone_on_stdout_and_the_table_on_stderr() -> None:
    result = CliRunner().invoke(app, [*SIMULATE_PS, "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "ps" and data["strategy"] == "rack" and data["time_s"] > 0
    assert "time per iteration" in result.stderr and "time per iteration" not in result.stdout
    assert cli.console.stderr is False  # back to stdout for whatever runs next in this process
    after = CliRunner().invoke(app, SIMULATE_PS)
    assert after.exit_code == 0 and "time per iteration" in after.stdout


def test_a_path_gets_the_json_and_stdout_the_table(tmp_path) -> None:
    out = tmp_path / "nested" / "ps.json"
    result = CliRunner().invoke(app, [*SIMULATE_PS, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "time per iteration" in result.stdout and f"wrote {out}" in " ".join(result.stdout.split())
    assert json.loads(out.read_text())["strategy"] == "rack"


def test_dash_on_a_command_with_progress_and_several_tables() -> None:
    result = CliRunner().invoke(app, ["simulate", "bml", "--servers", "16", "--checks", "4x2", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["command"].endswith("--json -") and [c["n"] for c in data["gst_checks"]] == [4]
    assert "BML Fig. 5" in result.stderr and "GST check" in result.stderr
    # Not a terminal: no progress display, only the tables.
    assert "Fig. 5, 16 servers:" not in result.stderr


def test_write_json_dash_and_file(tmp_path, capsys) -> None:
    cli.write_json("-", {"a": [1, 2]})
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}
    cli.write_json(tmp_path / "deeper" / "x.json", {"b": 1})
    assert json.loads((tmp_path / "deeper" / "x.json").read_text()) == {"b": 1}
