"""A parameter-server worker SIGKILLed a second into training and restarted half a second
later as a new process, which rejoins and trains to the end (issue #38): ``mlfabric train
--sync ps-bsp --fail worker:1@1 --rejoin 0.5`` end to end, and the same under SSP on MLNET's
trees and under async through :func:`mlfabric.train.ps_rejoin.run_ps_rejoin`.

    .venv/bin/python -m pytest tests/local/test_ps_rejoin_train.py -q

Short on purpose (1 server + 3 workers, a 64-wide hyperplane, 20 ms of emulated compute per
step, 210 steps): the machine running the suite may be small and shared. The command line's
run is the fault-free launch and the one with the kill; the others compare their final
metric with the data's noise floor (the label noise's variance, 4.0) instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlfabric.train.ps_rejoin import LOST_WORKER_WAIT_S

pytestmark = pytest.mark.local

ARGS = ["--workload", "hyperplane", "--workers", "3", "--servers", "1", "--fail", "worker:1@1", "--rejoin", "0.5",
        "--dim", "64", "--train-samples", "2048", "--batch-size", "32", "--epochs", "10", "--compute-time", "20ms",
        "--timeout", "150"]


def _check_run(run: dict[str, Any], mode: str) -> None:
    assert run["mode"] == mode and run["steps"] == 10 * 21
    # The kill happened, then the restart, and the servers took worker 1 back.
    assert [(e["event"], e["worker"]) for e in run["events"]] == [("kill", 1), ("restart", 1)]
    assert run["lost_workers"] == [1] and run["rejoined_workers"] == [1] and run["rejoined_too_late"] == []
    assert run["final_members"] == [0, 1, 2]
    assert [m["members"] for m in run["members"]] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    # The restarted process trained (its steps counted apart from the killed one's).
    assert run["worker_steps"]["1.1"] > 0 and run["worker_steps"]["0"] >= run["worker_steps"]["1.1"]
    (recovery,), (rejoin,), (stall,) = run["recovery_s"], run["rejoin_s"], run["stall_s"]
    assert 0 < recovery < 5.0, run
    assert 0 < rejoin < 30.0 and 0 < run["rejoin_startup_s"][0] < rejoin, run
    if mode == "ps-bsp":
        # the survivors' rounds waited for the loss to be seen, then the lost-worker wait
        assert stall >= LOST_WORKER_WAIT_S and recovery >= LOST_WORKER_WAIT_S, run
    assert 4.0 < run["final_metric"] < 4.5  # the noise floor, reached


def test_cli_kills_a_bsp_worker_restarts_it_and_compares_with_a_fault_free_run(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "mlfabric.cli", "train", *ARGS, "--sync", "ps-bsp",
                           "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    _check_run(run, "ps-bsp")
    assert run["baseline_final_metric"] is not None and abs(run["metric_ratio"] - 1) < 0.05, run
    assert "recovery" in proc.stdout and "rejoined [1]" in proc.stdout


@pytest.mark.parametrize("mode", ["mlnet-tree:1+ssp:1", "ps-async"])
def test_a_killed_ssp_or_async_worker_restarts_and_rejoins(mode: str, tmp_path: Path) -> None:
    """SSP under MLNET's trees (a chain server <- w0 <- w1 <- w2: the killed w1 is the middle,
    w0 adopts w2, the restarted w1 re-enters as w0's leaf), async under direct routing."""
    from mlfabric.train.failover import parse_fail
    from mlfabric.train.harness import EagerTrainConfig
    from mlfabric.train.ps_rejoin import PSRejoinConfig, run_ps_rejoin
    from mlfabric.train.workloads import HyperplaneSpec

    train = EagerTrainConfig(workload="hyperplane", workers=3, servers=1, modes=(mode,), batch_size=32, epochs=10,
                             hyperplane=HyperplaneSpec(dim=64, train_samples=2048, compute_time_s=0.02),
                             timeout_s=150)
    config = PSRejoinConfig(train=train, failures=parse_fail("worker:1@1", workers=3).workers, rejoin_s=0.5,
                            baseline=False)
    run = run_ps_rejoin(config, log_dir=tmp_path).to_dict()
    _check_run(run, mode)
    assert run["baseline_final_metric"] is None and run["metric_ratio"] is None


def test_a_run_past_its_timeout_names_the_ranks_still_running_and_keeps_their_logs() -> None:
    """Bounded: a run that cannot finish in time (here: 2 s, less than the ranks' start) is
    stopped, every process killed, and the error names the ranks still running, shows their
    logs' ends and says where the logs are (kept, although the directory is a temporary one)."""
    import shutil

    from mlfabric.train.failover import parse_fail
    from mlfabric.train.harness import EagerTrainConfig
    from mlfabric.train.ps_rejoin import PSRejoinConfig, PSRejoinError, run_ps_rejoin
    from mlfabric.train.workloads import HyperplaneSpec

    train = EagerTrainConfig(workload="hyperplane", workers=2, servers=1, modes=("ps-bsp",), batch_size=32,
                             hyperplane=HyperplaneSpec(dim=16, train_samples=1024), timeout_s=2)
    config = PSRejoinConfig(train=train, failures=parse_fail("worker:1@1", workers=2).workers, baseline=False)
    with pytest.raises(PSRejoinError, match=r"within its timeout \(2 s, --timeout\); ranks still running: \[") as info:
        run_ps_rejoin(config)
    kept = Path(str(info.value).rsplit("kept in ", 1)[1].rstrip(")"))
    try:
        assert (kept / "run" / "rank0-0.log").exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
