"""What every transport offers: tagged byte messages to a peer over a named channel.

A transport moves opaque payloads; it never knows what algorithm it serves. Incoming
messages land in a :class:`Mailbox` from which the runtime takes them by (channel, tag) and
either a given source or any source (parameter-server pushes and eager-SGD activations
arrive unannounced). Sends are asynchronous and return a :class:`SendHandle`: the payload
must not be modified until ``done()`` (zero-copy transports read it in the background).

Every message carries the job token; a message with a wrong token is logged and dropped, so
nothing from outside the job reaches a tensor. Byte counters per (peer, channel) let tests
compare traffic with a schedule's stated cost and let monitors read link usage.

Exercise it with ``python -m pytest tests/unit/test_transport.py``.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from mlfabric.errors import TransportError

log = logging.getLogger("mlfabric.transport")

# The runtime's control messages (abort notices, goodbyes) travel on this channel.
CONTROL_CHANNEL = "ctl"
TOKEN_BYTES = 16


@dataclass(slots=True)
class Message:
    src: int
    tag: int
    channel: str
    meta: bytes
    payload: memoryview
    # The payload was received straight into the destination offered for it
    # (Transport.take_or_offer): nothing is left to copy.
    in_place: bool = False

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


class SendHandle:
    """Completion of one send; ``done()`` once the transport no longer reads the payload.

    A transport whose handles complete later must call ``mailbox.notify()`` when they do:
    the progress thread sleeps until the mailbox changes.
    """

    __slots__ = ("_done",)

    def __init__(self, done: bool = False) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done

    def set_done(self) -> None:
        self._done = True


COMPLETED = SendHandle(done=True)


class AllSent(SendHandle):
    """Done once every one of ``handles`` is (:meth:`Transport.send_many`)."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[SendHandle]) -> None:
        super().__init__()
        self._handles = list(handles)

    def done(self) -> bool:
        if not self._done and all(h.done() for h in self._handles):
            self._done = True
            self._handles = []
        return self._done


def tensor_bytes(t: "torch.Tensor | np.ndarray") -> memoryview:
    """A zero-copy byte view of a contiguous 1-D CPU tensor (any dtype, bfloat16 included) or
    of a numpy array: what every sender hands :meth:`Transport.send` (beside :func:`byte_view`,
    its inverse on the way in)."""
    if len(t) == 0:
        return memoryview(b"")
    if isinstance(t, np.ndarray):
        return memoryview(t).cast("B")
    return memoryview(t.view(torch.uint8).numpy())


def byte_view(payload: memoryview | bytes) -> memoryview:
    """``payload`` as a flat byte view (the runtime's payloads are byte views already:
    :func:`tensor_bytes`; anything else is cast)."""
    if type(payload) is memoryview and payload.ndim == 1 and payload.format == "B" and payload.c_contiguous:
        return payload
    return memoryview(payload).cast("B")


@dataclass
class LinkCounters:
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0


class Mailbox:
    """Thread-safe store of delivered messages, plus a wake-up for anyone waiting on events.

    ``version`` increases on every delivery or event so a progress loop can sleep until
    something changed.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[tuple[str, int], deque[Message]] = {}
        # The (channel, tag) keys with queued messages, for lock-free membership tests by a
        # progress loop that polls many keys (see take). Read-only outside this class.
        self.queued = self._queues.keys()
        # Queued messages per channel, read without the lock by take_channel's fast path.
        self._per_channel: dict[str, int] = {}
        # (channel, tag, src) of messages to drop on arrival (see discard).
        self._discarded: set[tuple[str, int, int]] = set()
        self.version = 0
        # Called by notify(): a transport whose progress blocks in a socket poll uses it to
        # interrupt that poll.
        self.on_notify: Callable[[], None] | None = None

    def put(self, msg: Message, *, wake: bool = True) -> None:
        """Queue ``msg``; ``wake=False`` leaves waiters asleep (the caller then either takes
        care of the message or calls :meth:`notify`)."""
        with self._cond:
            if self._discarded:
                key = (msg.channel, msg.tag, msg.src)
                if key in self._discarded:
                    self._discarded.remove(key)
                    return  # nobody waits for it: no wake-up either
            self._queues.setdefault((msg.channel, msg.tag), deque()).append(msg)
            self._per_channel[msg.channel] = self._per_channel.get(msg.channel, 0) + 1
            self.version += 1
            if wake:
                self._cond.notify_all()

    def take(self, channel: str, tag: int, src: int | None = None) -> Message | None:
        """The oldest message with this channel and tag, from ``src`` or from anyone."""
        # A progress loop asks for many messages that have not arrived at every wake-up; the
        # lock-free look (a dict lookup is atomic) makes a miss cheap. It cannot lose a message:
        # put() inserts before it bumps ``version``, so a message missed here bumps the
        # version after the caller read it, and the caller looks again.
        if (channel, tag) not in self.queued:
            return None
        with self._cond:
            queue = self._queues.get((channel, tag))
            if not queue:
                return None
            if src is None:
                msg = queue.popleft()
            else:
                for i, candidate in enumerate(queue):
                    if candidate.src == src:
                        msg = candidate
                        del queue[i]
                        break
                else:
                    return None
            if not queue:
                del self._queues[(channel, tag)]
            self._per_channel[channel] -= 1
            return msg

    def take_channel(self, channel: str) -> list[Message]:
        """Every queued message of one channel (the control channel is drained this way)."""
        if not self._per_channel.get(channel):  # lock-free, as in take
            return []
        with self._cond:
            keys = [k for k in self._queues if k[0] == channel]
            out = [m for k in keys for m in self._queues.pop(k)]
            self._per_channel[channel] = 0
            return out

    def peek(self, channel: str, tag: int) -> list[tuple[int, bytes]]:
        """(source, meta) of the messages queued under this channel and tag, left queued."""
        with self._cond:
            return [(m.src, m.meta) for m in self._queues.get((channel, tag), ())]

    def discard(self, keys: list[tuple[str, int, int]]) -> None:
        """Drop one message per (channel, tag, src) key: the one queued now, or else the next
        to arrive, without a wake-up. For messages that may still come but that nobody will
        take (a partial collective's late activations); :meth:`forget` ends the wait."""
        with self._cond:  # re-entrant: take() below and a concurrent put() cannot interleave
            for channel, tag, src in keys:
                if self.take(channel, tag, src) is None:
                    self._discarded.add((channel, tag, src))

    def forget(self, keys: list[tuple[str, int, int]]) -> None:
        """Stop waiting to drop these keys' messages (bounds what :meth:`discard` keeps)."""
        with self._cond:
            self._discarded.difference_update(keys)

    def notify(self) -> None:
        with self._cond:
            self.version += 1
            self._cond.notify_all()
        if self.on_notify is not None:
            self.on_notify()

    def wait(self, seen_version: int, timeout: float) -> int:
        """Block until ``version`` differs from ``seen_version`` or ``timeout`` passes."""
        with self._cond:
            if self.version == seen_version:
                self._cond.wait(timeout)
            return self.version

    def pending(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())


class Transport(ABC):
    """Abstract transport for one rank. Subclasses implement ``_send`` and deliver incoming
    messages with :meth:`_deliver`."""

    # Whether set_inline_progress takes effect (see there).
    inline_progress = False

    def __init__(self, rank: int, world_size: int, channels: tuple[str, ...]) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not channels:
            raise ValueError("a transport needs at least one channel")
        self.rank = rank
        self.world_size = world_size
        self.channels = tuple(dict.fromkeys(channels))
        self.mailbox = Mailbox()
        self.lost_peers: dict[int, str] = {}
        #: The host of every rank (ranks that share memory share a host), when the transport
        #: learns it (tcp: at rendezvous); None when unknown. Hierarchical collectives use it.
        self.hosts: tuple[int, ...] | None = None
        self.departed_peers: set[int] = set()
        # The note each departed peer's goodbye carried (the runtime's Farewell), by rank.
        self.farewells: dict[int, bytes] = {}
        self.rejected_messages = 0
        self._counters: dict[tuple[int, str], LinkCounters] = {}
        self._counter_lock = threading.Lock()
        self._closed = False
        self._peer_lost_callbacks: list[Callable[[int, str], None]] = []
        self._inline_progress: Callable[[], bool] | None = None
        self._inline_route: Callable[[Message], bool] | None = None

    # -- sending ---------------------------------------------------------------------------

    def send(self, peer: int, tag: int, payload: memoryview | bytes, *,
             channel: str = "0", meta: bytes = b"") -> SendHandle:
        """Queue ``payload`` for ``peer``; the returned handle says when it may be reused."""
        self._check_send(peer, channel)
        view = byte_view(payload)
        self._count_sent(peer, channel, view.nbytes, 1)
        return self._send(peer, tag, view, channel, meta)

    def send_many(self, peer: int, messages: Sequence[tuple[int, memoryview | bytes, bytes]], *,
                  channel: str = "0") -> SendHandle:
        """Queue ``messages``, ``(tag, payload, meta)`` each, for ``peer`` in this order: the
        same as one :meth:`send` per message, handed over at once where the transport can
        (tcp: one system call for all of them, where a call per message cost ~35 µs and a
        parameter server answering four workers 33 tensors each spent ~5 ms in them). The
        returned handle is done once every payload may be reused. The default sends them one
        by one."""
        handles = [self.send(peer, tag, payload, channel=channel, meta=meta) for tag, payload, meta in messages]
        pending = [h for h in handles if not h.done()]
        return AllSent(pending) if pending else COMPLETED

    def _check_send(self, peer: int, channel: str) -> None:
        if self._closed:
            raise TransportError(f"rank {self.rank}: transport is closed")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: cannot send to peer {peer} (world size {self.world_size})")
        if channel != CONTROL_CHANNEL and channel not in self.channels:
            raise ValueError(f"rank {self.rank}: unknown channel {channel!r}; this transport has {self.channels}")

    def _count_sent(self, peer: int, channel: str, nbytes: int, messages: int) -> None:
        with self._counter_lock:
            counters = (self._counters.get((peer, channel))
                        or self._counters.setdefault((peer, channel), LinkCounters()))
            counters.bytes_sent += nbytes
            counters.msgs_sent += messages

    @abstractmethod
    def _send(self, peer: int, tag: int, payload: memoryview, channel: str, meta: bytes) -> SendHandle:
        ...

    # -- receiving -------------------------------------------------------------------------

    def _deliver(self, msg: Message) -> None:
        with self._counter_lock:
            counters = (self._counters.get((msg.src, msg.channel))
                        or self._counters.setdefault((msg.src, msg.channel), LinkCounters()))
            counters.bytes_recv += msg.nbytes
            counters.msgs_recv += 1
        if msg.channel == CONTROL_CHANNEL and msg.tag == GOODBYE_TAG:
            self.farewells[msg.src] = bytes(msg.payload)  # before departed_peers: readers look there first
            self.departed_peers.add(msg.src)
            self.mailbox.notify()
            return
        inline = self._inline_progress
        if inline is None:
            self.mailbox.put(msg)
            return
        route = self._inline_route
        if route is not None and route(msg):
            return  # taken by the receive waiting for it, and progressed
        # Progress right here instead of waking the progress thread; wake it (and anyone
        # in recv()) only if the pass could not run or left the message queued.
        self.mailbox.put(msg, wake=False)
        if not inline() or (msg.channel, msg.tag) in self.mailbox.queued:
            self.mailbox.notify()

    def set_inline_progress(self, progress: Callable[[], bool],
                            route: Callable[[Message], bool] | None = None) -> None:
        """Offered by the executor: ``progress()`` runs one pass over its collectives and
        returns False if it could not (or did not finish). A transport whose receiving
        threads are its own calls it after each delivery (``inline_progress = True``),
        sparing the progress thread a wake-up per message. Others ignore it: on the
        in-process transport the delivering thread is the *sender's* progress thread.
        ``route(msg)``, tried first, hands a message straight to the receive posted for it
        (and progresses): True if it took the message, which then skips the mailbox."""
        if self.inline_progress:
            self._inline_progress = progress
            self._inline_route = route

    def _reject(self, reason: str) -> None:
        self.rejected_messages += 1
        log.warning("rank %d: rejected a message from outside the job: %s", self.rank, reason)

    def try_recv(self, tag: int, *, src: int | None = None, channel: str = "0") -> Message | None:
        return self.mailbox.take(channel, tag, src)

    def take_or_offer(self, channel: str, tag: int, src: int, destination: memoryview,
                      meta: bytes) -> Message | None:
        """Take the message from ``src`` if it has arrived; if not, a transport that can
        receive into place keeps ``destination`` for its payload (used when size and meta
        match, and the message then arrives with ``in_place`` set). Until the message is taken
        or :meth:`withdraw_offer` is called, ``destination`` may be written at any time. The
        default only takes."""
        return self.mailbox.take(channel, tag, src)

    def withdraw_offer(self, channel: str, tag: int, src: int) -> None:
        """Take back a destination offered by :meth:`take_or_offer` (a message whose header
        was already read may still land in it)."""

    def recv(self, tag: int, *, src: int | None = None, channel: str = "0",
             timeout: float = 60.0) -> Message:
        """Blocking receive; raises :class:`TransportError` after ``timeout`` seconds or as
        soon as the awaited peer is known to be lost."""
        deadline = time.monotonic() + timeout
        version = self.mailbox.version
        while True:
            msg = self.mailbox.take(channel, tag, src)
            if msg is not None:
                return msg
            if src is not None and src in self.lost_peers:
                raise TransportError(
                    f"rank {self.rank}: peer {src} was lost ({self.lost_peers[src]}) while "
                    f"waiting for tag {tag} on channel {channel!r}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                who = "any peer" if src is None else f"peer {src}"
                raise TransportError(
                    f"rank {self.rank}: timed out after {timeout:.1f}s waiting for tag {tag} "
                    f"from {who} on channel {channel!r}"
                )
            version = self.progress(version, min(remaining, 0.1))

    def progress(self, seen_version: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for the mailbox to move past ``seen_version`` (an arrival,
        a send completion, an event) and return the new version. Transports that receive
        on the caller's thread override this to poll their sockets."""
        return self.mailbox.wait(seen_version, timeout)

    # -- pacing ----------------------------------------------------------------------------

    def pace_connection(self, peer: int, channel: str, rate_bps: float | None) -> bool:
        """Cap the rate at which this rank sends to ``peer`` on ``channel`` (bit/s of payload;
        None lifts the cap). The runtime calls it with each connection's fair share of the
        NIC (``runtime/fair_share.py``). Returns whether the transport can pace; the default
        cannot, and the call changes nothing."""
        return False

    # -- liveness --------------------------------------------------------------------------

    def on_peer_lost(self, callback: Callable[[int, str], None]) -> None:
        self._peer_lost_callbacks.append(callback)

    def _peer_lost(self, peer: int, reason: str) -> None:
        if peer in self.lost_peers or peer in self.departed_peers or self._closed:
            return
        self.lost_peers[peer] = reason
        log.error("rank %d: lost peer %d: %s", self.rank, peer, reason)
        for callback in self._peer_lost_callbacks:
            callback(peer, reason)
        self.mailbox.notify()

    # -- accounting ------------------------------------------------------------------------

    @property
    def gone_peers(self) -> frozenset[int]:
        """The peers nothing more will come from: lost (crashed) or departed (said goodbye)."""
        return frozenset(self.lost_peers) | frozenset(self.departed_peers)

    def is_gone(self, peer: int) -> bool:
        """Whether ``peer`` is in :attr:`gone_peers`, without building the set (per-message paths)."""
        return peer in self.lost_peers or peer in self.departed_peers

    def counters(self) -> dict[tuple[int, str], LinkCounters]:
        """Payload bytes and messages per (peer, channel), control traffic included."""
        with self._counter_lock:
            return {k: LinkCounters(**vars(v)) for k, v in self._counters.items()}

    def bytes_sent(self, channel: str | None = None) -> int:
        return sum(c.bytes_sent for (peer, ch), c in self.counters().items()
                   if ch != CONTROL_CHANNEL and (channel is None or ch == channel))

    def reset_counters(self) -> None:
        with self._counter_lock:
            self._counters.clear()

    # -- shutdown --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a thread of the owner may find it closed under it)."""
        return self._closed

    def close(self, farewell: bytes = b"") -> None:
        """Tell peers we leave on purpose (so they do not report us as lost), then stop.
        ``farewell`` rides the goodbye (the runtime says there which collectives it leaves
        unfinished: ``runtime/control.py``)."""
        if self._closed:
            return
        self.progress(self.mailbox.version, 0.0)  # take in goodbyes that already arrived
        for peer in range(self.world_size):
            # A peer that already left would never take the goodbye: sending it anyway
            # makes a lingering socket hold up shutdown.
            if peer != self.rank and peer not in self.lost_peers and peer not in self.departed_peers:
                try:
                    self._send(peer, GOODBYE_TAG, memoryview(farewell), CONTROL_CHANNEL, b"")
                except Exception:  # a dead peer cannot be told; closing must still succeed
                    pass
        self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        """Release sockets and threads; subclasses override."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GOODBYE_TAG = 0xFFFF_FFFF


# -- wire header shared by the byte-stream transports ----------------------------------------

_HEADER = struct.Struct("<4s16sIQH")  # magic, job token, source rank, tag, channel index
MAGIC = b"MLF1"


def encode_header(token: bytes, src: int, tag: int, channel_index: int) -> bytes:
    return _HEADER.pack(MAGIC, token, src, tag, channel_index)


def decode_header(frame: bytes | memoryview, token: bytes) -> tuple[int, int, int]:
    """(source rank, tag, channel index) — raises ``ValueError`` with the reason if the frame
    is not ours."""
    if len(frame) != _HEADER.size:
        raise ValueError(f"header of {len(frame)} bytes, expected {_HEADER.size}")
    magic, their_token, src, tag, channel_index = _HEADER.unpack(frame)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if their_token != token:
        raise ValueError("wrong job token")
    return src, tag, channel_index
