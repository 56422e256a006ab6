"""The CLI's leaf commands by their path (``"simulate collective"``), for the tests that check
a convention on every command (test_cli_conventions, test_cli_limits, test_cli_options).

    .venv/bin/python -m pytest tests/unit/test_cli_conventions.py -q
"""

from __future__ import annotations

import typer
from typer.main import get_command

from mlfabric.cli import app


def leaf_commands() -> dict[str, typer.core.TyperCommand]:
    found = {}

    def walk(group, prefix: str) -> None:
        for name, command in group.commands.items():
            path = f"{prefix} {name}".strip()
            if hasattr(command, "commands"):
                walk(command, path)
            else:
                found[path] = command

    walk(get_command(app), "")
    return found
