"""Each CLI option is stated once (#35): in the command's signature. The config takes the
options named like its fields from the parse (``cli.config_from``), and the command line a
JSON records is rebuilt from the same parse (``cli.invocation``), never typed out again.

    .venv/bin/python -m pytest tests/unit/test_cli_options.py -q
"""

from __future__ import annotations

import ast
import inspect
import json
import shlex

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from mlfabric import cli
from mlfabric.cli import app
from tests.unit.cli_commands import leaf_commands

#: Values for the options without a default.
REQUIRED = {"simulate collective": ["--topology", "star:n=4"],
            "simulate ps": ["--topology", "star:n=4", "--workers", "2", "--servers", "1"]}


def _context(path: str, args: list[str]) -> typer.Context:
    """The context a run of ``mlfabric PATH ARGS`` gets (parsed, callbacks run, not invoked)."""
    group = get_command(app)
    ctx = typer.Context(group, info_name="mlfabric")
    for name in path.split()[:-1]:
        group = group.commands[name]
        ctx = typer.Context(group, info_name=name, parent=ctx)
    return group.commands[path.split()[-1]].make_context(path.split()[-1], list(args), parent=ctx)


def _recording_commands() -> list[str]:
    return sorted(path for path, command in leaf_commands().items()
                  if "invocation(ctx" in inspect.getsource(command.callback))


def test_every_command_that_writes_json_records_its_command_through_invocation() -> None:
    with_json = {path for path, command in leaf_commands().items() if any("--json" in p.opts for p in command.params)}
    assert with_json - {"demo"} <= set(_recording_commands()), with_json - set(_recording_commands())


def test_no_command_line_is_typed_out_by_hand() -> None:
    """No list literal starting with "mlfabric" outside invocation itself."""
    tree = ast.parse(inspect.getsource(cli))
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name != "invocation":
            for inner in ast.walk(node):
                if (isinstance(inner, ast.List) and inner.elts and isinstance(inner.elts[0], ast.Constant)
                        and inner.elts[0].value == "mlfabric"):
                    offenders.append(f"{node.name}:{inner.lineno}")
    assert offenders == []


def test_configs_take_the_options_named_like_their_fields() -> None:
    """Every *Config of a command comes from config_from, and none is handed an option under its
    own name (a value the command resolved, i.e. assigns, may be)."""
    tree = ast.parse(inspect.getsource(cli))
    repeats, by_hand = [], []
    for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
        options = {arg.arg for arg in function.args.args}
        assigned = {target.id for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AugAssign))
                    for target in ast.walk(node) if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store)}
        for node in ast.walk(function):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if (node.func.id == "make_config" and isinstance(node.args[0], ast.Name)
                    and node.args[0].id.endswith("Config")):
                by_hand.append(f"{node.args[0].id}:{node.lineno}")
            if node.func.id in ("config_from", "invocation"):
                repeats += [f"{kw.arg}:{node.lineno}" for kw in node.keywords
                            if isinstance(kw.value, ast.Name) and kw.value.id == kw.arg
                            and kw.arg in options - assigned]
    assert by_hand == [] and repeats == []


@pytest.mark.parametrize("path", _recording_commands())
def test_the_recorded_command_parses_back_to_the_same_options(path: str) -> None:
    ctx = _context(path, [*REQUIRED.get(path, []), "--json", "out.json"])
    argv = cli.invocation(ctx)
    assert argv[:len(path.split()) + 1] == ["mlfabric", *path.split()] and argv[-2:] == ["--json", "out.json"]
    again = _context(path, argv[len(path.split()) + 1:])
    assert again.params == ctx.params


def test_simulate_collective_records_every_option_it_ran_with() -> None:
    """It used to leave out --itemsize, --ranks, --latency and --compute: the JSON's command
    did not reproduce the run."""
    args = ["simulate", "collective", "--topology", "star:n=4", "--size", "1MB", "--itemsize", "8", "--ranks", "2",
            "--latency", "1ms", "--compute", "2ms", "--links", "none", "--json", "-"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    command = shlex.split(json.loads(result.stdout)["command"])
    again = _context("simulate collective", command[3:])
    assert (again.params["itemsize"], again.params["ranks"], again.params["latency"], again.params["compute"]) == (
        8, 2, "1ms", "2ms")
    assert again.params == _context("simulate collective", args[2:]).params


def test_config_from_refuses_an_option_left_as_text() -> None:
    """A same-named option whose field wants something parsed (sizes: a tuple of ints) must be
    passed parsed; forgetting it is a programming error, not a silent string in the config."""
    from mlfabric.bench.allreduce import AllreduceBenchConfig

    ctx = _context("bench allreduce", ["--sizes", "4KB"])
    with pytest.raises(TypeError, match="--sizes is text"):
        cli.config_from(ctx, AllreduceBenchConfig, algorithms=("ring",))
    config = cli.config_from(ctx, AllreduceBenchConfig, algorithms=("ring",), sizes=(4000,))
    assert config.sizes == (4000,) and config.world_size == 4 and config.iters == 10
