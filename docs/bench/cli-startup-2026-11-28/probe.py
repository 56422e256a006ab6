"""Probe: which bad values does each command accept (99 = would run)?"""
import sys, typer
from typer.testing import CliRunner
import mlfabric.cli as cli
def fake(fn, errors=None):
    raise typer.Exit(99)
cli.run_or_exit = fake
import mlfabric.sim.mlfabric as smf
def fake2(*a, **k):
    raise typer.Exit(99)
smf.simulate_table2 = fake2
import mlfabric.train.harness as te
import mlfabric.emu.cmd as cmd
cmd.have_root = lambda: True
R = CliRunner()
BASE = {
 "bench allreduce": [], "bench bml-job": [], "bench partial": [], "bench ps": [], "bench mlnet-priorities": [],
 "bench tictac": [], "bench grad-order": [], "bench scheduler": [],
 "simulate collective": ["--topology", "star:n=4"], "simulate ps": ["--topology", "star:n=8", "--workers", "4", "--servers", "2"],
 "simulate bml": [], "simulate mlfabric": [], "simulate mlnet": ["--quick"], "train": ["--workload", "mlp", "--workers", "2", "--sync", "allreduce"],
}
cases = [l.split("\t") for l in open(sys.argv[1]).read().strip().splitlines()]
for path, opt, value in cases:
    args = path.split() + BASE[path] + [opt, value]
    r = R.invoke(cli.app, args, env={"COLUMNS": "250"})
    msg = " ".join((r.output or "").split())[-160:] if r.exit_code != 99 else ""
    if r.exception and not isinstance(r.exception, SystemExit):
        msg = f"EXC {type(r.exception).__name__}: {r.exception}"[:160]
    print(f"{r.exit_code:3d} {path} {opt} {value}  {msg}")
