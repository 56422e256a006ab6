"""Elastic training with real processes on loopback: a SIGKILLed worker, survivors that go on,
the worker restarted and rejoining, and the command line's figures.

    .venv/bin/python -m pytest tests/local/test_elastic_processes.py -q

Short runs on purpose (3 workers, a 64-wide hyperplane, a few dozen steps): the machine
running the suite may be small and shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlfabric.train.elastic import ElasticRunConfig, parse_failures, run_elastic_training

pytestmark = pytest.mark.local


def test_a_killed_worker_is_survived_and_rejoins(tmp_path: Path) -> None:
    config = ElasticRunConfig(workers=3, failures=parse_failures("worker:1@1", 3), rejoin_s=0.5, dim=64,
                              train_samples=3072, batch_size=64, epochs=12, compute_time_s=0.1, timeout_s=240)
    result = run_elastic_training(config, log_dir=tmp_path)
    assert result.parameters_equal, result
    assert result.final_members == [0, 1, 2]
    assert len(result.recovery_s) == 1 and 0 < result.recovery_s[0] < 10
    assert len(result.rejoin_s) == 1 and result.rejoin_s[0] > 0
    epochs = [change["members"] for change in result.members]
    assert epochs[0] == [0, 1, 2] and [0, 2] in epochs and epochs[-1] == [0, 1, 2]
    assert result.steps_lost >= 1
    assert result.transferred_bytes and min(result.transferred_bytes) > 64 * 4


def test_cli_writes_the_elastic_figures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "mlfabric.cli", "train", "--workload", "hyperplane", "--workers", "2",
                           "--sync", "allreduce", "--elastic", "--dim", "16", "--train-samples", "512",
                           "--batch-size", "64", "--epochs", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert {"recovery_s", "rejoin_s", "steps_lost", "members", "parameters_equal"} <= set(run)
    assert run["parameters_equal"] is True and run["steps"] == 4
    assert run["recovery_s"] == [] and run["rejoin_s"] == [] and run["steps_lost"] == 0
    assert run["members"] == [{"epoch": 0, "members": [0, 1], "reason": "start"}]


def test_example_worker_killed_by_hand_and_restarted(tmp_path: Path) -> None:
    """examples/elastic.py as its docstring runs it: a store process, three workers started by
    hand, one SIGKILLed and started again; every worker alive at the end has the same state."""
    import os
    import re
    import signal
    import time

    from mlfabric.bench.procs import free_port

    example = Path(__file__).resolve().parents[2] / "examples" / "elastic.py"
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in ("store", "w0", "w1", "w2", "w1b")}

    def start(name: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(example), *args], env=env, stdout=logs[name].open("w"),
                                stderr=subprocess.STDOUT)

    procs = {"store": start("store", "store", "--port", port, "--serve-s", "200")}
    try:
        time.sleep(1.0)
        for m in range(3):
            procs[f"w{m}"] = start(f"w{m}", "worker", "--port", port, "--member", str(m), "--initial", "0,1,2",
                                   "--steps", "300", "--step-time", "0.05")
        deadline = time.monotonic() + 120
        while "epoch 0" not in logs["w1"].read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        procs["w1"].send_signal(signal.SIGKILL)
        procs["w1b"] = start("w1b", "worker", "--port", port, "--member", "1", "--steps", "300", "--step-time", "0.05")
        for name in ("w0", "w2", "w1b"):
            procs[name].wait(timeout=180)
        texts = {name: logs[name].read_text() for name in ("w0", "w2", "w1b")}
        crcs = {name: re.search(r"state crc32 (0x[0-9a-f]+)", text) for name, text in texts.items()}
        assert all(crcs.values()), texts
        assert len({m[1] for m in crcs.values()}) == 1, texts  # type: ignore[index]
        assert "members [0, 2]" in texts["w0"] and "members [0, 1, 2]" in texts["w1b"], texts
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
