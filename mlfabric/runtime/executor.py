"""Runs per-rank schedules on a transport from one background progress thread.

``Executor.submit`` hands over a schedule plus the tensors backing its buffers and returns a
``torch.futures.Future``. The progress thread fires every op whose dependencies are met
(all-of or any-of), posts sends, matches arriving messages to receives, reduces, and
completes the future when every op ran — while the application thread computes. Every
collective has a deadline; a lost peer, a mismatched peer or a timeout fails the future with
an error naming rank, peer and op, and an abort notice tells the other ranks why (with the
same kind of error: a mismatch is a ``CollectiveMismatchError`` on every rank).

Failing fast (``runtime/control.py`` has the messages): a peer that closes its communicator
says in its goodbye which collectives it leaves unfinished, and those fail at once on every
other rank, naming it. A collective that makes no progress for :data:`CROSS_CHECK_S` asks the
peers it waits for to compare their description of it (so ranks that disagree on the root or
the algorithm fail with a mismatch instead of waiting for the timeout); after ``watchdog_s``
without progress the watchdog logs, per rank, what the collective waits for, from whom, and
what those peers say they are doing.

Exercise it with ``python -m pytest tests/unit/test_runtime.py``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mlfabric.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLeftError,
    PeerLostError,
)
from mlfabric.schedule import Copy, DepMode, Nop, Recv, Reduce, Schedule, Send, Slice
from mlfabric.transport.base import CONTROL_CHANNEL, Message, SendHandle, Transport, tensor_bytes

from .trace import Tracer
from .control import ControlKind, Farewell, Status, abort_error, control_tag, encode_abort, split_control_tag

log = logging.getLogger("mlfabric.runtime")

# Builder tags occupy the low 24 bits; the collective's sequence number sits above them so
# messages of consecutive collectives can never be confused.
TAG_BITS = 24
# The progress thread sleeps until the mailbox changes (an arrival, a send completion, a lost
# peer) or the earliest deadline comes; at most this long. Why not a short poll: with many
# processes per core, the wake-ups of idle progress threads cost a tenth of a round's CPU.
_MAX_IDLE_S = 1.0
# A receive into a buffer slice (no reduction) of at least this many bytes offers the slice to
# the transport, which may receive the payload straight into it (Transport.take_or_offer);
# below it a copy costs less than the bookkeeping.
OFFER_MIN_BYTES = 64 * 1024
# Passes a receiving thread makes at most before it leaves the rest to the progress thread.
_INLINE_PASSES = 4
# A collective with no progress for this long asks the peers it waits for to compare their
# description of it: ranks that disagree on root or algorithm may exchange no message at all,
# and would otherwise wait for the timeout. Short enough to report a mismatch well within 2 s;
# long enough that a healthy collective rarely asks (and asking costs one small message).
CROSS_CHECK_S = 0.5
# How often queued messages nobody takes are compared with the collective they belong to (a
# mismatch in which every rank finishes its own view, e.g. two disjoint broadcast trees).
_STRAY_CHECK_S = 0.25
# How many finished collectives' descriptions are kept to answer late queries and messages.
_REMEMBERED = 1024


def message_tag(seq: int, op_tag: int) -> int:
    return (seq << TAG_BITS) | op_tag


_REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "sum": lambda dst, src: dst.add_(src),
    "prod": lambda dst, src: dst.mul_(src),
    "max": lambda dst, src: torch.maximum(dst, src, out=dst),
    "min": lambda dst, src: torch.minimum(dst, src, out=dst),
}


# The same reductions on numpy arrays (see host_array).
_NUMPY_REDUCERS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "sum": lambda dst, src: np.add(dst, src, out=dst),
    "prod": lambda dst, src: np.multiply(dst, src, out=dst),
    "max": lambda dst, src: np.maximum(dst, src, out=dst),
    "min": lambda dst, src: np.minimum(dst, src, out=dst),
}


def host_array(t: torch.Tensor) -> torch.Tensor | np.ndarray:
    """A numpy array sharing ``t``'s memory (a CPU tensor), or ``t`` itself if numpy has no
    such dtype (bfloat16). Why: with many processes sharing few cores every process runs
    with cold caches, and there a small torch op (dispatcher, a new tensor object) costs tens
    of microseconds against a few for numpy: a round's small slices, copies and reductions
    were most of its CPU time."""
    try:
        return t.detach().numpy() if t.requires_grad else t.numpy()
    except (TypeError, RuntimeError):
        return t


class Waiter:
    """The part of ``torch.futures.Future`` a blocking call needs (``set_result``,
    ``set_exception``, ``done``, ``wait``), on a plain lock. The blocking collectives use it
    instead of a torch future, whose creation and completion cost ~50 us each with the cold
    caches of many processes per core; the ``*_async`` calls still return torch futures."""

    __slots__ = ("_ready", "_value", "_error")

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()  # released once, when the result is set
        self._value: object = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return not self._ready.locked()

    def set_result(self, value: object) -> None:
        self._value = value
        self._ready.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._ready.release()

    def wait(self) -> object:
        with self._ready:
            pass
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What a collective is, for tags, mismatch detection and error messages."""

    seq: int
    description: str  # e.g. "allreduce(ring, sum) of 1000 x float32" — compared across ranks
    algorithm: str = ""  # the schedule builder, e.g. "allreduce:ring" (for traces)


class _Run:
    """The state of one execution of one schedule.

    The executor drives anything with this run's interface (``advance``, ``finished``,
    ``deadline``, ``info``, ``fail``, ``waiting_on``, ``tolerates_lost_peers``): the
    persistent partial collectives of ``runtime/partial.py`` plug in that way.
    """

    # A run that handles lost peers itself (partial collectives re-form their group).
    tolerates_lost_peers = False
    # Whether receives may offer their destination to the transport. A run that can finish
    # with receives still pending (partial collectives) must not: a late message would land
    # in a buffer that is no longer waiting for it.
    offers_destinations = True
    # The run is finished when every op from this index on has completed (a partial
    # collective's activation ops may stay unmatched); 0: every op.
    required_from = 0
    # Op whose firing calls on_fire_hook() first (-1: none); a partial collective fills its
    # buffer from the send buffer when its reduction starts. Hooks instead of overriding
    # _fire/_complete: those run for every op, and a call level there costs on every message.
    hook_index = -1

    def on_fire_hook(self) -> None:
        """Called as op :attr:`hook_index` fires."""

    def __init__(self, executor: "Executor", schedule: Schedule, buffers: dict[str, torch.Tensor],
                 info: RunInfo, deadline: float, future: "torch.futures.Future | Waiter",
                 result: Callable[[], object]) -> None:
        self.executor = executor
        self.schedule = schedule
        self.buffers = buffers
        self.future = future
        self.result = result
        self.dependents = schedule.dependents()
        self.required = len(schedule.ops) - self.required_from  # see finished
        # Views of the ops' slices and byte views of what sends send, built on first use:
        # the buffers live as long as the run (a persistent partial collective re-arms the
        # same run), and building a view costs more than a small message's own work.
        self._views: dict[int, torch.Tensor | np.ndarray] = {}  # by id() of the Slice
        # Ops touch the buffers through numpy where the dtype allows (host_array); one run's
        # buffers share a dtype, so they all do or none does.
        self.arrays = {name: host_array(t) for name, t in buffers.items()}
        self._numpy = all(isinstance(a, np.ndarray) for a in self.arrays.values())
        self._reducers = _NUMPY_REDUCERS if self._numpy else _REDUCERS
        self._itemsize = {name: t.element_size() for name, t in buffers.items()}
        self._send_bytes: dict[int, memoryview] = {}  # by op index
        self.pending_recvs: list[int] = []
        self.recv_keys: dict[int, tuple[str, int]] = {}  # mailbox key of each pending receive
        self._initial = self._initial_state()  # start() copies it at every (re-)arming
        self.info_description: str | None = None  # what ``meta`` encodes
        # The timeline (runtime/trace.py), or None: then nothing below costs a clock read.
        self.tracer = executor.tracer
        self.send_started: dict[int, float] = {}  # op index -> when a pending send was handed over
        self.recv_posted: dict[int, float] = {}  # op index -> when a receive was posted
        self.start(info, deadline)

    def _initial_state(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        """Which ops count as fired, and which are ready, when an execution starts: the ops
        without dependencies (cached on the schedule)."""
        return self.schedule.start_state()

    def start(self, info: RunInfo, deadline: float) -> None:
        """(Re-)arm: every op unfired, as at the start of an execution."""
        self.unpost()  # a re-armed run's receives still open from its last execution
        fired, ready = self._initial
        self.info = info
        self.tag_base = message_tag(info.seq, 0)  # | an op's tag: its messages' tag
        if info.description != self.info_description:
            self.info_description = info.description
            self.meta = info.description.encode()
        self.deadline = deadline
        # When the run last did anything, whether it asked its peers since, how often the
        # watchdog has logged it since, and when the executor must look at it next for that.
        self.started = self.last_progress = time.monotonic()
        self.queried = False
        self.barked = 0
        self.check_at = self.last_progress + CROSS_CHECK_S
        self.peer_status: dict[int, Status] = {}  # what the peers it asked said
        self.waiting = list(self.schedule.dependency_counts())
        self.fired = list(fired)
        self.completed = 0  # ops from required_from on that completed
        self.ready: deque[int] = deque(ready)
        self.pending_recvs: list[int] = []
        self.recv_keys: dict[int, tuple[str, int]] = {}  # mailbox key of each pending receive
        # Messages the executor routed straight to pending receives (Executor._route).
        self.arrived: list[tuple[int, Message]] = []
        self.pending_sends: list[tuple[int, SendHandle]] = []
        self.offered: set[int] = set()  # receives whose destination the transport holds
        self.seen_version = -1  # mailbox version when pending receives were last matched

    @property
    def finished(self) -> bool:
        return self.completed == self.required

    @property
    def wake_at(self) -> float:
        """When the executor must look at this run even if nothing arrives (its deadline, or a
        stall check)."""
        return min(self.deadline, self.check_at)

    def view(self, sl: Slice) -> torch.Tensor | np.ndarray:
        """``sl`` of its buffer: a numpy array, or a tensor for dtypes numpy lacks."""
        view = self._views.get(id(sl))  # the schedule keeps its slices alive: ids are stable
        if view is None:
            view = self._views[id(sl)] = self.arrays[sl.buffer][sl.offset:sl.end]
        return view

    def nbytes(self, sl: Slice) -> int:
        """Size of ``sl`` in bytes, without building its view."""
        return sl.length * self._itemsize[sl.buffer]

    def _copy(self, dst: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
        if self._numpy:
            np.copyto(dst, src)
        else:
            dst.copy_(src)

    def advance(self, version: int) -> bool:
        """Do everything that can be done now; True if anything happened. ``version`` is the
        mailbox version read before this call: pending receives are only re-matched when it
        moved, so an idle wake-up costs nothing per pending op."""
        progressed = False
        if self.arrived:
            arrived, self.arrived = self.arrived, []
            for index, msg in arrived:
                self.pending_recvs.remove(index)
                self._accept(index, msg)
            progressed = True
        if self.pending_sends:
            still = []
            for index, handle in self.pending_sends:
                if handle.done():
                    if self.tracer is not None:
                        self._trace_transfer("send", index, self.send_started.pop(index, None))
                    self._complete(index)
                    progressed = True
                else:
                    still.append((index, handle))
            self.pending_sends = still
        if self.pending_recvs and version != self.seen_version:
            self.seen_version = version
            queued, keys = self.executor.transport.mailbox.queued, self.recv_keys
            still_recv = []
            for index in self.pending_recvs:
                # Most pending receives have nothing queued: test that without a call.
                if keys[index] in queued and self._try_recv(index):
                    progressed = True
                else:
                    still_recv.append(index)
            self.pending_recvs = still_recv
        while self.ready:
            progressed = True
            self._fire(self.ready.popleft())
        return progressed

    def _fire(self, index: int) -> None:
        if index == self.hook_index:
            self.on_fire_hook()
        op = self.schedule.ops[index]
        if isinstance(op, Send):
            payload = self._send_bytes.get(index)
            if payload is None:
                payload = self._send_bytes[index] = tensor_bytes(self.view(op.src))
            handed_at = time.monotonic() if self.tracer is not None else 0.0
            handle = self.executor.transport.send(
                op.peer, self.tag_base | op.tag, payload, channel=op.channel, meta=self.meta,
            )
            if handle.done():
                if self.tracer is not None:
                    self._trace_transfer("send", index, handed_at)
                self._complete(index)
            else:
                self.pending_sends.append((index, handle))
                if self.tracer is not None:
                    self.send_started[index] = handed_at
        elif isinstance(op, Recv):
            if self.tracer is not None:
                self.recv_posted[index] = time.monotonic()
            if not self._try_recv(index):
                tag = self.tag_base | op.tag
                self.recv_keys[index] = (op.channel, tag)
                self.pending_recvs.append(index)
                if index not in self.offered:  # an offered one arrives in place instead
                    self.executor._posted[(op.channel, tag, op.peer)] = (self, index)
        elif isinstance(op, Reduce):
            self._reducers[op.op](self.view(op.dst), self.view(op.src))
            self._complete(index)
        elif isinstance(op, Copy):
            self._copy(self.view(op.dst), self.view(op.src))
            self._complete(index)
        elif isinstance(op, Nop):
            self._complete(index)
        else:  # pragma: no cover - the IR has no other op kinds
            raise TypeError(f"unknown op {op!r}")

    def _try_recv(self, index: int) -> bool:
        op: Recv = self.schedule.ops[index]  # type: ignore[assignment]
        transport = self.executor.transport
        tag = self.tag_base | op.tag
        if index in self.offered:
            msg = transport.mailbox.take(op.channel, tag, op.peer)
            if msg is not None:
                self.offered.discard(index)
                transport.withdraw_offer(op.channel, tag, op.peer)  # it may have come the other way
        elif (self.offers_destinations and not op.reduce
              and self.nbytes(op.dst) >= OFFER_MIN_BYTES):
            msg = transport.take_or_offer(op.channel, tag, op.peer, tensor_bytes(self.view(op.dst)), self.meta)
            if msg is None:
                self.offered.add(index)
        else:
            msg = transport.mailbox.take(op.channel, tag, op.peer)
        if msg is None:
            return False
        self.executor._posted.pop((op.channel, tag, op.peer), None)
        self._accept(index, msg)
        return True

    def _accept(self, index: int, msg: Message) -> None:
        """Receive ``msg`` for receive op ``index``: check it, land its payload, complete."""
        op: Recv = self.schedule.ops[index]  # type: ignore[assignment]
        if msg.meta != self.meta or msg.nbytes != self.nbytes(op.dst):
            self._check_message(op, msg)  # raises, saying which
        if self.tracer is not None:
            self._trace_transfer("recv", index, self.recv_posted.pop(index, None))
        dst = self.view(op.dst)
        if len(dst) and not msg.in_place:
            if self._numpy:
                incoming = np.frombuffer(msg.payload, dtype=dst.dtype)
            else:
                incoming = torch.frombuffer(msg.payload, dtype=dst.dtype)
            if op.reduce:
                self._reducers[op.reduce](dst, incoming)
            else:
                self._copy(dst, incoming)
        self._complete(index)

    def _trace_transfer(self, direction: str, index: int, start: float | None) -> None:
        op = self.schedule.ops[index]
        nbytes = self.nbytes(op.src if direction == "send" else op.dst)  # type: ignore[union-attr]
        end = time.monotonic()
        self.tracer.transfer(direction=direction, peer=op.peer, channel=op.channel, nbytes=nbytes,  # type: ignore[union-attr]
                             start=end if start is None else start, end=end, seq=self.info.seq, op=index)

    def _check_message(self, op: Recv, msg: Message) -> None:
        if msg.meta != self.meta:
            raise mismatch_error(self.executor.rank, self.info.seq, msg.src, self.meta, msg.meta)
        expected = self.nbytes(op.dst)
        if msg.nbytes != expected:
            raise CollectiveMismatchError(
                f"rank {self.executor.rank}: collective #{self.info.seq} expected {expected} bytes "
                f"from peer {msg.src} (tag {op.tag}) but got {msg.nbytes}",
                rank=self.executor.rank, peer=msg.src,
            )

    def _complete(self, index: int) -> None:
        if index >= self.required_from:
            self.completed += 1
        ops = self.schedule.ops
        for j in self.dependents[index]:
            if self.fired[j]:
                continue  # consumable: an any-of op already fired
            if ops[j].mode is DepMode.ANY:
                self.fired[j] = True
                self.ready.append(j)
            else:
                self.waiting[j] -= 1
                if self.waiting[j] == 0:
                    self.fired[j] = True
                    self.ready.append(j)

    def unpost(self) -> None:
        """Take this run's pending receives out of the executor's routing table (it finished,
        failed, was abandoned or re-arms): a message for them goes to the mailbox."""
        posted = self.executor._posted
        for index in self.pending_recvs:
            key = (*self.recv_keys[index], self.schedule.ops[index].peer)
            if posted.get(key, (None, -1))[0] is self:
                del posted[key]

    def fail(self, error: CollectiveError) -> None:
        self.unpost()
        self.withdraw_offers()
        if not self.future.done():
            self.future.set_exception(error)

    def withdraw_offers(self) -> None:
        """Take back every destination still offered to the transport."""
        transport = self.executor.transport
        for index in self.offered:
            op = self.schedule.ops[index]
            transport.withdraw_offer(op.channel, self.tag_base | op.tag, op.peer)
        self.offered.clear()

    def waited_peers(self) -> list[int]:
        """The peers this run waits for: those of its pending receives and sends."""
        ops = self.schedule.ops
        peers = [ops[i].peer for i in self.pending_recvs] + [ops[i].peer for i, _ in self.pending_sends]
        return sorted(set(peers))

    def waiting_on(self) -> str:
        """Human summary of what is still outstanding, for timeout messages."""
        parts = []
        for index in self.pending_recvs[:4]:
            op = self.schedule.ops[index]
            parts.append(f"recv from peer {op.peer} (op {index}, channel {op.channel!r})")
        for index, _ in self.pending_sends[:2]:
            op = self.schedule.ops[index]
            parts.append(f"send to peer {op.peer} (op {index})")
        if not parts:
            parts.append(f"{self.required - self.completed} ops blocked on dependencies")
        return ", ".join(parts)


def mismatch_error(rank: int, seq: int, peer: int, mine: bytes, theirs: bytes) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"rank {rank}: collective #{seq} mismatch with rank {peer}: this rank called "
        f"{mine.decode(errors='replace')}, rank {peer} called {theirs.decode(errors='replace')}. "
        "Every rank must call the same collectives in the same order with the same arguments "
        "(algorithm, root, size, dtype, op).", rank=rank, peer=peer)


class Executor:
    """One progress thread per communicator, executing any number of schedules at once.

    ``watchdog_s``: log a collective that made no progress for this long (and again after
    each further ``watchdog_s``); None or 0: no watchdog."""

    def __init__(self, transport: Transport, *, name: str = "mlfabric-progress",
                 watchdog_s: float | None = None, tracer: Tracer | None = None) -> None:
        if watchdog_s is not None and watchdog_s < 0:
            raise ValueError(f"watchdog_s must be >= 0 (0: off), got {watchdog_s}")
        self.transport = transport
        self.rank = transport.rank
        self.watchdog_s = watchdog_s or None
        self.tracer = tracer  # written when the executor closes
        self._lock = threading.Lock()
        self._incoming: list[_Run] = []
        self._active: list[_Run] = []
        # The descriptions of recently finished collectives, by seq: to recognise a late abort
        # notice for one of them, and to answer queries and check late messages.
        self._finished: dict[int, bytes] = {}
        self._failed: dict[int, None] = {}  # those of them that failed here (an ordered set)
        self._max_seq = 0  # the last collective submitted
        # Queries about collectives this rank has not started yet: (peer, their description).
        self._early_queries: dict[int, list[tuple[int, bytes]]] = {}
        # (seq, peer) pairs whose status answer the watchdog logs.
        self._watched: set[tuple[int, int]] = set()
        self._farewells: dict[int, Farewell] = {}  # decoded goodbye notes, by departed rank
        self._next_stray_check = 0.0
        self._deferred_error: CollectiveError | None = None
        self._stop = False
        # Serialises passes over the runs: the progress thread's and those a transport runs
        # on its receiving threads (_inline_pass).
        self._pass_lock = threading.Lock()
        # Pending receives by (channel, tag, source), for messages routed straight to them
        # (_route). Changed only under _pass_lock.
        self._posted: dict[tuple[str, int, int], tuple[_Run, int]] = {}
        # The earliest wake_at of the active runs (as of the last pass), and until when the
        # progress thread sleeps: a pass on another thread that finds an earlier deadline
        # wakes it.
        self._wake_at = math.inf
        self._sleep_until = math.inf
        transport.set_inline_progress(self._inline_pass, self._route)
        transport.on_peer_lost(lambda peer, reason: transport.mailbox.notify())
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, schedule: Schedule, buffers: dict[str, torch.Tensor], info: RunInfo, *,
               timeout: float, result: Callable[[], object], kick: bool = True,
               blocking: bool = False) -> torch.futures.Future | Waiter:
        """Start executing ``schedule``; the future resolves to ``result()`` when done.
        ``kick=False``: the caller calls :meth:`kick` itself (after releasing its locks).
        ``blocking``: a :class:`Waiter` instead of a torch future (the caller waits at once)."""
        future: torch.futures.Future | Waiter = Waiter() if blocking else torch.futures.Future()
        if self._stop:
            future.set_exception(CollectiveError(f"rank {self.rank}: communicator is closed", rank=self.rank))
            return future
        if info.seq > self._max_seq:
            self._max_seq = info.seq
        lost = self._lost_peer_error(info) or self._departure_error(info)
        error = lost or self._deferred_error
        if error is not None:
            self._deferred_error = None
            future.set_exception(error)
            return future
        dtype = next(iter(buffers.values())).dtype
        for name, size in schedule.buffers.items():
            if name not in buffers:
                buffers[name] = torch.empty(size, dtype=dtype)
        run = _Run(self, schedule, buffers, info, time.monotonic() + timeout, future, result)
        self.attach(run, kick=kick)
        return future

    def attach(self, run: "_Run", *, kick: bool = True) -> None:
        """Hand a run (or anything with its interface) to the progress thread."""
        if self._stop:
            run.fail(CollectiveError(f"rank {self.rank}: communicator is closed", rank=self.rank))
            return
        with self._lock:
            self._incoming.append(run)
        if kick:
            self.kick()

    def kick(self) -> None:
        """Something new is waiting (a run, a call): look at it on this thread if the
        transport allows (as its receiving threads do), else wake the progress thread.
        A pass may complete futures, whose callbacks then run here: never kick while
        holding a lock that such a callback could take."""
        if not (self.transport.inline_progress and self._inline_pass()):
            self.transport.mailbox.notify()

    def close(self) -> None:
        self._stop = True
        self.transport.mailbox.notify()
        self._thread.join(timeout=5)
        if self.tracer is not None:
            self.tracer.close()

    # -- the progress loop -------------------------------------------------------------------

    def _loop(self) -> None:
        mailbox = self.transport.mailbox
        while not self._stop:
            version = mailbox.version
            with self._pass_lock:
                self._pass(version)
                self._sleep_until = min(self._wake_at, time.monotonic() + _MAX_IDLE_S)
            # Returns at once if anything happened since ``version`` was read (see _settle).
            self.transport.progress(version, max(0.0, self._sleep_until - time.monotonic()) + 0.001)
        with self._pass_lock:
            for run in self._active + self._incoming:
                self._fail(run, CollectiveError(f"rank {self.rank}: communicator closed during "
                                                f"collective #{run.info.seq}", rank=self.rank),
                           notify_peers=False)

    def _inline_pass(self) -> bool:
        """Progress on the thread that just delivered a message (Transport.set_inline_progress),
        which saves the progress thread's wake-up per message. False when the progress thread
        must look instead: it is in a pass itself, or there is still more to do."""
        if self._stop or not self._pass_lock.acquire(blocking=False):
            return False
        try:
            return self._settle()
        finally:
            self._pass_lock.release()

    def _route(self, msg: Message) -> bool:
        """Hand ``msg`` straight to the pending receive waiting for it and progress, on the
        thread that delivered it: no mailbox queue, no search of pending receives. False if
        no receive waits for it yet (or another thread is in a pass): the mailbox takes it."""
        key = (msg.channel, msg.tag, msg.src)
        if key not in self._posted:  # lock-free look first: a dict lookup is atomic
            return False
        if self._stop or not self._pass_lock.acquire(blocking=False):
            return False
        try:
            entry = self._posted.pop(key, None)
            if entry is None or entry[1] not in entry[0].pending_recvs:
                return False
            entry[0].arrived.append((entry[1], msg))
            if not self._settle():
                self.transport.mailbox.notify()  # the progress thread carries on
            return True
        finally:
            self._pass_lock.release()

    def _settle(self) -> bool:
        """Passes until nothing is left to do (True) or _INLINE_PASSES were made (False).
        Holds ``_pass_lock``."""
        mailbox = self.transport.mailbox
        for _ in range(_INLINE_PASSES):
            if self._stop:
                return False
            version = mailbox.version
            self._pass(version)
            if mailbox.version == version:
                # A pass does everything it can; only an event during it (a delivery, a send
                # completed, a new call's notify) can have left more to do. Not making a
                # second pass just to find that out halves the passes.
                return True
        return False

    def _pass(self, version: int) -> None:
        """One look at everything (``version``: the mailbox's, read before). Whether another
        pass is due is the mailbox version's to say (see _settle). Holds ``_pass_lock``."""
        if self._incoming:  # lock-free test first: most wake-ups bring no new run
            with self._lock:
                new = list(self._incoming)
                self._active.extend(new)
                self._incoming.clear()
            if self._early_queries:
                for run in new:
                    for peer, theirs in self._early_queries.pop(run.info.seq, ()):
                        if run in self._active and theirs != run.meta:
                            self._fail(run, mismatch_error(self.rank, run.info.seq, peer, run.meta, theirs),
                                       notify_peers=True)
        self._handle_control()
        wake_at = math.inf
        now = time.monotonic()  # one clock read per pass: a deadline is checked a pass late at worst
        for run in list(self._active):
            try:
                if run.advance(version) and not run.tolerates_lost_peers:
                    run.last_progress, run.queried, run.barked = now, False, 0
                    run.check_at = now + CROSS_CHECK_S
                if run.finished:
                    self._finish(run)
                    continue
                if now > run.deadline:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: collective #{run.info.seq} "
                        f"{run.info.description} timed out still waiting for "
                        f"{run.waiting_on()}{self._peer_report(run)}; a peer may be slow, hung or "
                        "dead (raise the timeout with mlfabric.init(timeout=...))",
                        rank=self.rank,
                    )
                if now >= run.wake_at and not run.tolerates_lost_peers:
                    self._stalled(run, now)
                run_wake_at = run.wake_at
                if run_wake_at < wake_at:
                    wake_at = run_wake_at
            except CollectiveError as exc:
                self._fail(run, exc, notify_peers=True)
            except Exception as exc:  # a bug or a torch error: never leave the caller hanging
                wrapped = CollectiveError(
                    f"rank {self.rank}: collective #{run.info.seq} {run.info.description} "
                    f"failed: {exc!r}", rank=self.rank)
                wrapped.__cause__ = exc
                self._fail(run, wrapped, notify_peers=True)
        if (self.transport.lost_peers or self.transport.departed_peers) and self._active:
            for run in list(self._active):
                error = (None if run.tolerates_lost_peers
                         else self._lost_peer_error(run.info) or self._departure_error(run.info))
                if error is not None:
                    self._fail(run, error, notify_peers=False)
        if now >= self._next_stray_check and self.transport.mailbox.queued:
            self._next_stray_check = now + _STRAY_CHECK_S
            self._check_strays()
        self._wake_at = wake_at
        if wake_at < self._sleep_until and threading.current_thread() is not self._thread:
            self.transport.mailbox.notify()  # the progress thread sleeps past a new deadline

    def _finish(self, run: _Run) -> None:
        self._active.remove(run)
        run.unpost()
        if not run.tolerates_lost_peers:
            self._remember(run, failed=False)
        try:
            value = run.result()
        except Exception as exc:
            run.future.set_exception(exc)
            return
        run.future.set_result(value)

    def _remember(self, run: _Run, *, failed: bool) -> None:
        if self.tracer is not None:
            self._trace_collective(run, "failed" if failed else "ok")
        self._finished[run.info.seq] = run.meta
        if len(self._finished) > _REMEMBERED:
            del self._finished[next(iter(self._finished))]  # the oldest (dicts keep order)
        if failed:
            self._failed[run.info.seq] = None
            if len(self._failed) > _REMEMBERED:
                del self._failed[next(iter(self._failed))]

    def _trace_collective(self, run: _Run, outcome: str) -> None:
        data = run.buffers.get("data")
        nbytes = 0 if data is None else data.numel() * data.element_size()
        self.tracer.collective(seq=run.info.seq, description=run.info.description,  # type: ignore[union-attr]
                               algorithm=run.info.algorithm, nbytes=nbytes, start=run.started,
                               end=time.monotonic(), outcome=outcome)

    def _fail(self, run: _Run, error: CollectiveError, *, notify_peers: bool) -> None:
        if run in self._active:
            self._active.remove(run)
        if not run.tolerates_lost_peers:
            self._remember(run, failed=True)
        if notify_peers:
            self._broadcast_abort(run.info.seq, error)
        run.fail(error)

    def _lost_peer_error(self, info: RunInfo) -> PeerLostError | None:
        lost = self.transport.lost_peers
        if not lost:
            return None
        peer, reason = next(iter(lost.items()))
        return PeerLostError(
            f"rank {self.rank}: collective #{info.seq} {info.description} cannot complete: "
            f"peer {peer} was lost ({reason})",
            rank=self.rank, peer=peer,
        )

    # -- departures ------------------------------------------------------------------------

    def farewell(self, reason: str) -> bytes:
        """The note this rank's goodbye carries (see control.Farewell): the collectives it
        leaves unfinished, so that peers fail those at once instead of waiting."""
        runs = list(self._active) + list(self._incoming)
        unfinished = tuple(sorted(r.info.seq for r in runs if not r.tolerates_lost_peers))
        return Farewell(reason=reason, last_seq=self._max_seq, unfinished=unfinished).encode()

    def _departure_error(self, info: RunInfo) -> PeerLeftError | None:
        """The error of collective ``info`` if a peer that left will never finish it."""
        for peer in sorted(self.transport.departed_peers):
            note = self._farewells.get(peer)
            if note is None:
                note = self._farewells[peer] = Farewell.decode(self.transport.farewells.get(peer, b""))
            if note.abandons(info.seq):
                unfinished = ", in the middle of it" if info.seq in note.unfinished else ""
                return PeerLeftError(
                    f"rank {self.rank}: collective #{info.seq} {info.description} cannot complete: "
                    f"rank {peer} left the job ({note.reason}; its last collective was "
                    f"#{note.last_seq}{unfinished}). Every rank must make the same collective calls "
                    "before it closes its communicator or exits.", rank=self.rank, peer=peer)
        return None

    # -- stalls: cross-checks and the watchdog ---------------------------------------------

    def _stalled(self, run: _Run, now: float) -> None:
        """``run`` made no progress since ``run.last_progress``: ask the peers it waits for
        (once per stall), and let the watchdog log it every ``watchdog_s``."""
        idle = now - run.last_progress
        peers = run.waited_peers()
        if not run.queried:
            run.queried = True
            self._query(run, peers)
        watchdog = self.watchdog_s
        if watchdog is not None and idle >= watchdog * (run.barked + 1):
            run.barked += 1
            last = next(reversed(self._finished), None)
            log.warning(
                "rank %d: watchdog: collective #%d %s has made no progress for %.1f s (timeout in "
                "%.1f s); waiting for %s%s. Last finished collective: %s. Asking ranks %s what they "
                "are doing.", self.rank, run.info.seq, run.info.description, idle,
                max(0.0, run.deadline - now), run.waiting_on(), self._peer_report(run),
                "none" if last is None else f"#{last} {self._finished[last].decode(errors='replace')}",
                ", ".join(map(str, peers)) or "(none)")
            self._watched.update((run.info.seq, peer) for peer in peers)
            self._query(run, peers)
        run.check_at = (math.inf if watchdog is None else run.last_progress + watchdog * (run.barked + 1))

    def _query(self, run: _Run, peers: list[int]) -> None:
        tag = control_tag(ControlKind.QUERY, run.info.seq)
        for peer in peers:
            self._send_control(peer, tag, run.meta)

    def _send_control(self, peer: int, tag: int, payload: bytes) -> None:
        if peer in self.transport.lost_peers or peer in self.transport.departed_peers:
            return
        try:
            self.transport.send(peer, tag, payload, channel=CONTROL_CHANNEL)
        except Exception:  # best effort: the peer may be gone already
            log.debug("rank %d: could not send a control message to %d", self.rank, peer)

    def _peer_report(self, run: _Run) -> str:
        """What the peers ``run`` asked said about it, for error and watchdog messages."""
        if not run.peer_status:
            return ""
        return "; " + "; ".join(status.explain(peer) for peer, status in sorted(run.peer_status.items()))

    def _regular_run(self, seq: int) -> _Run | None:
        return next((r for r in self._active if r.info.seq == seq and not r.tolerates_lost_peers), None)

    def _answer(self, src: int, seq: int, theirs: bytes) -> None:
        """A peer asks about collective ``seq``, which it runs as ``theirs``: compare, answer."""
        run = self._regular_run(seq)
        mine = run.meta if run is not None else self._finished.get(seq)
        if mine is not None and mine != theirs:
            self._mismatch(seq, src, mine, theirs)
        elif mine is None and seq > self._max_seq and len(self._early_queries) < _REMEMBERED:
            self._early_queries.setdefault(seq, []).append((src, theirs))  # compared when it starts
        if run is not None:
            status = Status(seq=seq, state="running", last_seq=self._max_seq, waiting_on=run.waiting_on(),
                            description=run.info.description)
        elif mine is not None:
            status = Status(seq=seq, state="finished", last_seq=self._max_seq)
        else:
            status = Status(seq=seq, state="not started" if seq > self._max_seq else "unknown",
                            last_seq=self._max_seq)
        self._send_control(src, control_tag(ControlKind.STATUS, seq), status.encode())

    def _note_status(self, src: int, seq: int, payload: bytes) -> None:
        try:
            status = Status.decode(payload)
        except (ValueError, TypeError):
            return
        run = self._regular_run(seq)
        if run is not None:
            run.peer_status[src] = status
        if (seq, src) in self._watched:
            self._watched.discard((seq, src))
            log.warning("rank %d: watchdog: collective #%d: %s", self.rank, seq, status.explain(src))

    def _mismatch(self, seq: int, peer: int, mine: bytes, theirs: bytes) -> None:
        """Collective ``seq`` is ``mine`` here and ``theirs`` on ``peer``: fail it on every rank."""
        error = mismatch_error(self.rank, seq, peer, mine, theirs)
        run = self._regular_run(seq)
        if run is not None:
            self._fail(run, error, notify_peers=True)
            return
        # Finished here in this rank's own view (e.g. as the root of a broadcast whose other
        # ranks named another root): its result cannot be trusted; the next call says so.
        log.error("%s (found after it finished here: the next collective raises it)", error)
        self._deferred_error = error
        self._broadcast_abort(seq, error)

    def _check_strays(self) -> None:
        """Compare queued messages of known collectives with their description: a message
        nobody takes, from a peer that runs the collective differently, is a mismatch."""
        mailbox = self.transport.mailbox
        for channel, tag in list(mailbox.queued):
            if channel == CONTROL_CHANNEL:
                continue
            seq = tag >> TAG_BITS
            run = self._regular_run(seq)
            mine = run.meta if run is not None else self._finished.get(seq)
            if mine is None:
                continue
            for src, meta in mailbox.peek(channel, tag):
                if meta != mine:
                    mailbox.take(channel, tag, src)  # reported once
                    self._mismatch(seq, src, mine, meta)
                    return

    # -- abort notices -----------------------------------------------------------------------

    def _broadcast_abort(self, seq: int, error: CollectiveError) -> None:
        payload = encode_abort(error)
        tag = control_tag(ControlKind.ABORT, seq)
        for peer in range(self.transport.world_size):
            if peer != self.rank:
                self._send_control(peer, tag, payload)

    def _handle_control(self) -> None:
        for msg in self.transport.mailbox.take_channel(CONTROL_CHANNEL):
            kind, seq = split_control_tag(msg.tag)
            if kind is ControlKind.QUERY:
                self._answer(msg.src, seq, bytes(msg.payload))
                continue
            if kind is ControlKind.STATUS:
                self._note_status(msg.src, seq, msg.payload)
                continue
            if kind is not ControlKind.ABORT:
                continue
            if seq in self._failed:
                continue  # it failed here already, and said so
            error = abort_error(msg.payload, rank=self.rank, src=msg.src, seq=seq)
            run = next((r for r in self._active if r.info.seq == seq), None)
            if run is not None:
                self._fail(run, error, notify_peers=False)
            elif seq in self._finished:
                # We finished but a peer did not: the group is inconsistent, so the next
                # collective on this rank reports it instead of silently going on.
                self._deferred_error = error
            else:
                with self._lock:
                    pending = next((r for r in self._incoming if r.info.seq == seq), None)
                    if pending is not None:
                        self._incoming.remove(pending)
                if pending is not None:
                    self._fail(pending, error, notify_peers=False)
                else:
                    self._deferred_error = error
