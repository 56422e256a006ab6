"""MLNET's recovered node re-enters the tree (MLNET §3, issue #38): an interior node of a chain
(server <- w0 <- w1 <- w2) is SIGKILLed, its child is adopted by w0, and the worker's restarted
process (``MLFABRIC_INCARNATION=1``) re-enters the tree as a leaf of w0, gets its model through
the tree, and trains on; every survivor's update is applied exactly once, before and after.

    python -m pytest tests/local/test_ps_mlnet_rejoin_processes.py -q

Processes on loopback: server 0 (rank 0, which also serves the rendezvous store and starts
the restarted process once it has seen the worker lost), workers 0-2 (ranks 1-3); worker 1
(rank 2) is the victim.
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
from tests.local.test_ps_rejoin_processes import ROOT, _steps, train_until_back

pytestmark = pytest.mark.local

CONSISTENCY_ENV = "MLFABRIC_TEST_PS_CONSISTENCY"
VICTIM = 2  # worker 1: the middle of the chain
SURVIVORS = (1, 3)


def _job() -> Any:
    import mlfabric.ps
    from mlfabric.ps.policies.mlnet import MLNetSettings

    return mlfabric.ps.init(consistency=os.environ.get(CONSISTENCY_ENV, "bsp"), transport="tcp", timeout=20.0,
                            lost_worker_wait_s=0.5, routing="mlnet", mlnet=MLNetSettings(tree="tree:1"))


def _done_files(tmp: Path) -> list[Path]:
    return [tmp / f"rank-{rank}-done" for rank in SURVIVORS]


def restarted() -> None:
    """The restarted worker (run by rank 0 as ``python -c``): rejoin, train until the others
    have finished, and print what it saw as JSON."""
    started = time.time()
    job = _job()
    w = job.worker
    rejoined = time.time()
    w.init_model("m", {"w": torch.zeros(16)}, lr=1.0)
    first = w.pull_flat("m").clone()
    tmp = Path(os.environ["MLFABRIC_TEST_TMP"])
    (tmp / "worker-1-back").touch()
    steps = _steps(w, lambda: all(f.exists() for f in _done_files(tmp)), 5)
    model = w.pull_flat("m")
    print(json.dumps({"started": started, "rejoined": rejoined, "clock": w.stats.rejoined_at_clock, "steps": steps,
                      "first_pull": first.tolist(), "model": model.tolist(),
                      "node": w.routing.stats.as_dict()}), flush=True)
    job.close()


def _rank(tmp_text: str) -> Any:
    tmp = Path(tmp_text)
    job = _job()
    try:
        if job.role == "server":
            thread = job.server.start()
            server = job.server
            deadline = time.monotonic() + 20
            while 1 not in server.stats.lost_workers:
                assert time.monotonic() < deadline, "worker 1 was never lost"
                time.sleep(0.01)
            time.sleep(0.3)
            before = server.stats.updates_by_worker[1]
            env = {**os.environ, "RANK": str(VICTIM), "LOCAL_RANK": str(VICTIM), "MLFABRIC_INCARNATION": "1",
                   "MLFABRIC_TEST_TMP": str(tmp), "PYTHONPATH": str(ROOT)}
            proc = subprocess.run([sys.executable, "-c", "from tests.local.test_ps_mlnet_rejoin_processes import "
                                   "restarted; restarted()"], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=60)
            assert proc.returncode == 0, proc.stderr[-3000:]
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
            thread.join(20)
            assert not thread.is_alive()
            final = next(iter(server.shards.values())).values.tolist()
            return {"stats": server.stats.as_dict(), "before": before, "restarted": seen, "final": final}
        w = job.worker
        w.init_model("m", {"w": torch.zeros(16)}, lr=1.0)
        if job.rank == VICTIM:
            _steps(w, lambda: True, 3)
            os.kill(os.getpid(), signal.SIGKILL)
        steps = train_until_back(w, tmp / "worker-1-back", 15)
        (tmp / f"rank-{job.rank}-done").touch()
        return {"steps": steps, "node": w.routing.stats.as_dict()}
    finally:
        job.close()


@pytest.mark.parametrize("consistency", ["bsp", "ssp:1"])
def test_a_restarted_interior_node_re_enters_the_tree_as_a_leaf(consistency: str, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv(CONSISTENCY_ENV, consistency)
    results = run_ranks(_rank, 4, args=(str(tmp_path),), timeout=90, expect_failures={VICTIM})
    server = results[0]
    stats, seen = server["stats"], server["restarted"]
    assert stats["lost_workers"] == [1] and stats["rejoined_workers"] == [1]
    assert stats["errors"] == []
    w0, w2 = results[1], results[3]
    # The chain was repaired (w0 adopted w2), then w0 took the restarted worker back as a leaf;
    # nobody fell back to direct push and pull.
    assert w0["node"]["adopted"] >= 1 and w0["node"]["taken_back"] == [1]
    assert [r["node"]["fallbacks"] for r in (w0, w2)] == [0, 0] and seen["node"]["fallbacks"] == 0
    # Every survivor's update applied exactly once, across the repair and the re-entry; the
    # restarted worker's, all of them, through the tree.
    by_worker = stats["updates_by_worker"]
    assert by_worker["0"] == w0["steps"] and by_worker["2"] == w2["steps"]
    assert by_worker["1"] == server["before"] + seen["steps"]
    assert seen["clock"] >= 3 and seen["steps"] >= 5
    # Restored through the tree: its first pull is a model with the others' progress in it;
    # its last pull, after the others left, the server's final model; that is, under SSP, exactly minus
    # the updates applied, each as its 1/3 share of the job (lr 1, ones; BSP applies each
    # round's mean).
    assert seen["first_pull"][0] <= -3
    if consistency == "bsp":
        assert seen["model"] == server["final"]
    else:  # SSP(1) may answer its last pull from its parent's copy, without its own last update
        lag = seen["model"][0] - server["final"][0]
        assert 0 <= lag <= 1 / 3 + 1e-4, lag
    if consistency != "bsp":
        assert server["final"] == pytest.approx([-sum(by_worker.values()) / 3] * 16, rel=1e-5)
    rejoin_s = seen["rejoined"] - seen["started"]
    assert rejoin_s < 5.0, rejoin_s
    print(f"mlnet {consistency}: rejoin (init to taken back) {rejoin_s:.3f} s at clock {seen['clock']}")
