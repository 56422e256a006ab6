"""Shared-memory links between ranks of one host, used by the tcp transport per peer.

Ranks on the same host (same boot **and** same network namespace: emulated hosts live in
namespaces of their own and must keep using their shaped NICs) exchange messages through
memory instead of the kernel's TCP stack. :class:`SharedMemoryLinks` is the tcp transport's
partner for those peers: :meth:`TcpTransport.create <mlfabric.transport.tcp.TcpTransport.create>`
publishes this rank's host identity beside its TCP endpoints, and peers with the same
identity get a shared-memory link instead of TCP connections; a job that mixes local and
remote peers uses both. ``MLFABRIC_SHM=0`` turns the path off.

**One link per ordered pair** (writer -> reader), like one TCP connection:

* a *ring* of :data:`RING_BYTES` in a ``memfd`` segment, created by the writer and handed to
  the reader over the link's socket (``SCM_RIGHTS``). The segment has no name: it is never
  in ``/dev/shm``, and the kernel frees it when the last process holding it exits, SIGKILL
  included, so nothing of a job can be left behind;
* a *socket* (``AF_UNIX`` in the abstract namespace, which is per network namespace) that
  carries the handshake (job token, source rank), frame headers, small payloads inline
  (up to :data:`INLINE_MAX_BYTES`), "piece written" records from writer to reader and
  "piece consumed" credits back. It is also the liveness signal: a peer that dies closes it
  at once, and the reader reports the peer lost exactly as the tcp transport does when a
  connection ends without a goodbye.

A large payload moves through the ring in pieces of up to :data:`PIECE_BYTES`: the writer
copies a piece in (when the ring has room) and announces it; the reader copies it out
**straight into the destination** the runtime offered for the message
(``Transport.take_or_offer``; otherwise into a fresh buffer) and returns a credit. So a
payload is copied twice, writer and reader working on different pieces at once, and never
crosses the kernel. Both copies are ``ctypes.memmove`` calls, which release the GIL. Piece
and credit records go through the socket, whose system calls order the ring's memory between
the two processes on every architecture (no lock-free atomics in Python).

Why not zero copies: the sender's tensor is the application's memory, which another process
cannot see without ptrace rights (``process_vm_readv``, refused in many containers).

Exercise it with ``python -m pytest tests/local/test_shm.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from mlfabric.errors import TransportError

from .base import TOKEN_BYTES, SendHandle, decode_header, encode_header
from .framing import (DONE, FRAME, FRAME_MAGIC, HANDSHAKE_TIMEOUT_S, FrameReader, LinkOwner, OrderedLink, shut,
                      shut_and_join)

log = logging.getLogger("mlfabric.transport.shm")

#: ``MLFABRIC_SHM=0`` keeps every peer on TCP.
SHM_ENV = "MLFABRIC_SHM"
#: The key under which a rank publishes its shared-memory endpoint beside its TCP endpoints.
ENDPOINT_KEY = "@shm"
#: Ring size of one link. 4 MiB holds 4 pieces: the writer fills one while the reader
#: empties another (16 links on a 4-rank host are 64 MiB of memory, touched as used).
RING_BYTES = 4 << 20
#: Largest piece announced at once: the granularity at which writer and reader overlap.
PIECE_BYTES = 1 << 20
#: Payloads up to this size travel inside the socket stream: one system call each way, as
#: over TCP, and no credit round trip.
INLINE_MAX_BYTES = 64 << 10
#: A writer waits for this much room (or the rest of the payload, if less) rather than
#: announce slivers.
MIN_PIECE_BYTES = 64 << 10
#: Every blocking call wakes at least this often to notice a shutdown.
POLL_S = 0.5

# Writer -> reader records: a frame (framing.FRAME with one of these magics), then for a ring
# payload one PIECE record per piece; reader -> writer: one CREDIT record per piece consumed.
INLINE_MAGIC = FRAME_MAGIC  # the payload follows in the socket stream, as over TCP
RING_MAGIC = b"MLFr"    # the payload follows in the ring, announced piece by piece
PIECE = struct.Struct("<Q")
CREDIT = struct.Struct("<Q")
_HANDSHAKE = struct.Struct("<Q")  # after base.encode_header: the ring's size


def shm_enabled() -> bool:
    """Whether this process may use shared-memory links (Linux with ``memfd_create``, and
    ``MLFABRIC_SHM`` not ``0``)."""
    if os.environ.get(SHM_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def host_identity() -> str:
    """What two ranks must share to use shared memory: the machine's boot and the network
    namespace (device and inode of ``/proc/self/ns/net``)."""
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    ns = os.stat("/proc/self/ns/net")
    return f"{boot}/{ns.st_dev}:{ns.st_ino}"


def host_layout(identities: Mapping[int, str | None], world_size: int) -> tuple[int, ...]:
    """The host index of every rank (hosts numbered in order of their lowest rank) from the
    identities the ranks published; a rank without one (shared memory off there) is a host
    of its own."""
    hosts: dict[str, int] = {}
    layout = []
    for rank in range(world_size):
        identity = identities.get(rank)
        key = identity if identity is not None else f"rank {rank}"
        layout.append(hosts.setdefault(key, len(hosts)))
    return tuple(layout)


def _address(token: bytes, rank: int) -> str:
    """The abstract socket name of ``rank``'s listener: derived from the token by a hash, so
    that the name (visible in /proc/net/unix) does not give the token away."""
    digest = hashlib.sha256(b"mlfabric-shm" + token).hexdigest()[:24]
    return f"\0mlfabric-{digest}-{rank}"


def _address_of(view: np.ndarray | memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@dataclass
class _Ring:
    """The mapped ring of one link; ``base`` is its address in this process."""

    memory: mmap.mmap
    size: int

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.memory, dtype=np.uint8)
        self.base = self.array.ctypes.data


def _new_ring(name: str, size: int) -> tuple[int, _Ring]:
    """A fresh memfd of ``size`` bytes and its mapping; the caller closes the fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return fd, _Ring(mmap.mmap(fd, size), size)
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class _RingMessage:
    """A queued message whose payload goes through the ring."""

    header: list[memoryview]
    payload: memoryview


class _Link(OrderedLink):
    """The writer's side of one link: an ordered link (``framing.OrderedLink``: messages leave in
    the order they were sent, a sender thread finishes what the calling thread could not),
    writing small messages to the socket and large payloads through the ring."""

    def __init__(self, links: "SharedMemoryLinks", peer: int, sock: socket.socket, ring: _Ring) -> None:
        super().__init__(links.transport, peer, "shared memory", sock)
        self.ring = ring
        self.written = 0   # bytes ever announced in the ring
        self.credited = 0  # bytes the reader has given back
        self._credit_bytes = bytearray()  # a credit record split across reads

    # -- credits -----------------------------------------------------------------------------

    def _take_credits(self, wait_s: float | None) -> None:
        """Read credits the reader sent: without waiting (``wait_s=None``) or up to ``wait_s``."""
        buffer = bytearray(4096)
        try:
            if wait_s is None:
                received = self.sock.recv_into(buffer, len(buffer), socket.MSG_DONTWAIT)
            else:
                self.sock.settimeout(wait_s)
                try:
                    received = self.sock.recv_into(buffer)
                finally:
                    self.sock.settimeout(None)
        except (BlockingIOError, socket.timeout):
            return
        if received == 0:
            raise ConnectionResetError("the reader closed the link")
        self._credit_bytes += buffer[:received]
        whole = len(self._credit_bytes) - len(self._credit_bytes) % CREDIT.size
        for (amount,) in CREDIT.iter_unpack(bytes(self._credit_bytes[:whole])):
            self.credited += amount
        del self._credit_bytes[:whole]

    def _free(self) -> int:
        return self.ring.size - (self.written - self.credited)

    # -- sending -----------------------------------------------------------------------------

    def send_message(self, header: list[memoryview], payload: memoryview, inline: bool) -> SendHandle:
        """Queue one message; the calling thread writes it itself when nothing is queued and
        it fits (the socket's buffer, or the ring's free room before its end)."""
        if inline:
            parts = [*header, payload] if payload.nbytes else header
            return self.send(parts, None, sum(p.nbytes for p in parts))
        with self.mutex:
            if self.error is not None:
                return SendHandle(done=False)  # the peer is being reported lost
            if not self.queue:
                try:
                    self._take_credits(None)
                    if self._free() >= payload.nbytes and self._fits_contiguously(payload.nbytes):
                        self._copy_in(payload, 0, payload.nbytes)
                        # Only the announcement's tail can be left, and it is ours to keep.
                        rest = self._announce([*header, memoryview(PIECE.pack(payload.nbytes))])
                        if rest:
                            self._enqueue(rest, DONE)
                        return DONE
                except OSError as exc:
                    self._broken(exc)
                    return SendHandle(done=False)
            return self._enqueue(_RingMessage(header, payload), SendHandle(done=False))

    def _announce(self, records: list[memoryview]) -> list[memoryview]:
        """Hand ``records`` to the socket without blocking; what it did not take, copied."""
        try:
            sent = self.sock.sendmsg(records, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        rest = _bytes_after(records, sent)
        return [memoryview(rest)] if rest else []

    def _fits_contiguously(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit before the ring's end (one piece, no wrap)."""
        return self.written % self.ring.size + nbytes <= self.ring.size and nbytes <= PIECE_BYTES

    def _copy_in(self, payload: memoryview, offset: int, length: int) -> None:
        position = self.written % self.ring.size
        ctypes.memmove(self.ring.base + position, _address_of(payload[offset:offset + length]), length)
        self.written += length

    def _write(self, message: object) -> None:
        if not isinstance(message, _RingMessage):
            super()._write(message)  # type: ignore[arg-type]
            return
        # Announce the frame, then move the payload through the ring piece by piece.
        self.sock.sendall(b"".join(message.header))
        payload = message.payload
        offset, total = 0, payload.nbytes
        while offset < total:
            want = min(total - offset, PIECE_BYTES, self.ring.size - self.written % self.ring.size)
            self._take_credits(None)
            while self._free() < min(want, MIN_PIECE_BYTES):
                if self.closing:
                    raise ConnectionAbortedError("transport closed")
                self._take_credits(POLL_S)
            length = min(want, self._free())
            self._copy_in(payload, offset, length)
            self.sock.sendall(PIECE.pack(length))
            offset += length

    def _lost_reason(self, exc: OSError) -> str:
        return f"writing to it through shared memory failed ({exc}); process died?"

    def close(self, deadline: float | None = None) -> None:
        """End the link gracefully: the reader sees the end after everything we sent."""
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        # Take in what the reader still sends back (credits) until it closes its end: a Unix
        # socket closed with unread bytes resets the link, and the reader would then lose the
        # goodbye queued before the end and report us lost.
        deadline = time.monotonic() + 1.0 if deadline is None else deadline
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.sock.settimeout(remaining)
                if not self.sock.recv(1 << 16):
                    break
            except OSError:  # timed out, or the peer is gone
                break
        self.sock.close()



def _bytes_after(parts: list[memoryview], sent: int) -> bytes:
    """The bytes of ``parts`` after the first ``sent`` (copied: the caller may reuse them)."""
    out = bytearray()
    for part in parts:
        if sent >= part.nbytes:
            sent -= part.nbytes
            continue
        out += part[sent:]
        sent = 0
    return bytes(out)


class SharedMemoryLinks:
    """The shared-memory links of one rank's tcp transport (see the module docstring)."""

    def __init__(self, transport: LinkOwner) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.identity = host_identity()
        self.address = _address(transport.token, transport.rank)
        self.stopped = False
        self._outgoing: dict[int, _Link] = {}
        self._incoming: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(self.address)
            self.listener.listen(max(128, 4 * transport.world_size))
        except OSError:
            self.listener.close()
            raise
        self._start(self._accept, name=f"mlfabric-shm-accept-{self.rank}")

    @property
    def endpoint(self) -> str:
        """What a peer needs to decide on and open a link to us (published by the rendezvous)."""
        return self.identity

    def reaches(self, endpoints: Mapping[str, str]) -> bool:
        """Whether the peer that published ``endpoints`` shares our host (boot and netns)."""
        return endpoints.get(ENDPOINT_KEY) == self.identity

    def _start(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads.append(thread)
        thread.start()

    # -- writer side ---------------------------------------------------------------------------

    def connect(self, peer: int, timeout: float) -> None:
        """Open the link to ``peer`` (its listener is up: endpoints are published after it)."""
        transport = self.transport
        deadline = time.monotonic() + timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        while True:
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.connect(_address(transport.token, peer))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    sock.close()
                    raise TransportError(f"rank {self.rank}: cannot open the shared-memory link to peer {peer} "
                                         f"on this host: {exc}; set {SHM_ENV}=0 to use TCP") from exc
                time.sleep(0.05)
        try:
            fd, ring = _new_ring(f"mlfabric-{self.rank}-to-{peer}", RING_BYTES)
            try:
                hello = encode_header(transport.token, self.rank, 0, 0) + _HANDSHAKE.pack(RING_BYTES)
                socket.send_fds(sock, [hello], [fd])
            finally:
                os.close(fd)  # our mapping and the peer's keep the memory
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self._outgoing[peer] = _Link(self, peer, sock, ring)

    def send(self, peer: int, tag: int, channel_index: int, meta: bytes, payload: memoryview) -> SendHandle:
        """Queue one message to ``peer`` (a peer of :meth:`peers`); as ``Transport.send``."""
        inline = payload.nbytes <= INLINE_MAX_BYTES
        frame = FRAME.pack(INLINE_MAGIC if inline else RING_MAGIC, tag, len(meta), payload.nbytes, channel_index)
        header = [memoryview(frame), memoryview(meta)] if meta else [memoryview(frame)]
        return self._outgoing[peer].send_message(header, payload, inline)

    def peers(self) -> set[int]:
        return set(self._outgoing)

    # -- reader side ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.stopped:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed: shutting down
            self._start(self._read, sock, name=f"mlfabric-shm-recv-{self.rank}")

    def _handshake(self, sock: socket.socket) -> tuple[int, _Ring] | None:
        transport = self.transport
        size = len(encode_header(bytes(TOKEN_BYTES), 0, 0, 0)) + _HANDSHAKE.size
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            data, fds, _, _ = socket.recv_fds(sock, size, 1)
        except OSError as exc:
            if not self.stopped:
                transport.reject_link(f"no shared-memory handshake ({exc})")
            return None
        try:
            if len(data) != size or len(fds) != 1:
                transport.reject_link(f"malformed shared-memory handshake ({len(data)} bytes, {len(fds)} fds)")
                return None
            try:
                src, _, _ = decode_header(data[:-_HANDSHAKE.size], transport.token)
            except ValueError as exc:
                transport.reject_link(f"{exc} on a shared-memory link")
                return None
            (ring_size,) = _HANDSHAKE.unpack(data[-_HANDSHAKE.size:])
            if not 0 <= src < transport.world_size or src == self.rank or ring_size < MIN_PIECE_BYTES:
                transport.reject_link(f"bad source {src} or ring size {ring_size} on a shared-memory link")
                return None
            ring = _Ring(mmap.mmap(fds[0], ring_size), ring_size)
        finally:
            for fd in fds:
                os.close(fd)
        sock.settimeout(None)
        return src, ring

    def _read(self, sock: socket.socket) -> None:
        src = None
        try:
            accepted = self._handshake(sock)
            if accepted is not None:
                src, ring = accepted
                with self._lock:
                    self._incoming[src] = sock
                self._read_messages(sock, src, ring)
        except OSError as exc:
            if not self.stopped and src is not None:
                log.debug("rank %d: shared-memory link from peer %d failed: %s", self.rank, src, exc)
        finally:
            sock.close()
        if src is not None and not self.stopped:
            self.transport.link_ended(src, "its shared-memory link closed without a goodbye (process died?)")

    def _read_messages(self, sock: socket.socket, src: int, ring: _Ring) -> None:
        transport = self.transport
        stream = FrameReader(sock)
        consumed = 0  # bytes ever taken out of the ring
        while True:
            frame = stream.frame(transport, src, (INLINE_MAGIC, RING_MAGIC))
            if frame is None:
                return
            magic, tag, channel, meta, nbytes = frame
            payload, in_place = transport.payload_destination(channel, tag, src, meta, nbytes)
            if magic == INLINE_MAGIC:
                if nbytes and not stream.read_into(payload):
                    return
            else:
                filled = 0
                while filled < nbytes:
                    record = stream.take(PIECE.size)
                    if record is None:
                        return
                    (length,) = PIECE.unpack(record)
                    position = consumed % ring.size
                    if length > nbytes - filled or position + length > ring.size:
                        transport.reject_link(f"shared-memory piece of {length} bytes from peer {src} does not fit; "
                                          "closing the link")
                        return
                    ctypes.memmove(_address_of(payload[filled:filled + length]), ring.base + position, length)
                    consumed += length
                    filled += length
                    sock.sendall(CREDIT.pack(length))
            transport.payload_received(src, tag, channel, meta, payload, in_place)

    # -- shutdown ------------------------------------------------------------------------------

    def flush(self, deadline: float) -> None:
        for peer, link in self._outgoing.items():
            if peer not in self.transport.departed_peers and peer not in self.transport.lost_peers:
                link.flush(deadline)

    def close(self) -> None:
        """Stop every thread; the rings are unmapped when the last reference goes (a thread
        still copying keeps its ring alive)."""
        self.stopped = True
        shut(self.listener)
        self.listener.close()
        deadline = time.monotonic() + 1.0
        for link in self._outgoing.values():
            link.close(deadline)
        with self._lock:
            incoming = list(self._incoming.values())
        shut_and_join(incoming, [*self._threads, *(link.thread for link in self._outgoing.values())])
