"""``python -m mlfabric.emu doctor|cleanup|list|launch ...``: the emulator's CLI on its own."""

from __future__ import annotations

import typer

from mlfabric.emu.cli import LAUNCH_CONTEXT, emu_app, launch

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="mlfabric emulator (standalone entry point; the same commands as `mlfabric emu` / `mlfabric launch`).")
app.registered_commands += emu_app.registered_commands
app.command("launch", context_settings=LAUNCH_CONTEXT)(launch)

if __name__ == "__main__":
    app()
