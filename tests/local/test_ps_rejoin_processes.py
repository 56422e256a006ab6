"""A parameter-server worker SIGKILLed and started again as a new process (issue #38): it
rejoins the running job (``MLFABRIC_INCARNATION=1``, the same rank and rendezvous), is
counted again under BSP, SSP and async, and ends with the servers' model.

    python -m pytest tests/local/test_ps_rejoin_processes.py -q

Processes on loopback: server 0 (rank 0, which also serves the rendezvous store), workers
ranks 1 and 2; the first job's peers share memory (same host), so the killed worker's
shared-memory link is replaced by the restarted one's TCP connections. Rank 0 starts the
restarted process itself (a subprocess with the killed rank's environment) once it has seen
the worker lost, ``AFTER_S`` later, and reports what it measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mlfabric.bench.procs import run_ranks

pytestmark = pytest.mark.local

CONSISTENCY_ENV = "MLFABRIC_TEST_PS_CONSISTENCY"
VICTIM = 2
AFTER_S = 0.5
ROOT = Path(__file__).resolve().parents[2]


def _job() -> Any:
    import mlfabric.ps

    return mlfabric.ps.init(consistency=os.environ.get(CONSISTENCY_ENV, "bsp"), transport="tcp", timeout=20.0,
                            lost_worker_wait_s=0.5)


def _steps(w: Any, stop: Any, at_least: int) -> int:
    n = 0
    while n < at_least or not stop():
        w.push("m", {"w": torch.ones(16)})
        w.clock()
        w.pull("m")
        n += 1
        time.sleep(0.01)
    return n


def train_until_back(w: Any, back: Path, steps_after: int) -> int:
    """A surviving worker's loop: push, clock, pull until ``steps_after`` steps after the file
    ``back`` (the restarted worker's sign) appeared, within 40 s; returns its steps."""
    steps, since = 0, 0
    deadline = time.monotonic() + 40
    while since < steps_after and time.monotonic() < deadline:
        w.push("m", {"w": torch.ones(16)})
        w.clock()
        w.pull("m")
        steps += 1
        since += back.exists()
        time.sleep(0.02)
    return steps


def restarted() -> None:
    """The restarted worker (run by rank 0 as ``python -c``): rejoin, train until the other
    worker has left (its file), and print what it saw as JSON."""
    started = time.time()
    job = _job()
    w = job.worker
    rejoined = time.time()
    w.init_model("m", {"w": torch.zeros(16)}, lr=1.0)
    first = w.pull_flat("m").clone()
    Path(os.environ["MLFABRIC_TEST_DONE_FILE"]).with_name("worker-1-back").touch()
    done = Path(os.environ["MLFABRIC_TEST_DONE_FILE"])
    steps = _steps(w, done.exists, 5)
    model = w.pull_flat("m")
    print(json.dumps({"started": started, "rejoined": rejoined, "clock": w.stats.rejoined_at_clock, "steps": steps,
                      "first_pull": first.tolist(), "model": model.tolist()}), flush=True)
    job.close()


def _rank(tmp: str) -> Any:
    job = _job()
    done = Path(tmp) / "worker-0-done"
    try:
        if job.role == "server":
            thread = job.server.start()
            server = job.server
            deadline = time.monotonic() + 20
            while 1 not in server.stats.lost_workers:
                assert time.monotonic() < deadline, "worker 1 was never lost"
                time.sleep(0.01)
            lost_at = time.time()
            time.sleep(AFTER_S)
            before = server.stats.updates_by_worker[1]
            env = {**os.environ, "RANK": str(VICTIM), "LOCAL_RANK": str(VICTIM), "MLFABRIC_INCARNATION": "1",
                   "MLFABRIC_TEST_DONE_FILE": str(done), "PYTHONPATH": str(ROOT)}
            spawned = time.time()
            proc = subprocess.run([sys.executable, "-c", "from tests.local.test_ps_rejoin_processes import restarted; "
                                   "restarted()"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr[-3000:]
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
            thread.join(20)
            assert not thread.is_alive()
            final = next(iter(server.shards.values())).values.tolist()
            return {"stats": server.stats.as_dict(), "lost_at": lost_at, "spawned": spawned, "before": before,
                    "restarted": seen,
                    "final": final}
        w = job.worker
        w.init_model("m", {"w": torch.zeros(16)}, lr=1.0)
        if job.rank == VICTIM:
            _steps(w, lambda: True, 3)
            os.kill(os.getpid(), signal.SIGKILL)
        # Worker 0 goes on until the restarted worker has taken part for a while.
        steps = train_until_back(w, Path(tmp) / "worker-1-back", 20)
        done.touch()
        return {"steps": steps}
    finally:
        job.close()


@pytest.mark.parametrize("consistency", ["bsp", "ssp:1", "async"])
def test_a_sigkilled_worker_restarts_and_rejoins(consistency: str, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv(CONSISTENCY_ENV, consistency)
    results = run_ranks(_rank, 3, args=(str(tmp_path),), timeout=90, expect_failures={VICTIM})
    server = results[0]
    stats, seen = server["stats"], server["restarted"]
    assert stats["rejoined_workers"] == [1] and stats["lost_workers"] == [1]
    assert stats["errors"] == []
    # Counted again: the restarted worker's updates were applied after it came back.
    assert stats["updates_by_worker"]["1"] > server["before"]
    assert seen["clock"] >= 3 and seen["steps"] >= 5
    # Its last pull, after the other worker left, is the servers' final model.
    assert seen["model"] == server["final"]
    rejoin_s = seen["rejoined"] - seen["started"]
    assert rejoin_s < 5.0, rejoin_s
    print(f"{consistency}: rejoin (init to taken back) {rejoin_s:.3f} s; process start to taken back "
          f"{seen['rejoined'] - server['spawned']:.3f} s")
