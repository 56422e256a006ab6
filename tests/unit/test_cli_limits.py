"""Every size, rate, count and timeout of every command is checked (issue #39: `simulate
collective --size 3` of float32 simulated a 0-byte allreduce and exited 0): zero, negative,
not a whole number of elements, or more than the machine can hold or start is a usage error
(exit 2) naming the option, before anything runs. The options are found by walking the CLI,
so a new command's options are covered too.

    .venv/bin/python -m pytest tests/unit/test_cli_limits.py -q
"""

from __future__ import annotations

from typing import Optional

import pytest
from typer.testing import CliRunner

from mlfabric import cli
from mlfabric.cli import app
from tests.unit.cli_commands import leaf_commands

#: Values for the options without a default.
REQUIRED = {"simulate collective": ["--topology", "star:n=4"],
            "simulate ps": ["--topology", "star:n=8", "--workers", "4", "--servers", "2"]}
SIZES = {"--size", "--sizes", "--model-size", "--update-size", "--partition"}
RATES = {"--rate", "--link", "--host-rate"}


def _options(kind) -> list[tuple[str, str]]:
    """(command, option) for every option for which ``kind(option)`` holds."""
    return [(path, max(param.opts, key=len)) for path, command in sorted(leaf_commands().items())
            for param in command.params if param.param_type_name == "option" and kind(param)]


def _is_count(param) -> bool:
    """An integer option (``int`` or ``Optional[int]``)."""
    annotation = param.type_descriptor.annotation
    return annotation is int or annotation == Optional[int]


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that slips through must not start processes or simulations: it fails here."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("the command ran: the value was accepted")

    monkeypatch.setattr(cli, "run_or_exit", refuse)
    import mlfabric.emu.launcher

    monkeypatch.setattr(mlfabric.emu.launcher, "launch", refuse)


def _refused(path: str, option: str, value: str, *extra: str) -> str:
    args = [*path.split(), *REQUIRED.get(path, []), *extra, option, value]
    if path == "launch":
        args += ["--", "true"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2, (args, result.exit_code, output[-500:], result.exception)
    assert option in output, (args, output[-500:])
    return output


@pytest.mark.parametrize("path, option", _options(_is_count))
def test_negative_counts_are_refused(path: str, option: str) -> None:
    _refused(path, option, "-1")


def test_every_integer_option_was_found() -> None:
    found = {option for _, option in _options(_is_count)}
    assert {"--seed", "--world-size", "--workers", "--iterations", "--itemsize", "--hosts"} <= found


@pytest.mark.parametrize("path, option", _options(lambda p: set(p.opts) & SIZES))
def test_zero_sizes_are_refused(path: str, option: str) -> None:
    assert "nothing would be moved" in _refused(path, option, "0")


@pytest.mark.parametrize("path, option", _options(lambda p: set(p.opts) & RATES))
def test_zero_rates_are_refused(path: str, option: str) -> None:
    _refused(path, option, "0")


@pytest.mark.parametrize("path, option", [(path, option) for path, option in _options(lambda p: "--timeout" in p.opts)
                                          if path != "launch"])  # launch's is a duration text: its own parser
@pytest.mark.parametrize("value", ["0", "-5", "1e300"])
def test_timeouts_must_be_positive_and_waitable(path: str, option: str, value: str) -> None:
    _refused(path, option, value)


@pytest.mark.parametrize("args, option", [
    (["simulate", "collective", "--size", "3"], "--size"),           # the case: float32 by default
    (["simulate", "collective", "--itemsize", "8", "--size", "12"], "--size"),
    (["bench", "allreduce", "--sizes", "4KB,6"], "--sizes"),
    (["bench", "partial", "--size", "6"], "--size"),
    (["bench", "ps", "--model-size", "1000001"], "--model-size"),
    (["bench", "mlnet-priorities", "--model-size", "5"], "--model-size"),
    (["bench", "grad-order", "--partition", "3"], "--partition"),
])
def test_sizes_that_are_not_whole_elements_are_refused(args: list[str], option: str) -> None:
    path = " ".join(args[:2])
    output = _refused(path, option, args[-1], *args[2:-2])
    assert "element" in output


def test_the_size_message_says_what_to_give() -> None:
    output = _refused("simulate collective", "--size", "6")
    assert "not a whole number of 4-byte elements: give a multiple of 4, e.g. 4 or 8" in output


@pytest.mark.parametrize("args, option, message", [
    (["bench", "allreduce", "--world-size", "1000000"], "--world-size", "local processes"),
    (["bench", "partial", "--world-size", "1000000"], "--world-size", "local processes"),
    (["bench", "ps", "--workers", "1000000"], "--workers", "local processes"),
    (["bench", "tictac", "--workers", "1000000"], "--workers", "local processes"),
    (["bench", "grad-order", "--workers", "1000000"], "--workers", "local processes"),
    (["bench", "mlnet-priorities", "--jobs", "7", "--workers", "1000000"], "--jobs x --workers", "local processes"),
    (["train", "--sync", "ps-bsp", "--servers", "1000000"], "--servers", "local processes"),
    (["bench", "allreduce", "--sizes", "1PB"], "--sizes", "memory"),
    (["bench", "ps", "--model-size", "1PB"], "--model-size", "memory"),
    (["train", "--workload", "hyperplane", "--dim", "100000000"], "--dim", "memory"),
    (["bench", "bml-job", "--batches", "32,100000000"], "--batches", "training samples"),
    (["simulate", "bml", "--rtol", "2"], "--rtol", "passes anything"),
    (["bench", "ps", "--rate", "1bit"], "--rate", "8 kbit/s"),
])
def test_absurd_values_are_refused(args: list[str], option: str, message: str) -> None:
    path = " ".join(args[:2]) if args[0] != "train" else "train"
    rest = args[len(path.split()):]
    output = _refused(path, rest[-2], rest[-1], *rest[:-2])
    assert option in output and message in output
