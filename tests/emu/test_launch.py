"""The launcher: environment, output prefixes, exit status, teardown on every path (root).

    sudo .venv/bin/python -m pytest tests/emu/test_launch.py -q
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mlfabric.emu.cluster import cleanup
from mlfabric.emu.launcher import LaunchSpec, launch, resolve_topology
from tests.emu.conftest import needs_root, our_leftovers

PY = sys.executable
PRINT_ENV = ("import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], "
             "os.environ.get('MLFABRIC_CHANNEL_ADDRS', '-'))")


def test_resolve_topology():
    assert str(resolve_topology("star", 8)) == "star:n=8"
    assert str(resolve_topology("racks:r=2,h=4,oversub=4", 8)) == "racks:r=2,h=4,oversub=4"
    with pytest.raises(ValueError, match="contradicts"):
        resolve_topology("bcube:n=3,k=2", 8)
    with pytest.raises(ValueError, match="needs its parameters"):
        resolve_topology("racks", 8)
    with pytest.raises(ValueError, match="no command"):
        LaunchSpec(command=(), hosts=2)


def test_fallback_runs_local_processes_with_a_warning(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    code = launch(LaunchSpec(command=(PY, "-c", PRINT_ENV), hosts=2, emulate="never", churn="N1"), out=out, err=err)
    assert code == 0
    assert list(tmp_path.iterdir()) == []  # no cluster, no run directory
    assert "NOT enforced" in err.getvalue() and "paces each NIC" in err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines == ["[rank 0] 0 2 127.0.0.1 0=127.0.0.1", "[rank 1] 1 2 127.0.0.1 0=127.0.0.1"]


#: A PATH without this environment's bin: what `sudo` (secure_path) or a shell without the
#: venv activated gives; its `python` (if any) has no torch (#39 item 2).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A rank that needs this environment: torch and mlfabric, then where it runs and as what.
IMPORTS_TORCH = ("import os, socket, sys, torch, mlfabric; "
                 "print(os.environ['RANK'], sys.executable, socket.gethostname(), os.environ['PATH'].split(':')[0])")


def test_fallback_runs_a_bare_python_as_the_launchers_interpreter():
    out, err = io.StringIO(), io.StringIO()
    code = launch(LaunchSpec(command=("python", "-c", IMPORTS_TORCH), hosts=2, emulate="never",
                             env={"PATH": SYSTEM_PATH}), out=out, err=err)
    assert code == 0, out.getvalue() + err.getvalue()
    assert f"running `python` as {PY} (this launcher's interpreter" in err.getvalue()
    bin_dir = os.path.dirname(PY)
    assert f"the ranks' PATH starts with {bin_dir}" in err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert [line.split()[2:4] + [line.split()[-1]] for line in lines] == [["0", PY, bin_dir], ["1", PY, bin_dir]]


def test_fallback_env_paces_every_nic():
    from mlfabric.emu.launcher import fallback_env
    from mlfabric.topo.spec import TopologySpec

    env = fallback_env(TopologySpec.parse("bcube:n=3,k=2"), 500e6)
    assert env == {"MLFABRIC_TOPOLOGY": "bcube:n=3,k=2", "MLFABRIC_PACE": "500000000bit",
                   "MLFABRIC_CHUNK_BYTES": str(1 << 20), "MLFABRIC_CHANNEL_ADDRS": "0=127.0.0.1,1=127.0.0.1"}
    assert fallback_env(TopologySpec.parse("star:n=4"), 1e9)["MLFABRIC_CHANNEL_ADDRS"] == "0=127.0.0.1"


@needs_root
def test_launch_bcube_env_and_prefixed_output(no_leaks, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    code = launch(LaunchSpec(command=(PY, "-c", PRINT_ENV), topology="bcube:n=2,k=2", rate_bps=100e6, churn="N3",
                             period_s=0.2, trace_path=str(tmp_path / "trace.csv")), out=out, err=err)
    assert code == 0, err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines[0] == "[rank 0] 0 4 10.0.0.1 0=10.0.0.1,1=10.1.0.1"
    assert lines[3] == "[rank 3] 3 4 10.0.0.1 0=10.0.0.4,1=10.1.0.4"
    assert (tmp_path / "trace.csv").read_text().startswith("time_s,host,nic,direction,rate_bps\n0.0,0,0,egress,")
    # The run's description lands in the temp dir (pytest's tmp_path here, see conftest.py).
    described = re.search(r"description in (\S+cluster\.json)", err.getvalue())
    assert described and described.group(1).startswith(str(tmp_path)), err.getvalue()


#: A rank's report of the run directory: does the cluster description exist while it runs?
SEES_CLUSTER_JSON = "import os; print('cluster.json', os.path.exists(os.environ['MLFABRIC_EMU_CLUSTER']))"


def _run_dirs(tmp_path):
    """The run directories `launch` made in the temp dir (tmp_path here, see conftest.py)."""
    return sorted(tmp_path.glob("mlfabric-emu-*"))


@needs_root
def test_run_directory_is_removed_after_a_run_that_succeeds_or_fails(no_leaks, tmp_path):
    for script, expected in ((SEES_CLUSTER_JSON, 0), (SEES_CLUSTER_JSON + "; raise SystemExit(3)", 3)):
        out, err = io.StringIO(), io.StringIO()
        code = launch(LaunchSpec(command=(PY, "-c", script), hosts=2, rate_bps=100e6, churn="N1", period_s=0.2,
                                 grace_s=0.5), out=out, err=err)
        assert code == expected, err.getvalue()
        # It existed while the ranks ran (they read the description from it) ...
        assert out.getvalue().count("cluster.json True") == 2, out.getvalue() + err.getvalue()
        described = re.search(r"description in (\S+cluster\.json) \(removed at the end", err.getvalue())
        assert described, err.getvalue()
        assert re.search(r"trace in \S+trace\.csv \(removed at the end: --trace FILE", err.getvalue())
        # ... and is gone, trace and all, once launch returns.
        assert not os.path.exists(os.path.dirname(described.group(1)))
        assert _run_dirs(tmp_path) == []


@needs_root
def test_run_directory_is_kept_when_asked(no_leaks, tmp_path):
    err = io.StringIO()
    assert launch(LaunchSpec(command=(PY, "-c", SEES_CLUSTER_JSON), hosts=2, rate_bps=100e6, keep_run_dir=True),
                  out=io.StringIO(), err=err) == 0
    [kept] = _run_dirs(tmp_path)
    assert json.loads((kept / "cluster.json").read_text())["topology"] == "star:n=2"
    assert "removed at the end" not in err.getvalue()
    named = tmp_path / "runs" / "emu"  # a directory the user names is made and kept
    assert launch(LaunchSpec(command=(PY, "-c", SEES_CLUSTER_JSON), hosts=2, rate_bps=100e6, churn="N1",
                             period_s=0.2, run_dir=str(named)), out=io.StringIO(), err=io.StringIO()) == 0
    assert sorted(p.name for p in named.iterdir()) == ["cluster.json", "trace.csv"]
    assert (named / "trace.csv").read_text().startswith("time_s,host,nic,direction,rate_bps\n")
    assert _run_dirs(tmp_path) == [kept]


@needs_root
def test_run_directory_is_removed_when_the_cluster_cannot_be_built(no_leaks, tmp_path, monkeypatch):
    from mlfabric.emu import launcher

    def refuse(plan, **options):
        assert len(_run_dirs(tmp_path)) == 1  # made before the cluster
        raise RuntimeError("no bridge for you")

    monkeypatch.setattr(launcher.Cluster, "create", staticmethod(refuse))
    with pytest.raises(RuntimeError, match="no bridge for you"):
        launch(LaunchSpec(command=(PY, "-c", "pass"), hosts=2, emulate="always"), out=io.StringIO(),
               err=io.StringIO())
    assert _run_dirs(tmp_path) == []


@needs_root
def test_cli_launch_run_dir_options(no_leaks, tmp_path):
    from typer.testing import CliRunner

    from mlfabric.cli import app

    named = tmp_path / "mine"
    result = CliRunner().invoke(app, ["launch", "--hosts", "2", "--rate", "100mbit", "--run-dir", str(named), "--",
                                      PY, "-c", SEES_CLUSTER_JSON])
    assert result.exit_code == 0, result.output
    assert (named / "cluster.json").is_file() and _run_dirs(tmp_path) == []
    result = CliRunner().invoke(app, ["launch", "--hosts", "2", "--rate", "100mbit", "--keep-run-dir", "--",
                                      PY, "-c", SEES_CLUSTER_JSON])
    assert result.exit_code == 0, result.output
    assert [(d / "cluster.json").is_file() for d in _run_dirs(tmp_path)] == [True]


@needs_root
def test_failing_rank_sets_exit_status_and_others_are_stopped(no_leaks):
    script = "import os,sys,time; r=int(os.environ['RANK']); sys.exit(3) if r == 1 else time.sleep(60)"
    start = time.monotonic()
    err = io.StringIO()
    code = launch(LaunchSpec(command=(PY, "-c", script), hosts=3, rate_bps=100e6, grace_s=0.5),
                  out=io.StringIO(), err=err)
    assert code == 3
    assert "rank 1 exited with status 3" in err.getvalue()
    assert time.monotonic() - start < 15


@needs_root
def test_rank_can_reach_master_over_the_emulated_network(no_leaks):
    script = ("import os,socket,time\n"
              "r=int(os.environ['RANK']); a=os.environ['MASTER_ADDR']; p=int(os.environ['MASTER_PORT'])\n"
              "if r == 0:\n s=socket.create_server((a,p)); c,peer=s.accept(); print('from', peer[0]); c.close()\n"
              "else:\n"
              " for _ in range(100):\n"
              "  try: socket.create_connection((a,p)).close(); break\n"
              "  except OSError: time.sleep(0.05)\n")
    out = io.StringIO()
    assert launch(LaunchSpec(command=(PY, "-c", script), hosts=2, rate_bps=100e6), out=out, err=io.StringIO()) == 0
    assert out.getvalue().strip() == "[rank 0] from 10.0.0.2"


def _start_launcher(extra: list[str]) -> subprocess.Popen:
    cmd = [PY, "-m", "mlfabric.emu", "launch", "--hosts", "2", "--rate", "100mbit", *extra, "--",
           PY, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _wait_up(proc: subprocess.Popen, n: int) -> None:
    seen = 0
    deadline = time.monotonic() + 60
    while seen < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"launcher ended early: {proc.stderr.read()}"
        seen += line.endswith("] up\n")


def _rank_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "print('up', flush=True)"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_everything_down(signum, no_leaks, tmp_path):
    before = set(our_leftovers())
    proc = _start_launcher([])  # its temp dir is tmp_path (TMPDIR, see conftest.py)
    try:
        _wait_up(proc, 2)
        assert set(our_leftovers()) - before  # the cluster is up
        assert len(_run_dirs(tmp_path)) == 1  # and so is its run directory
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not set(our_leftovers()) - before
    assert _run_dirs(tmp_path) == []


@needs_root
def test_sigkill_then_cleanup_leaves_nothing(no_leaks, tmp_path):
    from mlfabric.emu.cluster import ETC_NETNS

    before = set(our_leftovers())
    proc = _start_launcher(["--churn", "N1", "--period", "0.2s"])
    try:
        _wait_up(proc, 2)
        [run_dir] = _run_dirs(tmp_path)
        assert sorted(p.name for p in run_dir.iterdir()) == ["cluster.json", "trace.csv"]
        proc.kill()
        proc.wait(timeout=10)
    finally:
        _, stderr = proc.communicate()
    prefix = re.search(r"cluster (mf[0-9a-f]{4}):", stderr).group(1)
    leftover = set(our_leftovers()) - before
    assert leftover, "a kill -9 cannot tear down; there must be something for cleanup to do"
    hosts_files = sorted(p.name for p in ETC_NETNS.glob(f"{prefix}-*"))
    assert hosts_files == [f"{prefix}-h0", f"{prefix}-h1"]  # left by the kill too
    deadline = time.monotonic() + 5
    while _rank_pids() and time.monotonic() < deadline:  # PR_SET_PDEATHSIG kills the ranks
        time.sleep(0.05)
    assert not _rank_pids()
    removed = cleanup(prefix=prefix)  # only this run: other runs on the machine are not ours
    assert leftover <= set(removed)
    assert not set(our_leftovers()) - before
    # The run directory (cluster.json, the churn trace) and the hosts files went too (#39 item 2).
    assert str(run_dir) in removed and _run_dirs(tmp_path) == []
    assert list(ETC_NETNS.glob(f"{prefix}-*")) == []


@needs_root
def test_cleanup_keeps_a_kept_run_directory(no_leaks, tmp_path):
    """Only the temporary run directory is removed after a kill: --keep-run-dir's stays."""
    proc = _start_launcher(["--keep-run-dir"])
    try:
        _wait_up(proc, 2)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        _, stderr = proc.communicate()
    prefix = re.search(r"cluster (mf[0-9a-f]{4}):", stderr).group(1)
    [kept] = _run_dirs(tmp_path)
    removed = cleanup(prefix=prefix)
    assert f"{prefix}-h0" in removed and str(kept) not in removed
    assert (kept / "cluster.json").is_file()


@needs_root
def test_bare_python_without_the_venv_on_path_runs_on_named_hosts(no_leaks):
    """`mlfabric launch -- python ...` with a PATH that lacks the venv: the ranks import torch
    and mlfabric (the launcher's interpreter), run under their host's name, resolve every
    host, and torch's store names its clients without the c10d hostname warning (#39 item 2)."""
    from pathlib import Path

    script = IMPORTS_TORCH + ("; import torch.distributed as dist; dist.init_process_group('gloo'); "
                              "print('resolved', socket.gethostbyname('h1'), socket.gethostbyname(socket.gethostname()), "
                              "flush=True); dist.barrier(); dist.destroy_process_group()")
    cli = Path(sys.executable).with_name("mlfabric")
    env = {**os.environ, "PATH": SYSTEM_PATH}
    out = subprocess.run([str(cli), "launch", "--hosts", "2", "--rate", "100mbit", "--", "python", "-c", script],
                         capture_output=True, text=True, timeout=180, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    prefix = re.search(r"cluster (mf[0-9a-f]{4}):", out.stderr).group(1)
    bin_dir = os.path.dirname(sys.executable)
    for rank in (0, 1):
        assert f"[rank {rank}] {rank} {sys.executable} {prefix}-h{rank} {bin_dir}" in out.stdout, text[-3000:]
        assert f"[rank {rank}] resolved 10.0.0.2 10.0.0.{rank + 1}" in out.stdout, text[-3000:]
    assert "hostname of the client socket cannot be retrieved" not in text
    assert f"running `python` as {sys.executable}" in out.stderr
    assert not [p for p in Path("/etc/netns").glob(f"{prefix}-*")]  # the hosts files are gone


@needs_root
def test_cli_launch_runs_an_mlfabric_job_on_an_emulated_star() -> None:
    """`mlfabric launch` end to end: a real zmq allreduce across 3 namespaces, then teardown."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "allreduce.py"
    cli = Path(sys.executable).with_name("mlfabric")
    out = subprocess.run([str(cli), "launch", "--hosts", "3", "--topology", "star", "--rate",
                          "100mbit", "--", sys.executable, str(example)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "[rank 0] Communicator(rank=0, world_size=3" in out.stdout + out.stderr
    assert "allreduce ok (every element = 3)" in out.stdout + out.stderr
    assert our_leftovers() == []


@needs_root
def test_allreduce_benchmark_on_an_emulated_star() -> None:
    """`bench allreduce --emulate`: ranks in namespaces, gloo and mlfabric both checked."""
    from mlfabric.bench.allreduce import AllreduceBenchConfig, run_allreduce_bench

    config = AllreduceBenchConfig(world_size=2, algorithms=("ring", "gloo"), sizes=(4_000_000,),
                                  iters=2, warmup=1, timeout_s=120,
                                  emulate_topology="star:n=2", emulate_rate_bps=100e6)
    result = run_allreduce_bench(config, capture_output=True)
    ring, gloo = result.get(4_000_000, "ring"), result.get(4_000_000, "gloo")
    assert ring.correct and gloo.correct
    # Each rank sends 4 MB (2(N-1)/N of it) at 100 Mbit/s: at least 0.32 s once the shaper's
    # burst allowance is spent, against a few ms on loopback. 0.2 s leaves room for the burst.
    assert ring.median_s > 0.2 and gloo.median_s > 0.2
    # The reference goodput is measured on the same cluster, and busbw is compared with it.
    assert result.two_host_goodput_bps is not None and 0.85e8 <= result.two_host_goodput_bps <= 1.02e8
    expected = ring.busbw * 8 / result.two_host_goodput_bps
    assert ring.busbw_vs_goodput == pytest.approx(expected) and 0.2 < ring.busbw_vs_goodput < 1.1
    assert result.to_dict()["two_host_goodput_bps"] == result.two_host_goodput_bps
    assert our_leftovers() == []
