"""The plain TCP transport's own mechanisms: payloads received straight into an offered
destination (and only when size and meta match), the handshake and frame checks, kernel
pacing of a connection. Behaviour shared with the zmq transport (correctness, faults,
intruders) is tested for both in test_socket_transports.py.

Run: python -m pytest tests/local/test_tcp.py
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import mlfabric
from mlfabric.bench.procs import run_ranks
from mlfabric.runtime.communicator import Communicator
from mlfabric.transport.base import encode_header
from mlfabric.transport.framing import FRAME, READ_AHEAD_BYTES, FrameReader
from mlfabric.transport.tcp import TcpTransport

pytestmark = pytest.mark.local

TOKEN = bytes(range(16))


@pytest.fixture
def pair():
    """Two connected tcp transports in this process (rank 0 and rank 1)."""
    a = TcpTransport(0, 2, TOKEN)
    b = TcpTransport(1, 2, TOKEN)
    a.connect({1: b.endpoints})
    b.connect({0: a.endpoints})
    yield a, b
    a.close()
    b.close()


def _wait_for(transport: TcpTransport, tag: int, src: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = transport.mailbox.take("0", tag, src)
        if msg is not None:
            return msg
        transport.progress(transport.mailbox.version, 0.05)
    raise AssertionError(f"tag {tag} never arrived")


def test_an_offered_destination_receives_the_payload_in_place(pair) -> None:
    a, b = pair
    destination = torch.zeros(100_000, dtype=torch.float32)
    assert b.take_or_offer("0", 7, 0, memoryview(destination.numpy()).cast("B"), b"job") is None
    a.send(1, 7, memoryview(torch.arange(100_000, dtype=torch.float32).numpy()).cast("B"), meta=b"job")
    msg = _wait_for(b, 7, 0)
    assert msg.in_place
    assert torch.equal(destination, torch.arange(100_000, dtype=torch.float32))
    assert b.bytes_in_place == 400_000


@pytest.mark.parametrize("case", ["other meta", "other size", "withdrawn"])
def test_a_message_that_does_not_fit_the_offer_is_delivered_apart(pair, case: str) -> None:
    a, b = pair
    destination = torch.zeros(1000, dtype=torch.float32)
    assert b.take_or_offer("0", 9, 0, memoryview(destination.numpy()).cast("B"), b"job") is None
    if case == "withdrawn":
        b.withdraw_offer("0", 9, 0)
    count = 999 if case == "other size" else 1000
    meta = b"other job" if case == "other meta" else b"job"
    a.send(1, 9, memoryview(torch.ones(count).numpy()).cast("B"), meta=meta)
    msg = _wait_for(b, 9, 0)
    assert not msg.in_place
    assert msg.nbytes == 4 * count and msg.meta == meta
    assert torch.count_nonzero(destination) == 0  # the offered memory was never written
    assert b.bytes_in_place == 0


def test_a_message_that_arrived_first_is_taken_not_offered(pair) -> None:
    a, b = pair
    a.send(1, 11, b"early bird", meta=b"m")
    deadline = time.monotonic() + 10
    while b.mailbox.pending() == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    msg = b.take_or_offer("0", 11, 0, memoryview(bytearray(10)), b"m")
    assert msg is not None and bytes(msg.payload) == b"early bird" and not msg.in_place


def test_frame_reader_splits_a_burst_and_joins_pieces_across_reads() -> None:
    """Frames that arrive together are taken one by one; one split over several reads is
    joined; a payload larger than the read-ahead is part copied, part received in place."""
    left, right = socket.socketpair()
    try:
        big = bytes(i % 251 for i in range(3 * READ_AHEAD_BYTES))
        left.sendall(b"abc" + b"defgh")
        reader = FrameReader(right)
        assert bytes(reader.take(3)) == b"abc"
        assert bytes(reader.take(2)) == b"de"
        sender = threading.Thread(target=lambda: (left.sendall(b"XY"), time.sleep(0.05),
                                                  left.sendall(b"Z" + big)))
        sender.start()
        assert bytes(reader.take(6)) == b"fghXYZ"  # three bytes read ahead, then two reads
        destination = bytearray(len(big))
        assert reader.read_into(memoryview(destination))
        assert bytes(destination) == big
        sender.join()
        left.sendall(b"12")
        left.close()
        assert reader.take(4) is None  # the connection ended inside the frame
    finally:
        right.close()


def test_large_messages_keep_their_order_and_complete(pair) -> None:
    a, b = pair
    payloads = [torch.full((2_000_000,), float(i)) for i in range(5)]  # 8 MB each: > socket buffer
    handles = [a.send(1, 100 + i, memoryview(p.numpy()).cast("B")) for i, p in enumerate(payloads)]
    for i in range(5):
        msg = _wait_for(b, 100 + i, 0)
        assert torch.equal(torch.frombuffer(msg.payload, dtype=torch.float32), payloads[i])
    deadline = time.monotonic() + 10
    while not all(h.done() for h in handles):
        assert time.monotonic() < deadline, "sends never completed"
        time.sleep(0.01)


def test_a_corrupt_frame_after_a_valid_handshake_is_rejected(pair) -> None:
    a, b = pair
    host, port = b.endpoints["0"].removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as intruder:
        intruder.sendall(encode_header(TOKEN, 0, 0, 0) + FRAME.pack(b"JUNK", 1, 0, 4, 0) + b"abcd")
        deadline = time.monotonic() + 10
        while b.rejected_messages == 0:
            assert time.monotonic() < deadline, "the corrupt frame was not rejected"
            time.sleep(0.01)
    assert b.mailbox.pending() == 0


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(pair, monkeypatch) -> None:
    import mlfabric.transport.tcp as tcp

    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT_S", 0.2)
    _, b = pair
    host, port = b.endpoints["0"].removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as silent:
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the transport, not by us
    assert b.rejected_messages == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
def test_pace_connection_sets_and_lifts_the_kernel_cap(pair) -> None:
    a, _ = pair
    assert a.pacing_of(1, "0") is None
    unpaced_buffer = a.send_buffer_of(1, "0")
    assert a.pace_connection(1, "0", 80e6)
    assert a.pacing_of(1, "0") == 10_000_000  # bytes/s
    assert a.send_buffer_of(1, "0") < unpaced_buffer
    assert a.pace_connection(1, "0", None)
    assert a.pacing_of(1, "0") is None
    with pytest.raises(mlfabric.TransportError, match="peer 0"):
        a.pace_connection(0, "0", 1e6)


def _ring_in_place() -> tuple[int, int]:
    comm = mlfabric.init("tcp", timeout=30)
    t = torch.ones(1_000_000)
    for _ in range(5):
        comm.allreduce(t, algorithm="ring")
    received = sum(c.bytes_recv for (_, ch), c in comm.transport.counters().items() if ch == "0")
    in_place = comm.transport.bytes_in_place
    assert torch.equal(t, torch.full((1_000_000,), 4.0 ** 5))
    comm.close()
    return in_place, received


def test_ring_allgather_receives_in_place() -> None:
    for in_place, received in run_ranks(_ring_in_place, 4, timeout=120):
        # Half of a ring's bytes are the allgather's, which need no reduction: those (and
        # only those) may land in place, when the receive was posted before the data came.
        assert 0 < in_place <= received // 2, (in_place, received)


def test_a_peer_gone_without_goodbye_is_reported_lost_and_sends_to_it_do_not_raise() -> None:
    """Regression: a send on a connection the dead peer had reset raised TransportError, so
    collectives failed with a generic error instead of PeerLostError naming the peer."""
    a = TcpTransport(0, 2, TOKEN)
    b = TcpTransport(1, 2, TOKEN)
    a.connect({1: b.endpoints})
    b.connect({0: a.endpoints})
    try:
        b._shutdown()  # as if its process died: no goodbye
        handles = [a.send(1, 5, bytes(100_000)) for _ in range(60)]  # 6 MB: more than fits
        deadline = time.monotonic() + 10
        while 1 not in a.lost_peers:
            assert time.monotonic() < deadline, "the dead peer was never reported lost"
            time.sleep(0.01)
        assert "goodbye" in a.lost_peers[1] or "failed" in a.lost_peers[1]
        assert not all(h.done() for h in handles)  # what the dead peer never took stays pending
        a.send(1, 6, b"after the loss")  # does not raise either
    finally:
        a.close()


def test_reader_threads_progress_collectives_and_still_wake_recv_waiters(pair) -> None:
    """With an executor attached, a reader thread runs the executor's pass right after it
    delivers (no progress-thread wake-up per message), so futures complete on reader or
    calling threads; a message no collective takes still wakes a thread blocked in recv()."""
    a, b = pair
    comms = [Communicator(a, timeout=30), Communicator(b, timeout=30)]
    completed_on: list[str] = []

    def allreduces(comm: Communicator) -> list[float]:
        out = []
        for step in range(20):
            t = torch.full((10,), float(comm.rank + step))
            fut = comm.allreduce_async(t, algorithm="tree")
            fut.then(lambda _: completed_on.append(threading.current_thread().name))
            out.append(float(fut.wait()[0]))
        return out

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(allreduces, comms))
    assert results[0] == results[1] == [float(1 + 2 * step) for step in range(20)]
    on_progress = sum(name.startswith("mlfabric-progress") for name in completed_on)
    assert len(completed_on) == 40 and on_progress <= 10, completed_on

    waits = []
    for tag in range(100, 105):
        start = time.monotonic()
        a.send(1, tag, b"plain message")
        assert bytes(b.recv(tag, src=0, timeout=5).payload) == b"plain message"
        waits.append(time.monotonic() - start)
    assert min(waits) < 0.05, waits  # woken by the delivery, not by recv's 0.1 s poll
    for comm in comms:
        comm.executor.close()


def test_messages_for_posted_receives_skip_the_mailbox_and_nothing_stays_posted(pair) -> None:
    """A message whose receive is already posted is routed straight to it (Executor._route):
    most of a collective's messages never enter the mailbox. Receives leave the routing table
    when they complete, and a partial round's open activation receives when it re-arms, so
    nothing is left behind to swallow a later message."""
    a, b = pair
    comms = [Communicator(a, timeout=30), Communicator(b, timeout=30)]
    queued = {0: 0, 1: 0}
    for rank, transport in enumerate((a, b)):
        put = transport.mailbox.put

        def counting_put(msg, *, wake=True, _put=put, _rank=rank):
            queued[_rank] += 1
            _put(msg, wake=wake)

        transport.mailbox.put = counting_put

    def steps(comm: Communicator) -> list[float]:
        out = []
        for step in range(30):
            t = torch.full((10,), float(comm.rank + step))
            out.append(float(comm.allreduce(t, algorithm="tree")[0]))
            out.append(float(comm.partial_allreduce(t, quorum="solo", algorithm="tree").tensor[0]))
        return out

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(steps, comms))
        assert [results[0][i] for i in range(0, 60, 2)] == [float(1 + 2 * s) for s in range(30)]
        # 30 allreduces and 30 partial rounds, each a message each way at least: 120+ messages.
        assert queued[0] + queued[1] < 60, queued
        for comm in comms:
            with comm.executor._pass_lock:
                posted = dict(comm.executor._posted)
            # Only the next partial round's activation receive may be posted (re-armed).
            assert all(run is next(iter(comm._partials.values())).execution for run, _ in posted.values()), posted
            assert len(posted) <= 1, posted
    finally:
        for comm in comms:
            comm.executor.close()


def test_a_job_priority_marks_every_connection_both_ways(monkeypatch) -> None:
    """MLNET §3: the job's priority (MLFABRIC_PRIORITY) is in the IP precedence bits of its
    connections, data (outgoing) and ACKs (accepted) alike; an out-of-range one is named."""
    import socket

    from mlfabric.transport.sockets import PRIORITY_ENV

    monkeypatch.setenv(PRIORITY_ENV, "5")
    a = TcpTransport(0, 2, TOKEN)
    b = TcpTransport(1, 2, TOKEN, priority=0)  # an explicit priority wins over the variable
    try:
        a.connect({1: b.endpoints})
        b.connect({0: a.endpoints})
        assert a.priority == 5 and b.priority == 0
        a.send(1, 7, b"x" * 10).done()
        _wait_for(b, 7, 0)
        assert a._outgoing[(1, "0")].sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 5 << 5
        assert b._outgoing[(0, "0")].sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0
        b.send(0, 8, b"y").done()
        _wait_for(a, 8, 1)  # a message read on it: its connection's handshake (which marks it) is over
        assert [s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) for s in a._incoming] == [5 << 5]
    finally:
        a.close()
        b.close()
    monkeypatch.setenv(PRIORITY_ENV, "8")
    with pytest.raises(ValueError, match="MLFABRIC_PRIORITY must be an integer from 0 .* to 7 .* got '8'"):
        TcpTransport(0, 2, TOKEN)


def test_send_many_delivers_each_message_in_order_with_its_tag_and_meta(pair) -> None:
    """More messages than one sendmsg takes (MESSAGES_PER_CALL), empty metas and payloads
    among them: every one arrives whole, in order, and the counters count each."""
    from mlfabric.transport.tcp import MESSAGES_PER_CALL

    a, b = pair
    n = MESSAGES_PER_CALL * 2 + 7
    payloads = [torch.full((i % 5,), float(i)) for i in range(n)]
    messages = [(3, memoryview(p.numpy()).cast("B"), b"" if i % 3 == 0 else f"m{i}".encode())
                for i, p in enumerate(payloads)]
    before = a.counters().get((1, "0"))
    sent_before = (before.msgs_sent, before.bytes_sent) if before else (0, 0)
    handle = a.send_many(1, messages)
    for i in range(n):
        msg = _wait_for(b, 3, 0)
        assert bytes(msg.meta) == (b"" if i % 3 == 0 else f"m{i}".encode())
        got = torch.frombuffer(bytearray(msg.payload), dtype=torch.float32) if msg.nbytes else torch.zeros(0)
        assert torch.equal(got, payloads[i])
    deadline = time.monotonic() + 5
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.done()
    after = a.counters()[(1, "0")]
    assert (after.msgs_sent - sent_before[0], after.bytes_sent - sent_before[1]) == (
        n, sum(p.numel() * 4 for p in payloads))


def test_send_many_checks_like_send(pair) -> None:
    a, _ = pair
    with pytest.raises(ValueError, match="cannot send to peer 0"):
        a.send_many(0, [(1, b"x", b"")])
    with pytest.raises(ValueError, match="unknown channel 'nine'"):
        a.send_many(1, [(1, b"x", b"")], channel="nine")
    assert a.send_many(1, []).done()  # nothing to send is done at once
