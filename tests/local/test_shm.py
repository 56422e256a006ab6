"""Shared-memory links between ranks of one host (transport/shm.py) under the tcp transport:
every collective correct over them, payloads in place, a SIGKILLed rank reported within 2 s
with nothing left in /dev/shm or in any process, intruders rejected, MLFABRIC_SHM=0.

    python -m pytest tests/local/test_shm.py -q
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

import mlfabric
from mlfabric.bench.procs import run_ranks
from mlfabric.transport import shm
from mlfabric.transport.tcp import TcpTransport
from tests.local.test_socket_transports import TRANSPORT_ENV, _killed_mid_collective

pytestmark = [pytest.mark.local, pytest.mark.skipif(not shm.shm_enabled(), reason="needs Linux memfd")]

SIZES = (0, 1, 7, 16_385, 100_003)  # elements: empty, tiny, odd, past the inline limit, past a ring piece
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)


def _rank_input(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + count)
    return torch.randint(0, 4, (count,), generator=g).to(dtype)


def check_every_collective(comm: mlfabric.Communicator) -> int:
    """Every collective, every dtype, sizes 0..100003, against a local reference; returns
    how many checks passed. Also run by the emulated mixed local/remote test."""
    n, checked = comm.world_size, 0
    for dtype in DTYPES:
        for count in SIZES:
            everyone = [_rank_input(r, count, dtype) for r in range(n)]
            algorithms = ["ring", "halving_doubling", "tree", "auto"]
            if comm.hosts is not None and len(set(comm.hosts)) > 1:
                algorithms.append("host_hierarchical")
            for algorithm in algorithms:
                t = everyone[comm.rank].clone()
                comm.allreduce(t, algorithm=algorithm)
                expected = torch.stack([e.double() for e in everyone]).sum(0).to(dtype)
                assert torch.equal(t, expected), (algorithm, dtype, count)
                checked += 1
            for algorithm in ("binomial", "auto"):
                b = everyone[comm.rank].clone()
                comm.broadcast(b, root=n - 1, algorithm=algorithm)
                assert torch.equal(b, everyone[n - 1]), ("broadcast", algorithm, dtype, count)
            for algorithm in ("ring", "auto"):
                g = comm.allgather(everyone[comm.rank], algorithm=algorithm)
                assert torch.equal(g, torch.stack(everyone)), ("allgather", algorithm, dtype, count)
            shard = comm.reduce_scatter(everyone[comm.rank].clone())
            expected = torch.stack([e.double() for e in everyone]).sum(0).to(dtype)
            assert torch.equal(shard, torch.tensor_split(expected, n)[comm.rank]), ("reduce_scatter", dtype, count)
            checked += 5
    return checked


def _correct_over_shm() -> tuple[int, int, int, list[int], tuple[int, ...] | None]:
    comm = mlfabric.init("tcp", timeout=60)
    try:
        transport = comm.transport
        checked = check_every_collective(comm)
        t = torch.ones(4_000_000)
        comm.allreduce(t, algorithm="ring")
        return (checked, transport.bytes_in_place, len(transport._outgoing), sorted(transport._shm_peers),
                comm.hosts)
    finally:
        comm.close()


def test_every_collective_is_correct_over_shared_memory() -> None:
    results = run_ranks(_correct_over_shm, 3, timeout=240)
    for rank, (checked, in_place, tcp_connections, shm_peers, hosts) in enumerate(results):
        assert checked == len(DTYPES) * len(SIZES) * 9
        assert shm_peers == [p for p in range(3) if p != rank]  # every peer over shared memory
        assert tcp_connections == 0                                # and none over TCP
        assert in_place > 0                                         # received straight into the tensor
        assert hosts == (0, 0, 0)


def _memfds_of_mlfabric() -> list[str]:
    """Every fd or mapping of an mlfabric shared-memory ring in any process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"{pid}: {line.split()[-2]}" for line in maps if "memfd:mlfabric-" in line]
        except OSError:
            continue
    return found


def test_sigkill_is_reported_within_two_seconds_and_leaves_nothing(monkeypatch) -> None:
    """Rank 2 SIGKILLs itself 10 ms into a 64 MB allreduce (the transports' shared scenario)."""
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")  # on one host: every peer over shared memory
    shm_before = set(os.listdir("/dev/shm"))
    results = run_ranks(_killed_mid_collective, 4, timeout=90, expect_failures={2})
    for rank, line in enumerate(results):
        if rank == 2:
            continue
        peer, elapsed, message = line.split("|", 2)
        assert peer == "2" and "peer 2" in message, line
        assert float(elapsed) < 2.0, line  # as prompt as over TCP (issue #27's check)
    assert set(os.listdir("/dev/shm")) == shm_before
    assert _memfds_of_mlfabric() == []  # the rings died with the job's processes


def test_a_wrong_token_on_the_shared_memory_listener_is_rejected() -> None:
    a = TcpTransport(0, 2, bytes(range(16)), shared_memory=True)
    try:
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        intruder.connect(shm._address(a.token, 0))
        hello = shm.encode_header(bytes(16), 1, 0, 0) + shm._HANDSHAKE.pack(shm.RING_BYTES)
        fd = os.memfd_create("intruder")
        socket.send_fds(intruder, [hello], [fd])
        os.close(fd)
        intruder.settimeout(5)
        assert intruder.recv(1) == b""  # closed by the transport
        intruder.close()
        deadline = time.monotonic() + 5
        while a.rejected_messages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.rejected_messages == 1
    finally:
        a.close()


def test_transports_on_one_host_share_memory_unless_told_not_to(monkeypatch) -> None:
    token = bytes(range(16))
    a, b = TcpTransport(0, 2, token, shared_memory=True), TcpTransport(1, 2, token, shared_memory=True)
    a.connect({1: b.endpoints})
    b.connect({0: a.endpoints})
    try:
        assert a.hosts == b.hosts == (0, 0) and a._shm_peers == {1} and not a._outgoing
        payload = torch.arange(1_000_000, dtype=torch.float32)
        a.send(1, 3, memoryview(payload.numpy()).cast("B"))
        msg = b.recv(3, src=0, timeout=10)
        assert torch.equal(torch.frombuffer(msg.payload, dtype=torch.float32), payload)
        assert a.pace_connection(1, "0", 1e9)  # nothing to pace on memory, and no error
    finally:
        a.close()
        b.close()
    monkeypatch.setenv(shm.SHM_ENV, "0")
    c, d = TcpTransport(0, 2, token, shared_memory=True), TcpTransport(1, 2, token, shared_memory=True)
    c.connect({1: d.endpoints})
    d.connect({0: c.endpoints})
    try:
        assert c.hosts == (0, 1) and not c._shm_peers and (1, "0") in c._outgoing
    finally:
        c.close()
        d.close()


def test_an_oversized_meta_on_a_link_is_rejected() -> None:
    """Regression: the shared-memory reader did not bound a frame's meta length (the tcp
    reader did); a meta larger than its buffer read as the link's end, not as junk."""
    from mlfabric.transport.framing import FRAME, MAX_META_BYTES

    token = bytes(range(16))
    a = TcpTransport(0, 2, token, shared_memory=True)
    try:
        writer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        writer.connect(shm._address(token, 0))
        hello = shm.encode_header(token, 1, 0, 0) + shm._HANDSHAKE.pack(shm.RING_BYTES)
        fd = os.memfd_create("peer")
        os.ftruncate(fd, shm.RING_BYTES)
        socket.send_fds(writer, [hello], [fd])
        os.close(fd)
        writer.sendall(FRAME.pack(shm.INLINE_MAGIC, 1, MAX_META_BYTES + 1, 0, 0))
        deadline = time.monotonic() + 5
        while a.rejected_messages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.rejected_messages == 1
        writer.close()
    finally:
        a.close()
