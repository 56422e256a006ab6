"""Typer commands of the emulator: the ``emu`` sub-app (doctor, cleanup, list) and ``launch``.

    mlfabric emu doctor
    mlfabric emu cleanup [--force]
    sudo mlfabric launch --hosts 8 --topology star --rate 1gbit --churn N2 --period 5s --seed 1 -- python train.py
    sudo mlfabric launch --hosts 2 --run-dir runs/emu -- python train.py      # keep cluster.json and the trace

``mlfabric/cli.py`` registers them; ``python -m mlfabric.emu doctor|cleanup|list|launch ...``
runs the same commands without the rest of the CLI.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

__all__ = ["emu_app", "launch", "LAUNCH_CONTEXT"]

emu_app = typer.Typer(help="Emulated clusters: network namespaces, rate-limited NICs (root).", no_args_is_help=True)

#: Everything after ``--`` (and unknown options after the command) belongs to the launched command.
LAUNCH_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


@emu_app.command("doctor")
def doctor_command() -> None:
    """Say what the emulator can use here: root, namespaces, veth, bridges, tc qdiscs."""
    from mlfabric.emu.doctor import DEBIAN_PACKAGES, doctor

    checks = doctor()
    for check in checks:
        mark = "ok  " if check.ok else ("MISS" if check.required else "n/a ")
        typer.echo(f"[{mark}] {check.name:<20} {check.detail}")
    if not all(c.ok for c in checks if c.required):
        typer.echo(f"the emulator is not usable here (it needs root and the Debian package(s) {' '.join(DEBIAN_PACKAGES)})")
        raise typer.Exit(1)
    typer.echo("the emulator is usable")


@emu_app.command("cleanup")
def cleanup_command(
    force: Annotated[bool, typer.Option("--force", help="Also remove clusters whose launcher is still running.")] = False,
    prefix: Annotated[Optional[str], typer.Option(help="Only this run (mf1a2b).")] = None,
) -> None:
    """Remove namespaces, links, bridges, hosts files and temporary run directories left by
    emulator runs whose launcher died (kill -9)."""
    from mlfabric.emu.cluster import cleanup

    removed = cleanup(force=force, prefix=prefix)
    typer.echo("removed: " + (", ".join(removed) if removed else "nothing"))


@emu_app.command("list")
def list_command() -> None:
    """List emulator runs on this machine (prefix, owner pid, alive, namespaces)."""
    from mlfabric.emu.cluster import list_runs

    runs = list_runs()
    if not runs:
        typer.echo("no emulator runs")
    for prefix, entry in sorted(runs.items()):
        state = "running" if entry["alive"] else "leftover (mlfabric emu cleanup)"
        run_dir = f"  run_dir={entry['temporary_dir']}" if entry["temporary_dir"] else ""
        typer.echo(f"{prefix}  pid={entry['pid']}  {state}  netns={' '.join(entry['netns'])}{run_dir}")  # type: ignore[arg-type]


def launch(
    ctx: typer.Context,
    hosts: Annotated[Optional[int], typer.Option("--hosts", "-n", min=1, help="Number of hosts (= ranks).")] = None,
    topology: Annotated[str, typer.Option(help="star, or a spec: star:n=8, racks:r=2,h=4,oversub=4, bcube:n=3,k=2.")]
        = "star",
    rate: Annotated[str, typer.Option(help="Host NIC rate, each direction: 100mbit, 1gbit, 10Gbps.")] = "1gbit",
    churn: Annotated[Optional[str], typer.Option(help="Bandwidth churn: N1, N2, N3 or 5G:0.1,10G:0.9 (scaled to --rate).")]
        = None,
    period: Annotated[str, typer.Option(help="Churn period: every NIC direction is redrawn this often.")] = "5s",
    seed: Annotated[int, typer.Option(min=0, help="Seed of the churn draws.")] = 0,
    trace: Annotated[Optional[str], typer.Option(help="Write the applied churn as a capacity-trace CSV here.")] = None,
    timeout: Annotated[Optional[str], typer.Option(help="Kill the job after this long (e.g. 10min).")] = None,
    master_port: Annotated[int, typer.Option(min=1, max=65535, help="MASTER_PORT on host 0.")] = 29500,
    emulate: Annotated[str, typer.Option(help="auto (emulate when root), always, never (local processes).")] = "auto",
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="Keep the run's files (cluster.json, the churn "
                                                   "trace) in this directory (default: a temporary one, removed at "
                                                   "the end).")] = None,
    keep_run_dir: Annotated[bool, typer.Option("--keep-run-dir", help="Keep the temporary run directory after the "
                                               "run (its path is printed at start).")] = False,
) -> None:
    """Start one process per emulated host (torchrun environment), then tear everything down.

    Example: mlfabric launch --hosts 8 --topology star --rate 1gbit -- python train.py
    """
    from mlfabric.emu.cmd import EmuUnavailableError
    from mlfabric.emu.launcher import LaunchSpec, launch as run_launch
    from mlfabric.units import parse_duration

    from mlfabric.cli import rate_option  # the CLI's one check of rates (it imports this module first)

    command = tuple(ctx.args)
    rate_bps = rate_option(rate, "--rate", emulated=True)
    try:
        spec = LaunchSpec(command=command, hosts=hosts, topology=topology, rate_bps=rate_bps, churn=churn,
                          period_s=parse_duration(period), seed=seed, trace_path=trace, master_port=master_port,
                          timeout_s=parse_duration(timeout) if timeout else None, emulate=emulate,
                          run_dir=run_dir, keep_run_dir=keep_run_dir)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        code = run_launch(spec)
    except EmuUnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)
