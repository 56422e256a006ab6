"""A floor for the partial-allreduce microbenchmark: the same experiment with a minimal runtime.

    .venv/bin/python -m mlfabric.bench.partial_floor --world-size 32 --iterations 64

:mod:`mlfabric.bench.partial` measures mlfabric's synchronous, solo and majority allreduce
(eager-SGD §6.1). On a machine with many more processes than cores those rounds are bound by
the CPU that the runtime spends per message. This module answers how far a runtime can go on
the same machine: it runs the same experiment (P processes, rank r calls 1 + r·31/(P-1) ms
after a common instant, 1 KB of float32, mean latency from call to result) with the least
machinery that still does the paper's protocol, as :mod:`mlfabric.flow.naive` is the
reference for the max-min solver. It is a reference, not a transport: no failures, no stale
gradients (a rank that has not called contributes zeros), no tensors, no DAG.

Per process: one thread, one ``selectors`` loop (epoll), one TCP connection to each hypercube
neighbour ``r XOR 2^j`` (all the schedules below need), fixed-size frames. The thread that
"sleeps" its skew runs the loop meanwhile, as a progress thread would while the application
computes. ``--reader-threads`` instead gives every connection a blocking reader thread that
runs the protocol under a lock while the calling thread sleeps and then waits on a condition:
the thread layout of mlfabric's tcp transport, to tell its cost from the rest.

* synchronous: binomial-tree reduce to rank 0, then broadcast (as ``comm.allreduce(t,
  algorithm="tree")``);
* solo: the first caller's activation spreads over the union of binomial trees (a rank
  activated through bit ``i`` forwards on every bit ``j > i`` it has not sent on; eager-SGD
  Fig. 6), every activated rank enters the same tree allreduce;
* majority: the same, started only by the round's initiator, drawn from a seed all share.

Every round is checked: element 0 of the result counts the ranks whose call came before their
activation (sync: all P), and every rank must see the same count.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import selectors
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["FloorResult", "run_floor"]

VARIANTS = ("synchronous", "solo", "majority")
_HEADER = struct.Struct("<BBi")  # kind, bit, round
_ACTIVATE, _REDUCE, _RESULT = 1, 2, 3
_ELEMENTS = 256  # 1 KB of float32
_FRAME = _HEADER.size + 4 * _ELEMENTS


@dataclass(frozen=True)
class FloorResult:
    world_size: int
    iterations: int
    reader_threads: bool
    mean_latency_s: dict[str, float]   # per variant, over ranks and timed iterations
    mean_active: dict[str, float]      # ranks whose fresh data made it in (eager-SGD's NAP)
    correct: bool
    #: CPU time (user + system) per process and round, over the timed rounds of all variants.
    cpu_per_rank_round_s: float

    def speedup(self, variant: str) -> float:
        return self.mean_latency_s["synchronous"] / self.mean_latency_s[variant]


def _lowbit(r: int) -> int:
    return r & -r


def _take_frames(buffer: bytearray) -> list[tuple[int, int, int, np.ndarray]]:
    """Remove every complete frame from the front of ``buffer``: (kind, bit, round, data)."""
    frames = []
    while len(buffer) >= _FRAME:
        kind, bit, round = _HEADER.unpack_from(buffer)
        frames.append((kind, bit, round, np.frombuffer(bytes(buffer[_HEADER.size:_FRAME]), dtype=np.float32)))
        del buffer[:_FRAME]
    return frames


class _Rank:
    def __init__(self, rank: int, n: int, listeners: list[socket.socket], seed: int, reader_threads: bool) -> None:
        self.rank, self.n, self.seed = rank, n, seed
        self.bits = (n - 1).bit_length()
        self.parent = None if rank == 0 else rank - _lowbit(rank)
        self.children = [rank + (1 << j) for j in range(self.bits)
                         if (rank == 0 or (1 << j) < _lowbit(rank)) and rank + (1 << j) < n]
        self.conns: dict[int, socket.socket] = {}
        neighbours = [rank ^ (1 << j) for j in range(self.bits) if rank ^ (1 << j) < n]
        for peer in neighbours:  # connect upwards, accept from below: one connection per pair
            if peer > rank:
                sock = socket.create_connection(listeners[peer].getsockname())
                sock.sendall(struct.pack("<i", rank))
                self.conns[peer] = sock
        while len(self.conns) < len(neighbours):
            sock, _ = listeners[rank].accept()
            (peer,) = struct.unpack("<i", sock.recv(4, socket.MSG_WAITALL))
            self.conns[peer] = sock
        self.inbox: list[tuple[int, int, int, np.ndarray]] = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.handler = None  # the current round's message handler (called under the lock)
        self.threaded = reader_threads
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[int, bytearray] = {}
        for peer, sock in self.conns.items():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.threaded:
                threading.Thread(target=self._reader, args=(sock,), daemon=True).start()
            else:
                self.selector.register(sock, selectors.EVENT_READ, peer)
                self.buffers[peer] = bytearray()

    def _reader(self, sock: socket.socket) -> None:
        """``reader_threads``: one blocking reader per connection hands each frame to the round
        under a lock, while the calling thread sleeps and waits on a condition (the thread
        layout of mlfabric's tcp transport and executor)."""
        buffer = bytearray()
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buffer += chunk
            for frame in _take_frames(buffer):
                with self.lock:
                    if self.handler is None or not self.handler(frame):
                        self.inbox.append(frame)

    def send(self, peer: int, kind: int, bit: int, round: int, data: np.ndarray) -> None:
        self.conns[peer].sendall(_HEADER.pack(kind, bit, round) + data.tobytes())

    def pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            buffer = self.buffers[key.data]
            buffer += key.fileobj.recv(1 << 16)
            self.inbox.extend(_take_frames(buffer))

    def wait_until(self, instant: float) -> None:
        while (left := instant - time.monotonic()) > 0:
            if self.threaded:
                time.sleep(left)
            else:
                self.pump(left)

    def round(self, number: int, variant: str, call_at: float) -> tuple[float, int]:
        """One collective; returns (latency from the call to the result, element 0 of the result)."""
        initiator = random.Random(self.seed * 1_000_003 + number).randrange(self.n)
        state = {"activated": False, "called": False, "sum": None, "children": 0, "sent_up": False,
                 "result": None, "t_call": 0.0, "t_result": 0.0}
        sent_bits: set[int] = set()

        def spread(from_bit: int) -> None:
            for j in range(from_bit + 1, self.bits):
                if j not in sent_bits and self.rank ^ (1 << j) < self.n:
                    sent_bits.add(j)
                    self.send(self.rank ^ (1 << j), _ACTIVATE, j, number, _ZEROS)

        def add(data: np.ndarray) -> None:
            state["sum"] = data.copy() if state["sum"] is None else state["sum"] + data

        def activate() -> None:
            if not state["activated"]:
                state["activated"] = True
                add(_ONES if state["called"] else _ZEROS)
                reduce_up()

        def reduce_up() -> None:
            if state["activated"] and not state["sent_up"] and state["children"] == len(self.children):
                state["sent_up"] = True
                if self.parent is None:
                    deliver(state["sum"])
                else:
                    self.send(self.parent, _REDUCE, 0, number, state["sum"])

        def deliver(result: np.ndarray) -> None:
            state["result"], state["t_result"] = result, time.monotonic()
            for child in self.children:
                self.send(child, _RESULT, 0, number, result)

        def handle(message: tuple[int, int, int, np.ndarray]) -> bool:
            kind, bit, round, data = message
            if round != number:
                return round < number  # late: dropped (True); future: keep (False)
            if kind == _ACTIVATE:
                spread(bit)
                activate()
            elif kind == _REDUCE:
                state["children"] += 1
                add(data)
                reduce_up()
            else:
                deliver(data)
                if self.threaded:
                    self.cond.notify_all()
            return True

        def call() -> None:
            state["called"], state["t_call"] = True, time.monotonic()
            if variant == "synchronous":
                activate()
            elif variant == "solo" or initiator == self.rank:
                spread(-1)
                activate()
            if self.threaded and state["result"] is not None:
                self.cond.notify_all()

        def drain() -> None:
            """Handle what arrived before this round was ready; keep what belongs to later ones."""
            pending, self.inbox = self.inbox, []
            for message in pending:
                if not handle(message):
                    self.inbox.append(message)

        if self.threaded:
            with self.lock:
                self.handler = handle
                drain()
            time.sleep(max(0.0, call_at - time.monotonic()))
            with self.cond:
                call()
                while state["result"] is None:
                    self.cond.wait(0.05)
                self.handler = None
        else:
            while state["result"] is None or not state["called"]:
                if not state["called"] and time.monotonic() >= call_at:
                    call()
                drain()
                if state["result"] is None or not state["called"]:
                    self.pump(max(0.0, call_at - time.monotonic()) if not state["called"] else 0.05)
        return max(0.0, state["t_result"] - state["t_call"]), int(state["result"][0])

_ZEROS = np.zeros(_ELEMENTS, dtype=np.float32)
_ONES = np.ones(_ELEMENTS, dtype=np.float32)


def _rank_main(rank: int, n: int, listeners: list[socket.socket], iterations: int, warmup: int,
               slot_s: float, seed: int, reader_threads: bool, start: "mp.synchronize.Barrier",
               base: "mp.sharedctypes.Synchronized", out: "mp.Queue") -> None:
    me = _Rank(rank, n, listeners, seed, reader_threads)
    start.wait()
    if rank == 0:
        base.value = time.monotonic() + 0.5
    start.wait()
    latencies: dict[str, list[float]] = {v: [] for v in VARIANTS}
    counts: dict[str, list[int]] = {v: [] for v in VARIANTS}
    skew = 0.001 * (1 + rank * 31 / max(1, n - 1))
    number = 0
    for iteration in range(warmup + iterations):
        if iteration == warmup:
            before = time.process_time()
        for index, variant in enumerate(VARIANTS):
            slot = base.value + (iteration * len(VARIANTS) + index) * slot_s
            latency, count = me.round(number, variant, slot + skew)
            number += 1
            if iteration >= warmup:
                latencies[variant].append(latency)
                counts[variant].append(count)
            me.wait_until(slot + 0.9 * slot_s)
    cpu = time.process_time() - before
    out.put((rank, latencies, counts, cpu / (iterations * len(VARIANTS))))


def run_floor(world_size: int = 32, iterations: int = 64, *, warmup: int = 2, slot_s: float = 0.2,
              seed: int = 0, reader_threads: bool = False) -> FloorResult:
    """Run the floor experiment on ``world_size`` local processes (see the module docstring)."""
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2, got {world_size}")
    ctx = mp.get_context("fork")  # the children inherit the bound listeners
    listeners = []
    for _ in range(world_size):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        listeners.append(sock)
    start, base, out = ctx.Barrier(world_size), ctx.Value("d", 0.0), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, listeners, iterations, warmup, slot_s, seed, reader_threads,
                               start, base, out))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    timeout = 60 + (warmup + iterations) * len(VARIANTS) * slot_s
    try:
        records = [out.get(timeout=timeout) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for sock in listeners:
            sock.close()
    records.sort(key=lambda record: record[0])
    mean = {v: statistics.fmean(t for _, lat, _, _ in records for t in lat[v]) for v in VARIANTS}
    per_round = {v: [c[v] for _, _, c, _ in records] for v in VARIANTS}
    same_everywhere = all(len(set(column)) == 1 for v in VARIANTS for column in zip(*per_round[v]))
    sync_is_all = all(c == world_size for c in per_round["synchronous"][0])
    active = {v: statistics.fmean(per_round[v][0]) for v in VARIANTS}
    return FloorResult(world_size=world_size, iterations=iterations, reader_threads=reader_threads,
                       mean_latency_s=mean, mean_active=active,
                       correct=same_everywhere and sync_is_all,
                       cpu_per_rank_round_s=statistics.fmean(record[3] for record in records))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reader-threads", action="store_true",
                        help="a blocking reader thread per connection instead of one event loop")
    args = parser.parse_args(argv)
    result = run_floor(args.world_size, args.iterations, seed=args.seed, reader_threads=args.reader_threads)
    layout = "reader thread per connection" if result.reader_threads else "one event loop"
    print(f"floor ({layout}), {result.world_size} processes, linear skew 1..32 ms, 1 KB, mean of "
          f"{result.iterations} iterations x ranks (correct: {'yes' if result.correct else 'NO'})")
    for variant in VARIANTS:
        speed = "" if variant == "synchronous" else f"  {result.speedup(variant):.2f}x"
        print(f"  {variant:<12} {result.mean_latency_s[variant] * 1e3:8.2f} ms{speed}  "
              f"active {result.mean_active[variant]:.1f}")
    print(f"  CPU per process and round: {result.cpu_per_rank_round_s * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
