"""Framing and ordered links: what the tcp transport's socket connections and its
shared-memory links (``shm.py``) have in common.

A *frame* is one message on a byte stream: a header (:data:`FRAME`: magic, tag, meta
length, payload length, channel index), the meta bytes, then the payload. Both link kinds
write frames; they differ only in where a large payload travels (in the stream, or through a
shared-memory ring announced piece by piece).

* :class:`FrameReader` reads one connection's frames with read-ahead, and lands a payload in
  the destination the runtime offered for it;
* :class:`OrderedLink` is one outgoing connection whose messages leave in the order they were
  sent: the calling thread hands the kernel what fits without blocking, a sender thread
  finishes the rest. The shared-memory link subclasses it;
* :class:`LinkOwner` is what a link needs from the transport that owns it (deliver a payload,
  reject a stranger, report a connection's end). ``TcpTransport`` is the one implementation;
  the links never reach into its private state.

This module imports neither link kind: ``tcp.py`` imports it and ``shm.py``, and ``shm.py``
imports only it.

Exercise it with ``python -m pytest tests/local/test_tcp.py tests/local/test_shm.py``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from typing import Protocol

from .base import Mailbox, SendHandle

# Every message: magic, tag, meta length, payload length, channel index.
FRAME = struct.Struct("<4sQIQH")
FRAME_MAGIC = b"MLFm"
# A connection must present its handshake within this time or it is dropped.
HANDSHAKE_TIMEOUT_S = 5.0
# Meta is a short description of the collective; anything longer is not ours.
MAX_META_BYTES = 1 << 16
# How much a reader takes from the kernel at once, beyond the frame it needs (FrameReader):
# enough for a burst of small messages, small enough that a large payload is mostly received
# in place.
READ_AHEAD_BYTES = 64 * 1024

#: The handle of a send the kernel took whole at once (shared: it never changes).
DONE = SendHandle(done=True)


class LinkOwner(Protocol):
    """What a link (a socket connection or a shared-memory link) needs from its transport."""

    rank: int
    world_size: int
    token: bytes
    mailbox: Mailbox
    departed_peers: set[int]
    lost_peers: dict[int, str]

    def channel_at(self, index: int) -> str | None:
        """The channel with wire index ``index``; None for an index that is not ours."""

    def reject_link(self, reason: str) -> None:
        """Log and count a connection or frame that is not the job's (it is then closed)."""

    def payload_destination(self, channel: str, tag: int, src: int, meta: bytes,
                            nbytes: int) -> tuple[memoryview, bool]:
        """Where an arriving payload goes: the offered destination (True) or a fresh buffer."""

    def payload_received(self, src: int, tag: int, channel: str, meta: bytes, payload: memoryview,
                         in_place: bool) -> None:
        """A payload has fully arrived: deliver it."""

    def link_ended(self, peer: int, reason: str) -> None:
        """A connection with ``peer`` ended: it left (goodbye seen) or it is reported lost."""


def add_frame(parts: list[memoryview], tag: int, meta: bytes, payload: memoryview, channel_index: int) -> int:
    """Append one message's parts (frame header, meta if any, payload) to ``parts``; returns
    its bytes on the wire."""
    parts.append(memoryview(FRAME.pack(FRAME_MAGIC, tag, len(meta), payload.nbytes, channel_index)))
    if meta:
        parts.append(memoryview(meta))
    parts.append(payload)
    return FRAME.size + len(meta) + payload.nbytes


def without_sent(parts: list[memoryview], sent: int) -> list[memoryview]:
    """``parts`` minus their first ``sent`` bytes."""
    rest = []
    for part in parts:
        if sent >= part.nbytes:
            sent -= part.nbytes
            continue
        rest.append(part[sent:] if sent else part)
        sent = 0
    return rest


def shut(sock: socket.socket) -> None:
    """Shut both directions (unblocking a thread in recv/send); it may be closed already."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def shut_and_join(sockets: list[socket.socket], threads: list[threading.Thread | None]) -> None:
    """Shut ``sockets`` (their readers return) and wait a moment for ``threads`` (not the
    calling one: a reader thread may be the one closing the transport)."""
    for sock in sockets:
        shut(sock)
    current = threading.current_thread()
    for thread in threads:
        if thread is not None and thread is not current:
            thread.join(timeout=1.0)


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the connection ended first (at a message
    boundary or not: the caller treats both as the end)."""
    filled, size = 0, view.nbytes
    while filled < size:
        n = sock.recv_into(view[filled:], size - filled)
        if n == 0:
            return False
        filled += n
    return True


class FrameReader:
    """Buffered reading of one connection's frames.

    Small messages arrive in bursts (a collective's step sends several to the same peer), and
    each ``recv`` costs a system call and a round trip through the GIL: one read here takes
    every frame the kernel holds, up to :data:`READ_AHEAD_BYTES`. A large payload still lands
    in its destination straight from the kernel: only what was read ahead is copied.
    """

    __slots__ = ("sock", "buffer", "view", "start", "end")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray(max(READ_AHEAD_BYTES, FRAME.size + MAX_META_BYTES))
        self.view = memoryview(self.buffer)
        self.start = self.end = 0  # the unread bytes are buffer[start:end]

    def take(self, size: int) -> memoryview | None:
        """The next ``size`` bytes (a view valid until the next call); None if the connection
        ended first. ``size`` must fit the buffer."""
        while self.end - self.start < size:
            if self.start:  # make room at the back: move the unread bytes to the front
                unread = self.end - self.start
                self.view[:unread] = self.view[self.start:self.end]
                self.start, self.end = 0, unread
            received = self.sock.recv_into(self.view[self.end:])
            if received == 0:
                return None
            self.end += received
        chunk = self.view[self.start:self.start + size]
        self.start += size
        return chunk

    def frame(self, owner: LinkOwner, src: int,
              magics: tuple[bytes, ...] = (FRAME_MAGIC,)) -> tuple[bytes, int, str, bytes, int] | None:
        """The next frame from ``src``: (magic, tag, channel, meta, payload length), its payload
        still to read. None when the stream ended, or is out of step (a magic not in
        ``magics``, an unknown channel, oversized meta: rejected, and nothing after it can be
        trusted)."""
        header = self.take(FRAME.size)
        if header is None:
            return None
        magic, tag, meta_len, nbytes, channel_index = FRAME.unpack(header)
        channel = owner.channel_at(channel_index)
        if magic not in magics or channel is None or meta_len > MAX_META_BYTES:
            owner.reject_link(f"corrupt frame from peer {src} (magic {magic!r}, channel index "
                              f"{channel_index}); closing its connection")
            return None
        meta = self.take(meta_len) if meta_len else b""
        if meta is None:
            return None
        return magic, tag, channel, bytes(meta), nbytes

    def read_into(self, destination: memoryview) -> bool:
        """Fill ``destination``: what was read ahead first, the rest straight from the
        socket. False if the connection ended first."""
        ahead = min(self.end - self.start, destination.nbytes)
        destination[:ahead] = self.view[self.start:self.start + ahead]
        self.start += ahead
        if self.start == self.end:
            self.start = self.end = 0
        return recv_exactly(self.sock, destination[ahead:]) if ahead < destination.nbytes else True


class Offer:
    """A destination the runtime offers for one expected message (see ``take_or_offer``)."""

    __slots__ = ("destination", "meta")

    def __init__(self, destination: memoryview, meta: bytes) -> None:
        self.destination = destination
        self.meta = meta


class OrderedLink:
    """One outgoing connection: messages leave in the order they were sent. The shared-memory
    link (``shm.py``) is one too, with its own first attempt (``send``) and way of writing a
    queued message (``_write``)."""

    def __init__(self, transport: LinkOwner, peer: int, channel: str, sock: socket.socket) -> None:
        self.transport = transport
        self.peer = peer
        self.channel = channel
        self.sock = sock
        # send() takes the plain lock (a C call); the sender thread waits on the condition.
        self.mutex = threading.Lock()
        self.lock = threading.Condition(self.mutex)
        # Messages the sender thread still has to write; the head one is being written.
        self.queue: deque[tuple[object, SendHandle]] = deque()
        self.error: str | None = None
        self.closing = False
        self.thread: threading.Thread | None = None

    def send(self, parts: list[memoryview], handle: SendHandle | None = None, nbytes: int = -1, *,
             inline: bool = True) -> SendHandle:
        """Queue ``parts`` (``nbytes`` in all, if the caller knows) behind what is already
        queued; the returned handle (``handle`` when given: it is completed, and the mailbox
        woken, once the kernel holds every byte) says when the payload may be reused. With
        ``inline`` and nothing queued, the caller hands the kernel what fits at once; without,
        the sender thread does (the caller is not held by the copy of a large batch)."""
        with self.mutex:
            if self.error is not None:
                # The peer is gone (it is being reported lost, or it left): the message
                # cannot be delivered and its send never completes.
                return handle or SendHandle(done=False)
            if inline and not self.queue:
                # Nothing ahead of it: hand the kernel what fits without blocking.
                try:
                    sent = self.sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    # The peer's end is gone: it is reported lost, and the runtime fails what
                    # waits on it with that reason (this send never completes).
                    self._broken(exc)
                    return handle or SendHandle(done=False)
                if sent == nbytes and handle is None:  # the common case: the kernel took it all
                    return DONE
                parts = without_sent(parts, sent)
                if not parts:
                    if handle is None:
                        return DONE
                    handle.set_done()
                    self.transport.mailbox.notify()
                    return handle
            return self._enqueue(parts, handle or SendHandle(done=False))

    def _enqueue(self, message: object, handle: SendHandle) -> SendHandle:
        """Queue ``message`` for the sender thread (started on first need); holds ``mutex``."""
        self.queue.append((message, handle))
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._drain, daemon=True,
                name=f"mlfabric-tcp-send-{self.transport.rank}-{self.peer}-{self.channel}")
            self.thread.start()
        self.lock.notify()
        return handle

    def _write(self, parts: list[memoryview]) -> None:
        """Write one queued message (blocking: releases the GIL while the kernel takes it)."""
        while parts:
            parts = without_sent(parts, self.sock.sendmsg(parts))

    def _lost_reason(self, exc: OSError) -> str:
        return f"sending to it on channel {self.channel!r} failed ({exc}); process died?"

    def _drain(self) -> None:
        mailbox = self.transport.mailbox
        while True:
            with self.lock:
                while not self.queue and not self.closing:
                    self.lock.wait()
                if not self.queue:
                    return
                message, handle = self.queue[0]
            try:
                self._write(message)
            except OSError as exc:
                with self.lock:
                    self._broken(exc)
                    self.queue.clear()
                mailbox.notify()
                return
            with self.lock:
                self.queue.popleft()
                self.lock.notify_all()
            handle.set_done()
            mailbox.notify()

    def _broken(self, exc: OSError) -> None:
        if self.error is None:
            self.error = str(exc)
            if not self.closing:
                # A peer that closed on purpose resets the connection too; its goodbye, on
                # another connection, may still be on the way.
                threading.Thread(target=self.transport.link_ended, daemon=True,
                                 args=(self.peer, self._lost_reason(exc)),
                                 name=f"mlfabric-tcp-lost-{self.transport.rank}-{self.peer}").start()

    def flush(self, deadline: float) -> None:
        """Wait (until ``deadline``) for queued messages to reach the kernel."""
        with self.lock:
            while self.queue and self.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.lock.wait(remaining)

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        shut(self.sock)
        self.sock.close()
