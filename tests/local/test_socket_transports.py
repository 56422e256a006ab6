"""The TCP transports (zmq and plain tcp) with real processes on loopback: correctness,
traffic, faults, intruders. Each test runs once per transport; the ranks read which one
from ``MLFABRIC_TEST_TRANSPORT``, which the ``transport`` fixture sets before they start.

Run: python -m pytest tests/local/test_socket_transports.py
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import pytest
import torch
import zmq

import mlfabric
from mlfabric.bench.procs import run_ranks
from mlfabric.collectives import build
from mlfabric.transport.base import encode_header

pytestmark = pytest.mark.local

TRANSPORT_ENV = "MLFABRIC_TEST_TRANSPORT"


@pytest.fixture(params=["zmq", "tcp"])
def transport(request, monkeypatch) -> str:
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    return request.param


def _init(timeout: float = 30.0) -> mlfabric.Communicator:
    """Rank, world size and rendezvous come from the torchrun variables run_ranks sets."""
    return mlfabric.init(os.environ[TRANSPORT_ENV], timeout=timeout)


def _rank_input(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 9, (count,), generator=g).to(dtype)


def _correctness() -> int:
    comm = _init()
    checked = 0
    for seed, alg in enumerate(("ring", "halving_doubling", "tree", "auto")):
        for count in (0, 1, 7, 1000, 1_000_000):
            for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
                for op in ("sum", "avg", "max"):
                    if count == 1_000_000 and (dtype in (torch.float16, torch.bfloat16) or op == "avg"):
                        continue
                    t = _rank_input(comm.rank, count, dtype, seed)
                    everyone = torch.stack([_rank_input(r, count, dtype, seed).double()
                                            for r in range(comm.world_size)])
                    if op == "max":
                        expected = everyone.max(0).values if count else everyone.sum(0)
                    else:
                        expected = everyone.sum(0)
                        if op == "avg":
                            expected = (expected / comm.world_size if dtype.is_floating_point
                                        else torch.floor(expected / comm.world_size))
                    comm.allreduce(t, algorithm=alg, op=op)
                    if dtype.is_floating_point and op == "avg":
                        torch.testing.assert_close(t.double(), expected, rtol=1e-2, atol=1e-2)
                    else:
                        assert torch.equal(t, expected.to(dtype)), (alg, count, dtype, op)
                    checked += 1
    b = torch.arange(10.0) if comm.rank == 1 else torch.zeros(10)
    comm.broadcast(b, root=1)
    assert torch.equal(b, torch.arange(10.0))
    gathered = comm.allgather(torch.tensor([comm.rank]))
    assert gathered.flatten().tolist() == list(range(comm.world_size))
    comm.close()
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_correct(transport: str, world: int) -> None:
    results = run_ranks(_correctness, world, timeout=240)
    assert len(set(results)) == 1 and results[0] > 100


def _traffic(count: int) -> dict[str, tuple[int, int]]:
    comm = _init()
    out = {}
    for alg in ("ring", "halving_doubling", "tree"):
        comm.transport.reset_counters()
        comm.allreduce(torch.ones(count, dtype=torch.float32), algorithm=alg)
        stated = build(f"allreduce:{alg}", comm.world_size, comm.rank, count, op="sum").cost
        out[alg] = (comm.transport.bytes_sent(), stated.bytes_sent(4))
    comm.close()
    return out


def test_bytes_equal_stated_cost(transport: str) -> None:
    for per_rank in run_ranks(_traffic, 3, args=(300_001,), timeout=120):
        for alg, (counted, stated) in per_rank.items():
            assert counted == stated, alg
            assert counted > 0


def _mismatch() -> tuple[str, float]:
    comm = _init(timeout=60)
    count = 999 if comm.rank == 1 else 1000
    start = time.monotonic()
    try:
        comm.allreduce(torch.ones(count), algorithm="ring")
    except mlfabric.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        comm.close()
    return "no error", time.monotonic() - start


def test_size_mismatch_errors_on_every_rank(transport: str) -> None:
    # Timed inside each rank, from the collective's start: on a loaded 2-core CI machine,
    # starting four Python+torch processes alone took over 20 s once, which says nothing
    # about how fast a mismatch is detected.
    results = run_ranks(_mismatch, 4, timeout=180)
    messages = [message for message, _ in results]
    assert all(m != "no error" for m in messages), messages
    assert any("CollectiveMismatchError" in m and "999" in m for m in messages)
    # Every rank learns of the mismatch from its peers, well before the 60 s collective timeout.
    assert max(elapsed for _, elapsed in results) < 30, results


def _killed_mid_collective() -> str:
    comm = _init(timeout=15)
    comm.barrier()
    t = torch.ones(16_000_000)  # 64 MB: takes far longer than the 10 ms rank 2 lives
    if comm.rank == 2:
        comm.allreduce_async(t)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.allreduce(t)
    except mlfabric.PeerLostError as exc:
        return f"{exc.peer}|{time.monotonic() - start:.2f}|{exc}"
    except mlfabric.CollectiveError as exc:
        return f"other|{time.monotonic() - start:.2f}|{exc}"
    finally:
        comm.close()
    return "completed"


def test_killed_rank_is_reported_by_every_other_rank(transport: str) -> None:
    results = run_ranks(_killed_mid_collective, 4, timeout=60,
                        expect_failures={2})
    survivors = [r for rank, r in enumerate(results) if rank != 2]
    for line in survivors:
        assert line != "completed"
        peer, elapsed, message = line.split("|", 2)
        assert peer == "2" and "peer 2" in message, line
        assert float(elapsed) < 15, line


def _intruders(endpoint_file: str) -> list[int]:
    logging.basicConfig(level=logging.WARNING)
    comm = _init()
    if comm.rank == 0:
        with open(endpoint_file, "w") as fh:
            fh.write(comm.transport.endpoints["0"])
    comm.barrier()
    # Give the intruders (started by the test once the file exists) time to act.
    deadline = time.monotonic() + 20
    while comm.rank == 0 and comm.transport.rejected_messages < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    comm.barrier()
    t = torch.full((1000,), float(comm.rank + 1))
    comm.allreduce(t)
    assert torch.equal(t, torch.full((1000,), 3.0))
    rejected = comm.transport.rejected_messages
    comm.close()
    return [rejected]


def test_rejects_junk_and_wrong_token(transport: str, tmp_path) -> None:
    import threading

    endpoint_file = tmp_path / "endpoint"
    results: list = []
    runner = threading.Thread(target=lambda: results.append(
        run_ranks(_intruders, 2, args=(str(endpoint_file),), timeout=90)))
    runner.start()
    deadline = time.monotonic() + 60
    while not endpoint_file.exists() or not endpoint_file.read_text():
        assert time.monotonic() < deadline, "rank 0 never published its endpoint"
        time.sleep(0.05)
    endpoint = endpoint_file.read_text()
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    # 1. A plain socket writing junk: fails the handshake, never reaches the job. The junk is
    # fixed, not random: libzmq reads bytes that are not a ZMTP 3 greeting as a ZMTP 1.0
    # peer, and ~2% of random tails declare a frame that never completes, which libzmq drops
    # at disconnect without a handshake-failure event (nothing to log; regression: this test
    # failed once in a full run with os.urandom(256) here; docs/architecture.md, Intruders).
    with socket.create_connection((host, int(port))) as plain:
        plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
        time.sleep(0.3)
    # 2. A well-formed peer with the wrong job token, aiming at the tag of the next allreduce.
    header = encode_header(b"\x00" * 16, 1, 0, 0)
    payload = torch.full((1000,), 1e9).numpy().tobytes()
    if transport == "zmq":
        ctx = zmq.Context()
        intruder = ctx.socket(zmq.DEALER)
        intruder.connect(endpoint)
        intruder.send_multipart([header, b"allreduce", payload])
        time.sleep(0.3)
        intruder.close(linger=500)
        ctx.term()
    else:
        from mlfabric.transport.framing import FRAME, FRAME_MAGIC

        with socket.create_connection((host, int(port))) as intruder:
            intruder.sendall(header + FRAME.pack(FRAME_MAGIC, 1 << 24, 9, len(payload), 0)
                             + b"allreduce" + payload)
            time.sleep(0.3)
    runner.join(timeout=120)
    assert results, "the ranks did not finish"
    rejected_on_rank0 = results[0][0][0]
    assert rejected_on_rank0 >= 2


def _short_jobs(ports: list[int]) -> list[float]:
    """One communicator after the other in the same 4 processes, each on its own rendezvous
    port: join, allreduce 16 MB, close; returns how long each close took. The hang was in the
    close of one communicator's transport (its own zmq context and sockets), so a close in a
    process that goes on is as good a chance to catch it as one in a process that then exits,
    and the job pays for starting Python and torch once instead of once per close."""
    close_times = []
    for port in ports:
        comm = mlfabric.init(os.environ[TRANSPORT_ENV], timeout=20, master_port=port)
        comm.allreduce(torch.ones(4_000_000))
        start = time.monotonic()
        comm.close()
        close_times.append(time.monotonic() - start)
    return close_times


def test_close_never_hangs(transport: str) -> None:
    """Regression: closing called disable_monitor() after the monitor socket was closed,
    which blocked forever in about 1 of 15 four-rank jobs (a rank's close hung while its
    peers had already left). Six four-rank communicators, as six four-rank jobs were (24
    closes), in one launch: a hung close fails it (its peers' next rendezvous gives up after
    20 s naming the rank that never came, or the launch runs past its 120 s timeout). With
    the old close put back, 2 of 3 launches of 20 such communicators failed so."""
    from mlfabric.bench.procs import free_port

    ports: list[int] = []
    while len(ports) < 6:  # distinct: each communicator's rendezvous store on its own port
        if (port := free_port()) not in ports:
            ports.append(port)
    results = run_ranks(_short_jobs, 4, args=(ports,), timeout=120)
    assert all(len(times) == 6 for times in results), results
    assert max(max(times) for times in results) < 5, results
