"""The parameter server with real processes on loopback (plain TCP transport): a job that
trains, and the faults: a server SIGKILLed, a worker SIGKILLed (BSP, SSP, async), a worker
that leaves early, bad input. Each fault test asserts the time to the error or to going on.

    python -m pytest tests/local/test_ps_processes.py -q
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from mlfabric.bench.procs import run_ranks

pytestmark = pytest.mark.local

CONSISTENCY_ENV = "MLFABRIC_TEST_PS_CONSISTENCY"


def _job(timeout: float = 20.0, lost_wait: float | None = None) -> Any:
    import mlfabric.ps

    return mlfabric.ps.init(consistency=os.environ.get(CONSISTENCY_ENV, "bsp"), transport="tcp", timeout=timeout,
                            lost_worker_wait_s=lost_wait)


def _train(steps: int) -> Any:
    """Every worker: pull, push its gradient of a quadratic, clock; the server's stats."""
    job = _job()
    try:
        if job.role != "worker":
            return job.serve().as_dict()
        w = job.worker
        w.init_model("m", {"w": torch.zeros(1000), "b": torch.zeros(10)}, lr=0.1)
        for _ in range(steps):
            params = w.pull_flat("m")
            w.push("m", params - (w.index + 1))
            w.clock()
        return w.pull_flat("m")[:3].tolist()
    finally:
        job.close()


@pytest.mark.parametrize("consistency", ["bsp", "ssp:1", "async:4"])
def test_training_over_tcp(consistency: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONSISTENCY_ENV, consistency)
    monkeypatch.setenv("MLFABRIC_PS_SERVERS", "2")
    results = run_ranks(_train, 5, args=(6,), timeout=60)
    servers = results[:2]
    for stats in servers:
        assert stats["worker_updates"] + stats["dropped"] == 18 and stats["errors"] == []
        assert stats["bytes_in"] >= 18 * 505 * 4  # every push carried its half of the model
    if consistency == "bsp":
        # Synchronous SGD on the mean target (2): w <- w - 0.1 (w - 2), from 0, six times.
        expected = 2 * (1 - 0.9 ** 6)
        for values in results[2:]:
            assert values == pytest.approx([expected] * 3, rel=1e-5)
    if consistency == "async:4":
        assert max(int(k) for k in servers[0]["delays"]) <= 4


def _server_killed(victim: int, kill_file: str) -> str:
    job = _job()
    try:
        if job.role != "worker":
            if job.rank == victim:
                job.server.start()
                time.sleep(1.5)  # the workers are in their pulls by now
                with open(kill_file, "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            job.serve()
            return "served"
        w = job.worker
        w.init_model("m", torch.zeros(100), lr=0.1)
        w.push("m", torch.ones(100))
        w.clock()
        if w.index == 0:
            # Never clocks again: the others' BSP pulls wait in the server until it dies.
            deadline = time.monotonic() + 20
            while victim not in job.comm.transport.lost_peers and time.monotonic() < deadline:
                time.sleep(0.05)
            return "held the round"
        try:
            w.push("m", torch.ones(100))
            w.clock()
            w.pull("m")
            w.pull("m")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return f"{type(exc).__name__}|{time.time()!r}|{getattr(exc, 'peer', None)}|{exc}"
        return "no error"
    finally:
        job.close()


@pytest.mark.parametrize("servers,victim", [(1, 0), (2, 1)])
def test_server_killed_every_worker_raises_peer_lost_within_2s(servers: int, victim: int, tmp_path: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFABRIC_PS_SERVERS", str(servers))
    kill_file = tmp_path / "killed_at"
    results = run_ranks(_server_killed, servers + 3, args=(victim, str(kill_file)), timeout=60,
                        expect_failures={victim})
    killed_at = float(kill_file.read_text())
    assert results[servers] == "held the round"
    waiting = results[servers + 1:]
    assert len(waiting) == 2
    for line in waiting:
        kind, raised_at, peer, message = line.split("|", 3)
        assert kind == "PeerLostError" and int(peer) == victim, line
        assert f"rank {victim} (server {victim}) was lost" in message, line
        assert 0 < float(raised_at) - killed_at < 2.0, line


def _worker_killed(steps: int) -> Any:
    job = _job(timeout=20, lost_wait=3.0)
    try:
        if job.role != "worker":
            return job.serve().as_dict()
        w = job.worker
        w.init_model("m", torch.zeros(100), lr=0.1)
        waits = []
        for step in range(steps):
            if w.index == 2 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            w.push("m", torch.ones(100))
            w.clock()
            started = time.monotonic()
            w.pull_flat("m")
            waits.append(time.monotonic() - started)
        return waits
    finally:
        job.close()


@pytest.mark.parametrize("consistency", ["bsp", "ssp:1", "async"])
def test_worker_killed(consistency: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONSISTENCY_ENV, consistency)
    results = run_ranks(_worker_killed, 4, args=(5,), timeout=60, expect_failures={3})
    server = results[0]
    assert server["lost_workers"] == [2] and sorted(server["departed_workers"]) == [0, 1]
    longest = max(max(results[1]), max(results[2]))
    if consistency == "bsp":
        # One round waits out lost_worker_wait_s (3 s) and then goes on without worker 2.
        assert 2.0 <= longest < 3.0 + 2.0
        assert [tuple(r) for r in server["missing_rounds"]][0][1] == [2]
    else:
        assert longest < 2.0  # the survivors are not held back
    assert server["errors"] == []


def _leaves_early() -> Any:
    job = _job(timeout=20, lost_wait=10.0)
    try:
        if job.role != "worker":
            return job.serve().as_dict()
        w = job.worker
        w.init_model("m", torch.zeros(10), lr=0.1)
        if w.index == 1:
            return 0.0  # job.close() below: the worker leaves cleanly, its process ends
        time.sleep(0.5)
        started = time.monotonic()
        for _ in range(4):
            w.push("m", torch.ones(10))
            w.clock()
            w.pull_flat("m")
        return time.monotonic() - started
    finally:
        job.close()


def test_worker_that_leaves_early_is_not_waited_for() -> None:
    results = run_ranks(_leaves_early, 3, timeout=60)
    assert results[1] < 2.0 and results[0]["departed_workers"] == [1, 0] and results[0]["updates_applied"] == 4


def _bad_input() -> list[str]:
    job = _job()
    out = []
    try:
        if job.role != "worker":
            job.serve()
            return out
        w = job.worker
        for call in (lambda: w.pull("m"), lambda: w.init_model("m", {"w": torch.zeros(2, 2)}, lr=0.1),
                     lambda: w.push("m", {"w": torch.zeros(3)}),
                     lambda: w.push("m", {"w": torch.zeros(2, 2, dtype=torch.float64)}),
                     lambda: w.push("m", {"v": torch.zeros(2, 2)})):
            started = time.monotonic()
            try:
                call()
                out.append("ok")
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append(f"{time.monotonic() - started:.3f}|{exc}")
        return out
    finally:
        job.close()


def test_bad_input_is_named_on_the_caller_at_once() -> None:
    results = run_ranks(_bad_input, 2, timeout=60)
    before_init, init, shape, dtype, key = results[1]
    assert init == "ok"
    for line, words in ((before_init, ["pull('m') before init_model('m')"]),
                        (shape, ["key 'w'", "shape (3,), expected (2, 2)"]),
                        (dtype, ["key 'w'", "dtype float64, expected float32"]), (key, ["unknown key 'v'"])):
        elapsed, message = line.split("|", 1)
        assert float(elapsed) < 0.5 and "rank 1 (worker 0)" in message, line
        for word in words:
            assert word in message, line


def _failover(kill_file: str) -> Any:
    job = _job(timeout=20)
    try:
        if job.role == "server":
            job.server.start()
            time.sleep(1.5)
            with open(kill_file, "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if job.role != "worker":
            stats = job.serve()  # the replica: mirrors, then takes over
            return stats.as_dict() if hasattr(stats, "as_dict") else stats
        w = job.worker
        w.init_model("m", torch.zeros(1000), lr=0.1)
        waits = []
        for _ in range(40):
            started = time.monotonic()
            params = w.pull_flat("m")
            waits.append((time.time(), time.monotonic() - started))
            w.push("m", params - 1)
            w.clock()
            time.sleep(0.05)
        return w.failovers, waits, float(w.pull_flat("m")[0])
    finally:
        job.close()


def test_a_replica_takes_over_a_killed_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONSISTENCY_ENV, "async")
    monkeypatch.setenv("MLFABRIC_PS_REPLICAS", "1")
    kill_file = tmp_path / "killed_at"
    results = run_ranks(_failover, 4, args=(str(kill_file),), timeout=60, expect_failures={0})
    killed_at = float(kill_file.read_text())
    promoted = results[1]
    assert promoted["server"] == 0 and promoted["worker_updates"] > 10 and promoted["errors"] == []
    for failovers, waits, final in results[2:]:
        assert failovers == 1 and final > 0.5
        # the first pull after the kill waited for the failover: under 2 s, as every other pull
        assert max(wait for _, wait in waits) < 2.0
        assert any(at > killed_at for at, _ in waits)  # training went on after the kill


def test_train_runs_a_ps_mode_with_a_replica_beside_the_server() -> None:
    """``mlfabric train --replicas 1``: the replica is a process of its own (rank 1), the workers
    shift after it, and the server's traffic to it is reported (chain replication)."""
    from mlfabric.train.harness import EagerTrainConfig, run_eager_training
    from mlfabric.train.workloads import HyperplaneSpec

    config = EagerTrainConfig(workload="hyperplane", workers=2, modes=("ps-bsp",), servers=1, replicas=1,
                              epochs=2, batch_size=64, hyperplane=HyperplaneSpec(dim=64, train_samples=1024),
                              transport="tcp", timeout_s=120.0)
    result = run_eager_training(config, argv=["test"])
    (run,) = result.runs
    assert run.ps is not None and run.ps["worker_updates_applied"] == 2 * config.steps
    model_bytes = (64 + 1) * 4  # the hyperplane's linear model
    # the model once, then every applied round (one per step) forwarded to the replica
    assert run.ps["replica_bytes"] == model_bytes * (1 + config.steps)
    assert run.curve[-1].val_metric < run.curve[0].val_metric


def test_train_checkpoints_the_servers_every_n_versions() -> None:
    """``mlfabric train --checkpoint-every 4``: the checkpoint baseline of MLfabric §7.3, counted
    in runs[] (one file write per 4 BSP rounds), its directory gone after the run."""
    import glob
    import tempfile

    from mlfabric.train.harness import EagerTrainConfig, run_eager_training
    from mlfabric.train.workloads import HyperplaneSpec

    before = set(glob.glob(f"{tempfile.gettempdir()}/mlfabric-checkpoints-*"))
    config = EagerTrainConfig(workload="hyperplane", workers=2, modes=("ps-bsp",), servers=1, epochs=2,
                              batch_size=64, hyperplane=HyperplaneSpec(dim=64, train_samples=1024),
                              transport="tcp", timeout_s=120.0, checkpoint_every=4)
    (run,) = run_eager_training(config, argv=["test"]).runs
    assert run.ps is not None and run.ps["checkpoints"] == config.steps // 4 and run.ps["checkpoint_s"] > 0
    assert set(glob.glob(f"{tempfile.gettempdir()}/mlfabric-checkpoints-*")) == before
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0"):
        EagerTrainConfig(checkpoint_every=-1)
