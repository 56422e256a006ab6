"""A killed parameter-server worker comes back (issue #38): a restarted process of the same rank
reconnects as a new incarnation, the servers take it back, and it counts again; nothing the
old process sent is delivered once the new one is in.

    python -m pytest tests/unit/test_ps_rejoin.py -q

Threads in one process, on the tcp transport over loopback (with and without shared memory
between the first processes; the restarted rank never gets a shared-memory link). A worker is
"killed" by shutting its transport down without a goodbye: its peers see exactly what a
SIGKILL shows them (connections that end).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mlfabric.ps.config import PSConfig
from mlfabric.ps.consistency import ClockBook, Consistency
from mlfabric.ps.layout import PSLayout
from mlfabric.ps.server import ParameterServer
from mlfabric.ps.worker import PSWorker
from mlfabric.transport.base import encode_header
from mlfabric.transport.framing import add_frame
from mlfabric.transport.tcp import TcpTransport

TAG = 77


def _job(world: int, shm: bool = False) -> tuple[dist.HashStore, list[TcpTransport]]:
    store = dist.HashStore()
    out: dict[int, TcpTransport] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            out[rank] = TcpTransport.create(store, rank, world, timeout=10.0, shared_memory=shm)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    return store, [out[r] for r in range(world)]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_clock_book_rejoin_takes_the_slowest_live_clock_and_never_goes_back() -> None:
    book = ClockBook(3, Consistency(kind="bsp"), lost_worker_wait_s=0.0)
    book.clocks = [5, 2, 4]
    book.lose(1, 0.0)
    assert book.closable_rounds(1.0) == [0, 1, 2, 3]  # worker 1 given up on: rounds go to min(5, 4)
    assert book.rejoin(1, 1.0) == 4  # the slowest live worker's clock, >= the rounds closed
    assert book.counted(1.0) == [0, 1, 2] and 1 not in book.lost_at
    ssp = ClockBook(3, Consistency(kind="ssp", staleness=1))
    ssp.clocks = [3, 9, 6]
    ssp.lose(1, 0.0)
    assert ssp.rejoin(1, 0.0) == 9  # its own clock is ahead: its rounds are not pushed to twice
    alone = ClockBook(1, Consistency(kind="async"))
    alone.lose(0, 0.0)
    assert alone.rejoin(0, 0.0) == 0


def test_a_new_incarnation_replaces_the_old_and_nothing_old_is_delivered() -> None:
    store, (t0, t1) = _job(2)
    t1b = None
    try:
        t1.send(0, TAG, b"before")
        _wait(lambda: t0.mailbox.peek("0", TAG), 5, "the first message")
        assert t0.try_recv(TAG, src=1).payload.tobytes() == b"before"
        # A restarted process of rank 1 connects while the old one still has its connection open.
        t1b = TcpTransport.rejoin(store, 1, 2, 1, peers=[0], timeout=5.0)
        # The handshake records the incarnation, then reports the old process lost: wait for both.
        _wait(lambda: t0.incarnations.get(1) == 1 and 1 in t0.lost_peers, 5, "the new incarnation's handshake")
        assert "incarnation 1" in t0.lost_peers[1]
        t0.readmit(1, t1b.endpoints)
        assert 1 not in t0.lost_peers
        rejected = t0.rejected_messages
        t1.send(0, TAG, b"stale")  # the old process's connection is still up: dropped
        t1b.send(0, TAG, b"fresh")
        _wait(lambda: t0.mailbox.peek("0", TAG), 5, "the new incarnation's message")
        assert t0.try_recv(TAG, src=1).payload.tobytes() == b"fresh"
        _wait(lambda: t0.rejected_messages > rejected, 5, "the stale message to be rejected")
        # A connection that says it is incarnation 0 now is refused at the handshake.
        port = int(t0.endpoints["0"].rsplit(":", 1)[1])
        before = t0.rejected_messages
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(encode_header(t1.token, 1, 0, 0))
            parts: list[memoryview] = []
            add_frame(parts, TAG, b"", memoryview(b"injected"), 0)
            raw.sendall(b"".join(bytes(p) for p in parts))
            _wait(lambda: t0.rejected_messages > before, 5, "the old incarnation's handshake to be refused")
        time.sleep(0.2)
        assert t0.try_recv(TAG, src=1) is None
        # The server side sends to the new process, and the old one's end is no loss of it.
        t0.send(1, TAG, b"back")
        _wait(lambda: t1b.mailbox.peek("0", TAG), 5, "the answer to the new incarnation")
        t1._shutdown()  # the old process finally dies
        time.sleep(0.8)  # > GOODBYE_GRACE_S
        assert 1 not in t0.lost_peers
    finally:
        for t in (t0, t1, t1b):
            if t is not None:
                t.close()


@pytest.mark.parametrize("consistency,shm", [("bsp", False), ("bsp", True), ("ssp:1", True), ("async", False)])
def test_a_killed_worker_comes_back_and_counts_again(consistency: str, shm: bool) -> None:
    """``shm``: the first processes share memory (one host); the restarted one has TCP only."""
    layout = PSLayout(servers=1, workers=2)
    config = PSConfig(consistency=Consistency.parse(consistency), timeout_s=10.0, lost_worker_wait_s=0.3)
    store, (t0, t1, t2) = _job(3, shm)
    server = ParameterServer(t0, layout, config)
    serving = server.start()
    t2b = None
    errors: list[BaseException] = []
    steps_1 = 60
    try:
        w1, w2 = PSWorker(t1, layout, config), PSWorker(t2, layout, config)
        init = {"w": torch.zeros(8)}

        def run_w1() -> None:
            try:
                w1.init_model("m", init, lr=1.0)
                for _ in range(steps_1):
                    w1.pull("m")
                    w1.push("m", {"w": torch.ones(8)})
                    w1.clock()
                    time.sleep(0.01)
                w1.leave()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        first = threading.Thread(target=run_w1)
        first.start()
        w2.init_model("m", init, lr=1.0)
        for _ in range(3):
            w2.pull("m")
            w2.push("m", {"w": torch.ones(8)})
            w2.clock()
        _wait(lambda: (server.book.rounds_closed >= 3 if consistency == "bsp"
                       else server.stats.updates_by_worker[1] >= 3), 10, "worker 1's first updates")
        t2._shutdown()  # killed: no goodbye
        _wait(lambda: 1 in server.stats.lost_workers, 5, "the server to see worker 1 lost")
        before = server.stats.updates_by_worker[1]
        restarted = time.monotonic()
        t2b = TcpTransport.rejoin(store, 2, 3, 1, peers=[0], timeout=5.0)
        w2b = PSWorker(t2b, layout, config)
        clock = w2b.rejoin(1)
        assert clock >= 3
        w2b.init_model("m", init, lr=1.0)
        w2b.pull("m")
        rejoin_s = time.monotonic() - restarted
        steps = 0
        # Under BSP the other worker waits for this one's clock each round: step until it is done.
        while first.is_alive() or steps < 5:
            w2b.push("m", {"w": torch.ones(8)})
            w2b.clock()
            w2b.pull("m")
            steps += 1
            assert steps < 500, "the other worker never finished"
        first.join(30)
        model = w2b.pull("m")
        assert not first.is_alive() and not errors, errors
        # Worker 0 has left: nothing changes the model now; the rejoined worker's copy is the server's.
        assert torch.equal(model["w"], server.shards["m"].values)
        w2b.leave()
        serving.join(10)
        assert not serving.is_alive()
        assert server.stats.rejoined_workers == [1]
        assert server.stats.updates_by_worker[1] >= before + 5 if consistency != "bsp" else \
            server.stats.updates_by_worker[1] > before
        assert w2b.stats.rejoined_at_clock == clock and rejoin_s < 5.0
        assert not server.stats.errors, server.stats.errors
    finally:
        for t in (t1, t2b, t0):
            if t is not None:
                t.close()


def test_a_worker_that_never_returns_keeps_todays_behaviour() -> None:
    layout = PSLayout(servers=1, workers=2)
    config = PSConfig(consistency=Consistency.parse("bsp"), timeout_s=10.0, lost_worker_wait_s=0.3)
    _, (t0, t1, t2) = _job(3)
    server = ParameterServer(t0, layout, config)
    serving = server.start()
    try:
        w1, w2 = PSWorker(t1, layout, config), PSWorker(t2, layout, config)
        init = {"w": torch.zeros(4)}
        done = threading.Thread(target=w2.init_model, args=("m", init))
        done.start()
        w1.init_model("m", init)
        done.join(10)
        t2._shutdown()
        for _ in range(4):
            w1.push("m", {"w": torch.ones(4)})
            w1.clock()
            w1.pull("m")
        w1.leave()
        serving.join(10)
        assert server.stats.lost_workers == [1] and server.stats.rejoined_workers == []
        assert server.stats.updates_by_worker[0] == 4
    finally:
        for t in (t1, t0):
            t.close()


def test_rejoin_bad_input_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlfabric.ps
    from mlfabric.ps.job import incarnation_from_env

    monkeypatch.setenv("MLFABRIC_INCARNATION", "x")
    with pytest.raises(ValueError, match="MLFABRIC_INCARNATION='x'"):
        incarnation_from_env()
    monkeypatch.setenv("MLFABRIC_INCARNATION", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        incarnation_from_env()
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="rank 0 \\(server 0\\): only workers rejoin"):
        mlfabric.ps.init(incarnation=1)  # refused before any connection is tried
    with pytest.raises(ValueError, match="tcp transport only"):
        mlfabric.ps.init(incarnation=1, transport="zmq")
    with pytest.raises(ValueError, match="incarnation >= 1"):
        TcpTransport.rejoin(dist.HashStore(), 1, 2, 0, peers=[0])
    store, (t0, t1) = _job(2)
    try:
        with pytest.raises(Exception, match="no restarted incarnation of it has connected"):
            t0.readmit(1, t1.endpoints)
    finally:
        t0.close()
        t1.close()


def test_a_round_the_old_process_pushed_to_does_not_get_its_update_twice() -> None:
    """BSP: the killed process pushed round 0 but died before its clock; the restarted one
    counts from round 1, so round 0 holds its update once."""
    layout = PSLayout(servers=1, workers=2)
    config = PSConfig(consistency=Consistency.parse("bsp"), timeout_s=10.0, lost_worker_wait_s=5.0)
    store, (t0, t1, t2) = _job(3)
    server = ParameterServer(t0, layout, config)
    serving = server.start()
    t2b = None
    try:
        w1, w2 = PSWorker(t1, layout, config), PSWorker(t2, layout, config)
        init = {"w": torch.zeros(4)}
        other = threading.Thread(target=w1.init_model, args=("m", init))
        other.start()
        w2.init_model("m", init)
        other.join(10)
        w2.push("m", {"w": torch.ones(4)})  # round 0, and no clock: it dies here
        _wait(lambda: 0 in server.shards["m"].rounds, 5, "worker 1's push of round 0")
        t2._shutdown()
        _wait(lambda: 1 in server.stats.lost_workers, 5, "the loss")
        t2b = TcpTransport.rejoin(store, 2, 3, 1, peers=[0], timeout=5.0)
        w2b = PSWorker(t2b, layout, config)
        assert w2b.rejoin(1) == 1  # not 0: round 0 has its update already
        w2b.init_model("m", init)
        w1.push("m", {"w": torch.ones(4)})
        w1.clock()
        w1.pull("m")  # round 0 closed: both updates, once each
        assert server.stats.updates_by_worker == {0: 1, 1: 1}
        assert server.shards["m"].values.tolist() == pytest.approx([-0.01] * 4)  # lr 0.01 x the mean of two ones
        w1.leave()
        w2b.leave()
        serving.join(10)
        assert not server.stats.errors
    finally:
        for t in (t1, t2b, t0):
            if t is not None:
                t.close()


def test_a_rejoin_under_a_policy_that_cannot_take_workers_back_is_refused_naming_it() -> None:
    """A policy whose ``takes_back_workers`` is False (the seam's default; MLfabric's scheduled
    policy, a user's policy) refuses a restarted worker: it raises the server's refusal (it
    reaches the new process: it is readmitted first), the job goes on."""
    from dataclasses import replace

    from mlfabric.ps.policy import Policy, register_policy
    from mlfabric.ps.protocol import PSRequestError

    class KeepsWorkersOut(Policy):
        name = "test-keeps-workers-out"

    register_policy(KeepsWorkersOut.name, lambda config: KeepsWorkersOut(), replace=True)
    layout = PSLayout(servers=1, workers=2)
    config = PSConfig(consistency=Consistency.parse("ssp:1"), timeout_s=10.0, routing=KeepsWorkersOut.name)
    store, (t0, t1, t2) = _job(3)
    server = ParameterServer(t0, layout, config)
    serving = server.start()
    t2b = None
    try:
        w1 = PSWorker(t1, layout, config)
        t2._shutdown()
        _wait(lambda: 2 in t0.lost_peers, 5, "the loss")
        t2b = TcpTransport.rejoin(store, 2, 3, 1, peers=[0], timeout=5.0)
        started = time.monotonic()
        with pytest.raises(PSRequestError, match="cannot rejoin under routing 'test-keeps-workers-out'"):
            PSWorker(t2b, layout, replace(config, routing="direct")).rejoin(1)
        assert time.monotonic() - started < 2.0
        assert server.stats.rejoined_workers == []
        w1.leave()
    finally:
        for t in (t1, t2b, t0):
            if t is not None:
                t.close()
        serving.join(10)
