"""Executor + Communicator on the in-process transport (ranks are threads).

Run: python -m pytest tests/unit/test_runtime.py
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mlfabric
from mlfabric import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from mlfabric.collectives import build, choose_allreduce
from mlfabric.transport.local import LocalFabric, LocalTransport

ALGORITHMS = ("ring", "halving_doubling", "tree")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def rank_input(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers, so float16/bfloat16 sums are exact whatever the reduction order."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, (count,), generator=g).to(dtype)


def reference(world: int, count: int, dtype: torch.dtype, seed: int, op: str) -> torch.Tensor:
    stack = torch.stack([rank_input(r, count, dtype, seed).to(torch.float64) for r in range(world)])
    if op == "sum":
        out = stack.sum(0)
    elif op == "max":
        out = stack.max(0).values if count else stack.sum(0)
    elif op == "min":
        out = stack.min(0).values if count else stack.sum(0)
    elif op == "avg":
        total = stack.sum(0)
        out = torch.floor(total / world) if not dtype.is_floating_point else total / world
    else:
        raise ValueError(op)
    return out.to(dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_allreduce_matches_local_reference(world: int) -> None:
    cases = [
        (alg, count, dtype, op)
        for alg in ALGORITHMS
        for count in (0, 1, 7, 1000)
        for dtype in DTYPES
        for op in ("sum", "avg", "max")
    ]
    # A million elements once per algorithm (float32 sum) and once for int64 with ring.
    cases += [(alg, 1_000_000, torch.float32, "sum") for alg in ALGORITHMS]
    cases += [("ring", 1_000_000, torch.int64, "avg")]

    def body(comm: mlfabric.Communicator) -> int:
        for seed, (alg, count, dtype, op) in enumerate(cases):
            t = rank_input(comm.rank, count, dtype, seed)
            out = comm.allreduce(t, algorithm=alg, op=op)
            assert out is t
            expected = reference(world, count, dtype, seed, op)
            if dtype.is_floating_point and op == "avg":
                torch.testing.assert_close(t, expected, rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(t, expected), (alg, count, dtype, op)
        return len(cases)

    assert mlfabric.run_threads(world, body) == [len(cases)] * world


@pytest.mark.parametrize("world", [2, 3, 5])
def test_broadcast_allgather_reduce_scatter(world: int) -> None:
    def body(comm: mlfabric.Communicator) -> None:
        for root in range(world):
            t = torch.full((5, 3), float(comm.rank))
            comm.broadcast(t, root=root)
            assert torch.equal(t, torch.full((5, 3), float(root)))
        g = comm.allgather(torch.arange(4, dtype=torch.int64) + 10 * comm.rank)
        assert g.shape == (world, 4)
        assert torch.equal(g, torch.arange(4).repeat(world, 1) + 10 * torch.arange(world)[:, None])
        full = torch.arange(11, dtype=torch.int64)
        shard = comm.reduce_scatter(full * (comm.rank + 1))
        expected = torch.tensor_split(full * sum(range(1, world + 1)), world)[comm.rank]
        assert torch.equal(shard, expected)

    mlfabric.run_threads(world, body)


def test_non_contiguous_tensor_is_written_back() -> None:
    def body(comm: mlfabric.Communicator) -> None:
        base = torch.ones(6, 4) * (comm.rank + 1)
        view = base.t()  # not contiguous
        comm.allreduce(view)
        assert torch.equal(base, torch.full((6, 4), 3.0))

    mlfabric.run_threads(2, body)


def test_async_returns_torch_future_and_overlaps() -> None:
    def body(comm: mlfabric.Communicator) -> None:
        tensors = [torch.full((1000,), float(i)) for i in range(4)]
        futures = [comm.allreduce_async(t, algorithm="ring") for t in tensors]
        assert all(isinstance(f, torch.futures.Future) for f in futures)
        results = torch.futures.wait_all(futures)
        for i, out in enumerate(results):
            assert torch.equal(out, torch.full((1000,), 3.0 * i))

    mlfabric.run_threads(3, body)


def test_bytes_counted_by_transport_equal_stated_cost() -> None:
    world, count = 5, 10_007
    for alg in ALGORITHMS:
        fabric = LocalFabric(world)
        comms = [mlfabric.Communicator(t) for t in fabric.transports()]

        def body(rank: int) -> None:
            comms[rank].allreduce(torch.ones(count, dtype=torch.float64), algorithm=alg)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for rank, comm in enumerate(comms):
            stated = build(f"allreduce:{alg}", world, rank, count, op="sum").cost
            assert comm.transport.bytes_sent() == stated.bytes_sent(8), (alg, rank)
            comm.close()


def test_mismatched_sizes_fail_on_every_rank() -> None:
    def body(comm: mlfabric.Communicator) -> str:
        count = 1001 if comm.rank == 2 else 1000
        with pytest.raises(mlfabric.CollectiveError) as info:
            comm.allreduce(torch.ones(count), algorithm="ring")
        return str(info.value)

    messages = mlfabric.run_threads(4, body, timeout=10)
    assert any("1001" in m and "1000" in m for m in messages)
    assert all("mismatch" in m or "aborted" in m for m in messages)


def test_mismatched_dtypes_raise_mismatch_error() -> None:
    def body(comm: mlfabric.Communicator) -> type:
        dtype = torch.float64 if comm.rank == 0 else torch.float32
        with pytest.raises(mlfabric.CollectiveError) as info:
            comm.allreduce(torch.ones(64, dtype=dtype), algorithm="halving_doubling")
        return type(info.value)

    kinds = mlfabric.run_threads(2, body, timeout=10)
    assert CollectiveMismatchError in kinds


def test_killed_peer_is_named_on_every_other_rank() -> None:
    fabric = LocalFabric(3)
    comms = [mlfabric.Communicator(t, timeout=30) for t in fabric.transports()]
    futures = [comms[r].allreduce_async(torch.ones(100_000), algorithm="ring") for r in (0, 1)]
    start = time.monotonic()
    fabric.kill(2)
    for fut in futures:
        with pytest.raises(PeerLostError, match="peer 2"):
            fut.wait()
    assert time.monotonic() - start < 5
    for comm in comms[:2]:
        comm.close()


def test_timeout_names_the_missing_peer() -> None:
    fabric = LocalFabric(2)
    comms = [mlfabric.Communicator(t, timeout=0.5) for t in fabric.transports()]
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="recv from peer 1"):
        comms[0].allreduce(torch.ones(10))
    assert 0.4 < time.monotonic() - start < 3
    for comm in comms:
        comm.close()


def test_bad_arguments_are_rejected() -> None:
    comm = mlfabric.local_world(1)[0]
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        comm.allreduce(torch.ones(3), algorithm="butterfly")
    with pytest.raises(ValueError, match="unknown reduction"):
        comm.allreduce(torch.ones(3), op="median")
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.allreduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="root 3"):
        comm.broadcast(torch.ones(3), root=3)
    comm.close()


def test_auto_picks_by_size() -> None:
    assert choose_allreduce("auto", 1024, 8) == "halving_doubling"
    assert choose_allreduce("auto", 64 << 20, 8) == "ring"


def test_chunk_bytes_pipelines_the_ring_collectives() -> None:
    """``chunk_bytes`` cuts every ring segment into chunks of about that size: the same bytes
    and results, more messages; allgather and reduce_scatter follow it too."""
    import threading

    from mlfabric.transport.base import CONTROL_CHANNEL

    world, count = 4, 40_000  # segments of 10,000 float32 = 40 KB
    outputs: dict[int | None, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    messages: dict[int | None, int] = {}
    for chunk_bytes in (None, 8_000):  # 8 KB: 5 chunks per segment
        fabric = LocalFabric(world)
        comms = [mlfabric.Communicator(t, chunk_bytes=chunk_bytes) for t in fabric.transports()]
        outputs[chunk_bytes] = [None] * world  # type: ignore[list-item]

        def body(rank: int) -> None:
            data = rank_input(rank, count, torch.float32, seed=3)
            reduced = comms[rank].allreduce(data.clone(), algorithm="ring")
            gathered = comms[rank].allgather(data[:100])
            shard = comms[rank].reduce_scatter(data.clone())
            outputs[chunk_bytes][rank] = (reduced, gathered, shard)  # type: ignore[index]

        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        messages[chunk_bytes] = sum(c.msgs_sent for comm in comms
                                    for (peer, ch), c in comm.transport.counters().items() if ch != CONTROL_CHANNEL)
        for comm in comms:
            comm.close()
    expected = reference(world, count, torch.float32, 3, "sum")
    for rank in range(world):
        plain, chunked = outputs[None][rank], outputs[8_000][rank]
        assert torch.equal(chunked[0], expected)
        for a, b in zip(plain, chunked):
            assert torch.equal(a, b)
    # allreduce: 2(N-1) steps x 5 chunks instead of x 1; reduce_scatter: (N-1) x 5; the
    # allgather of 100 elements per rank (400 B segments) stays at 1 chunk per segment.
    per_rank_plain = 2 * (world - 1) + (world - 1) + (world - 1)
    per_rank_chunked = 2 * (world - 1) * 5 + (world - 1) + (world - 1) * 5
    assert messages[None] == world * per_rank_plain
    assert messages[8_000] == world * per_rank_chunked
    with pytest.raises(ValueError, match="chunk_bytes must be a positive"):
        mlfabric.Communicator(LocalFabric(2).transports()[0], chunk_bytes=0)


def test_list_options_are_checked_alike() -> None:
    """bench partial's variants and train's sync modes share one check (bench.procs.check_choices)."""
    from mlfabric.bench.partial import PartialBenchConfig
    from mlfabric.bench.procs import check_choices
    from mlfabric.train.harness import EagerTrainConfig

    check_choices(("a", "b"), ("a", "b", "c"), "letters", "letter")  # fine
    with pytest.raises(ValueError, match=r"letters must be distinct and non-empty, got \('a', 'a'\)"):
        check_choices(("a", "a"), ("a",), "letters", "letter")
    with pytest.raises(ValueError, match="letters must be distinct and non-empty"):
        check_choices((), ("a",), "letters", "letter")
    with pytest.raises(ValueError, match="unknown letter 'z'; choose from a, b"):
        check_choices(("z",), ("a", "b"), "letters", "letter")
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        PartialBenchConfig(variants=("solo", "fast"))
    with pytest.raises(ValueError, match="modes must be distinct"):
        EagerTrainConfig(modes=("sync", "sync"))
    config = EagerTrainConfig(workload="lstm", lr=0.2)
    assert (config.lr_, config.batch_size_, config.epochs_, config.sync_every_epochs_) == (0.2, 16, 16, 10)


class _InPlaceTransport(LocalTransport):
    """Lands a payload in the destination the runtime offered for it, the way the tcp
    transport's reader does, and records what was offered."""

    def __init__(self, fabric: LocalFabric, rank: int) -> None:
        super().__init__(fabric, rank)
        self.offers: dict[tuple[str, int, int], tuple[memoryview, bytes]] = {}
        self.offered_bytes: list[int] = []
        self.landed = 0
        self.withdrawn = 0

    def take_or_offer(self, channel, tag, src, destination, meta):
        with self.mailbox._cond:
            msg = self.mailbox.take(channel, tag, src)
            if msg is None:
                self.offers[(channel, tag, src)] = (destination, meta)
                self.offered_bytes.append(destination.nbytes)
            return msg

    def withdraw_offer(self, channel, tag, src):
        with self.mailbox._cond:
            if self.offers.pop((channel, tag, src), None) is not None:
                self.withdrawn += 1

    def _deliver(self, msg):
        with self.mailbox._cond:
            offer = self.offers.pop((msg.channel, msg.tag, msg.src), None)
        if offer is not None and offer[0].nbytes == msg.nbytes and offer[1] == msg.meta:
            offer[0][:] = msg.payload
            msg = type(msg)(msg.src, msg.tag, msg.channel, msg.meta, offer[0], in_place=True)
            self.landed += 1
        super()._deliver(msg)


def _run_each(comms: list[mlfabric.Communicator], body) -> list:
    results: list = [None] * len(comms)
    errors: list = []

    def run(i: int) -> None:
        try:
            results[i] = body(comms[i])
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _in_place_world(world: int, timeout: float = 30.0) -> list[mlfabric.Communicator]:
    fabric = LocalFabric(world)
    transports = [_InPlaceTransport(fabric, rank) for rank in range(world)]
    with fabric._lock:
        fabric._endpoints.update(enumerate(transports))
    return [mlfabric.Communicator(t, timeout=timeout) for t in transports]


def test_large_plain_receives_are_offered_and_land_in_place() -> None:
    from mlfabric.runtime.executor import OFFER_MIN_BYTES

    comms = _in_place_world(4)
    count = 1_000_000  # ring segments of 1 MB: above the offer threshold

    def body(comm: mlfabric.Communicator) -> torch.Tensor:
        t = rank_input(comm.rank, count, torch.float32, 5)
        for _ in range(3):
            comm.allreduce(t, algorithm="ring")
        comm.allreduce(torch.ones(1000), algorithm="ring")  # segments far below the threshold
        return t

    try:
        results = _run_each(comms, body)
        expected = reference(4, count, torch.float32, 5, "sum")
        for _ in range(2):
            expected = expected * 4
        for comm, t in zip(comms, results):
            assert torch.equal(t, expected)
            tr = comm.transport
            # Only the allgather's receives (no reduction) are offered: 3 per ring call.
            assert len(tr.offered_bytes) <= 3 * 3 and all(n >= OFFER_MIN_BYTES for n in tr.offered_bytes)
            assert tr.landed + tr.withdrawn == len(tr.offered_bytes)  # each offer used or taken back
            assert not tr.offers
        assert sum(c.transport.landed for c in comms) > 0
    finally:
        for comm in comms:
            comm.close()


def test_a_failed_collective_takes_back_its_offers() -> None:
    comms = _in_place_world(2, timeout=1.0)
    try:
        # Rank 1 (the root) never joins: rank 0's receive of the broadcast stays offered
        # until the timeout.
        with pytest.raises(CollectiveTimeoutError):
            comms[0].broadcast(torch.ones(100_000), root=1)
        tr = comms[0].transport
        assert tr.offered_bytes == [400_000]
        assert tr.withdrawn == 1 and not tr.offers
    finally:
        for comm in comms:
            comm.close()


def test_waiter_hands_over_a_result_or_an_error_across_threads() -> None:
    from mlfabric.runtime.executor import Waiter

    ok, bad = Waiter(), Waiter()
    assert not ok.done() and not bad.done()
    threading.Timer(0.05, ok.set_result, args=(41,)).start()
    threading.Timer(0.05, bad.set_exception, args=(ValueError("peer said no"),)).start()
    assert ok.wait() == 41 and ok.done()
    assert ok.wait() == 41  # waiting again returns the same value
    with pytest.raises(ValueError, match="peer said no"):
        bad.wait()
    with pytest.raises(RuntimeError):
        ok.set_result(42)  # a result is set once


def test_a_rank_message_cut_short_by_a_signal_is_written_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a rank sent its result with one unbuffered write; a signal during a large
    write to the pipe returns a short count, the rest was never written, and the launcher saw
    a rank that 'exited with code 0 before returning a result' (an emulated --fail run)."""
    import pickle

    from mlfabric.bench import procs

    class ShortWrites:
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, chunk: memoryview) -> int:
            n = min(len(chunk), 1000)  # as write(2) interrupted after 1,000 bytes
            self.data += bytes(chunk[:n])
            return n

    pipe = ShortWrites()
    monkeypatch.setattr(procs, "_report_file", pipe)
    payload = list(range(10_000))
    procs._send("result", payload)
    (size,) = procs._HEADER.unpack(bytes(pipe.data[:procs._HEADER.size]))
    assert size == len(pipe.data) - procs._HEADER.size
    assert pickle.loads(bytes(pipe.data[procs._HEADER.size:])) == ("result", payload)


def test_send_many_default_sends_each_message_in_order_and_all_sent_waits_for_every_handle() -> None:
    from mlfabric.transport.base import AllSent, SendHandle

    fabric = LocalFabric(2)
    a, b = fabric.transports()
    handle = a.send_many(1, [(5, b"one", b"m1"), (5, b"", b""), (6, b"three", b"m3")])
    assert handle.done()
    first, second, third = b.mailbox.take("0", 5, 0), b.mailbox.take("0", 5, 0), b.mailbox.take("0", 6, 0)
    assert (bytes(first.payload), bytes(first.meta)) == (b"one", b"m1")
    assert (bytes(second.payload), bytes(second.meta)) == (b"", b"")
    assert (bytes(third.payload), bytes(third.meta)) == (b"three", b"m3")
    parts = [SendHandle(), SendHandle(done=True), SendHandle()]
    together = AllSent(parts)
    assert not together.done()
    parts[0].set_done()
    assert not together.done()
    parts[2].set_done()
    assert together.done()


def test_stop_processes_kills_what_still_runs_and_leaves_the_ended_alone() -> None:
    import signal
    import subprocess
    import sys

    from mlfabric.bench.procs import stop_processes

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(30)
    stop_processes([running, ended], timeout=10)
    assert running.returncode == -signal.SIGKILL and ended.returncode == 0
