"""Plain TCP transport: one kernel socket per (peer, channel) each way, payloads received
straight into the tensor that waits for them.

Why a second TCP transport beside ``zmq.py``: ZeroMQ receives every message into a buffer of
its own (so a received slice is copied once more into the tensor) and moves every message
through its I/O thread (two more thread wake-ups per message). Here the kernel copies a
payload directly into its destination: the runtime offers the destination of a receive it is
waiting for (:meth:`TcpTransport.take_or_offer`), and the connection's reader thread, having
read the message's header, receives the payload into that memory. A small message is written
to the socket by the sending thread itself, without a hand-off.

Layout. Each channel has a listening socket (``channel_addrs`` / ``MLFABRIC_CHANNEL_ADDRS``,
so that a host with k NICs binds k addresses). Every rank connects to every peer on every
channel; a connection carries one direction only. It opens with a handshake (magic, job
token, source rank, the source process's incarnation in the tag field, channel index:
:func:`mlfabric.transport.base.encode_header`); anything else, or a wrong token, is logged,
counted and closed before a byte can reach a tensor. A rank's restarted process
(:meth:`TcpTransport.rejoin`, incarnation k >= 1) replaces the old one at every peer it
connects to: the old process's connections and shared-memory link deliver nothing from then
on, an older incarnation's handshake is refused, and the peer sends to the new process once
it is told its endpoints (:meth:`TcpTransport.readmit`; the parameter server's rejoin:
``tests/unit/test_ps_rejoin.py``). Then
each message is a frame (``framing.py``: a header with tag, meta length, payload length and
channel index, the meta bytes and the payload). Control messages ride the first channel.

Threads: per listening socket one acceptor; per incoming connection one reader (blocking
``recv_into``, which releases the GIL, so reading overlaps the progress thread's
reductions); per outgoing connection a sender, started on its first large message, that
finishes what the calling thread could not hand to the kernel without blocking. A connection
that ends without the peer's goodbye reports the peer lost (within :data:`GOODBYE_GRACE_S`).

Peers on the same host (same boot and network namespace) get a shared-memory link instead
of TCP connections when the transport is built by :meth:`TcpTransport.create`
(``transport/shm.py``; ``MLFABRIC_SHM=0`` keeps them on TCP); received payloads land in
offered destinations there too.

Pacing: :meth:`TcpTransport.pace_connection` sets Linux's ``SO_MAX_PACING_RATE`` on the
outgoing socket (the runtime's fair shares, ``runtime/fair_share.py``); ``pace_bps`` paces
channels in user space like the zmq transport (``transport/pacing.py``).

Priority (MLNET §3): every connection of a job carries the job's priority
(``MLFABRIC_PRIORITY``, 0-7) in its packets' IP precedence bits
(:func:`mlfabric.transport.sockets.set_priority`), which the emulator's NICs and switches
serve in strict priority order (``mlfabric.emu.cluster``).

Exercise it with ``python -m pytest tests/local/test_socket_transports.py tests/local/test_tcp.py``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Mapping, Sequence

import numpy as np

from mlfabric.errors import TransportError

from .base import (CONTROL_CHANNEL, TOKEN_BYTES, Message, SendHandle, Transport, byte_view, decode_header,
                   encode_header)
from .framing import (DONE, HANDSHAKE_TIMEOUT_S, FrameReader, Offer, OrderedLink, add_frame, recv_exactly, shut,
                      shut_and_join)
from .memory import keep_freed_memory
from .pacing import Pacer
from .shm import ENDPOINT_KEY, SharedMemoryLinks, host_layout, shm_enabled
from .sockets import (
    GOODBYE_GRACE_S,
    KERNEL_PACING,
    SOCKET_BUFFER_BYTES,
    channel_indices,
    check_endpoints,
    pacing_cap,
    pacing_cap_for,
    parse_priority,
    peer_address,
    priority_from_env,
    rendezvous,
    send_buffer,
    set_pacing,
    set_priority,
)

log = logging.getLogger("mlfabric.transport.tcp")

HANDSHAKE_BYTES = len(encode_header(bytes(TOKEN_BYTES), 0, 0, 0))
CONNECT_RETRY_S = 0.05
#: How long a rejoining process tries a peer that may have died (TcpTransport.rejoin's
#: ``reach``): a dead process's listener refuses at once, a live one answers in milliseconds.
REACH_TIMEOUT_S = 1.0

#: Frames per ``sendmsg`` in :meth:`TcpTransport.send_many`: up to three parts each, under
#: Linux's 1024 iovecs per call.
MESSAGES_PER_CALL = 300


class TcpTransport(Transport):
    """See the module docstring. Build it with :meth:`create` (rendezvous through a store)."""

    # The reader threads run the executor's pass after each delivery (set_inline_progress).
    inline_progress = True

    def __init__(self, rank: int, world_size: int, token: bytes, *,
                 channels: tuple[str, ...] = ("0",), bind_addrs: Mapping[str, str] | None = None,
                 pace_bps: Mapping[str, float] | None = None, connect_timeout: float = 60.0,
                 shared_memory: bool = False, priority: int | None = None, incarnation: int = 0) -> None:
        super().__init__(rank, world_size, channels)
        #: Which start of this rank's process this is: 0 at the job's start, k for its k-th
        #: restart (:meth:`rejoin`). Every connection's handshake carries it; a peer holds each
        #: rank's newest and refuses older ones (see :meth:`_admit`).
        if incarnation < 0:
            raise ValueError(f"rank {rank}: incarnation must be >= 0, got {incarnation}")
        self.incarnation = incarnation
        #: The newest incarnation seen per peer (absent: 0), and per peer how often it was
        #: readmitted (a loss reported for an older incarnation is then ignored).
        self.incarnations: dict[int, int] = {}
        self.readmissions: dict[int, int] = {}
        self._incarnation_lock = threading.Lock()
        # Peers that had a shared-memory link before a new incarnation of them connected:
        # whatever that link still delivers is the old process's.
        self._stale_shm: set[int] = set()
        #: The job's traffic priority (MLNET §3), marked on every connection: ``priority``, or
        #: ``MLFABRIC_PRIORITY`` (0, unmarked, when neither is given).
        self.priority = priority_from_env() if priority is None else parse_priority(priority)
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"job token must be {TOKEN_BYTES} bytes")
        # Payloads that cannot land in place get a fresh buffer each: reuse freed ones
        # instead of faulting in new pages (see memory.py).
        keep_freed_memory()
        self.token = token
        self.connect_timeout = connect_timeout
        self._channel_index, self._index_channel = channel_indices(self.channels)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._incoming: set[socket.socket] = set()
        self._incoming_lock = threading.Lock()
        self._outgoing: dict[tuple[int, str], OrderedLink] = {}
        # Destinations offered for expected messages, by (channel, tag, source).
        self._offers: dict[tuple[str, int, int], Offer] = {}
        self._offer_lock = threading.Lock()
        # Payload bytes received straight into an offered destination (the rest were copied).
        self.bytes_in_place = 0
        self._listeners: dict[str, socket.socket] = {}
        self.endpoints: dict[str, str] = {}
        bind_addrs = dict(bind_addrs or {})
        try:
            for name in self.channels:
                host = bind_addrs.get(name, "127.0.0.1")
                listener = socket.create_server((host, 0), backlog=max(128, 4 * world_size))
                self._listeners[name] = listener
                self.endpoints[name] = f"tcp://{host}:{listener.getsockname()[1]}"
        except OSError:
            for listener in self._listeners.values():
                listener.close()
            raise
        for name, listener in self._listeners.items():
            self._start(self._accept, listener, name=f"mlfabric-tcp-accept-{rank}-{name}")
        self._pacer = Pacer(pace_bps, name=f"mlfabric-pacer-{rank}") if pace_bps else None
        # Ranks paced in user space stand for hosts of their own (the emulator's fallback
        # without root): they keep to their paced TCP connections.
        self._shm = SharedMemoryLinks(self) if shared_memory and shm_enabled() and not pace_bps else None
        if self._shm is not None:
            self.endpoints[ENDPOINT_KEY] = self._shm.endpoint
        self._shm_peers: frozenset[int] = frozenset()

    def _start(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads.append(thread)
        thread.start()

    # -- setup -----------------------------------------------------------------------------

    @classmethod
    def create(cls, store, rank: int, world_size: int, *, channels: tuple[str, ...] = ("0",),
               bind_addrs: Mapping[str, str] | None = None, timeout: float = 60.0,
               pace_bps: Mapping[str, float] | None = None, shared_memory: bool = True,
               priority: int | None = None) -> "TcpTransport":
        """Bind, publish our endpoints in ``store`` (a torch.distributed Store), learn
        everyone else's and connect to all peers; peers on this host through shared memory
        unless ``shared_memory`` is False or ``MLFABRIC_SHM=0``."""
        return rendezvous(store, rank, world_size, lambda token: cls(
            rank, world_size, token, channels=channels, bind_addrs=bind_addrs,
            pace_bps=pace_bps, connect_timeout=timeout, shared_memory=shared_memory, priority=priority))

    def connect(self, peers: Mapping[int, Mapping[str, str]]) -> None:
        """Open a connection to every peer on every channel (their listeners are up: the
        endpoints were published after binding)."""
        self.hosts = host_layout({self.rank: self.endpoints.get(ENDPOINT_KEY),
                                  **{peer: endpoints.get(ENDPOINT_KEY) for peer, endpoints in peers.items()}},
                                 self.world_size)
        for peer, endpoints in peers.items():
            check_endpoints(self.rank, peer, endpoints, self.channels)
            if self._shm is not None and self._shm.reaches(endpoints):
                self._shm.connect(peer, self.connect_timeout)
                self._shm_peers = self._shm_peers | {peer}
                continue
            for name, link in self._open_links(peer, endpoints).items():
                self._outgoing[(peer, name)] = link

    @classmethod
    def rejoin(cls, store, rank: int, world_size: int, incarnation: int, peers: Sequence[int], *,
               channels: tuple[str, ...] = ("0",), bind_addrs: Mapping[str, str] | None = None,
               timeout: float = 60.0, priority: int | None = None, reach: Sequence[int] = (),
               reach_timeout: float = REACH_TIMEOUT_S) -> "TcpTransport":
        """A restarted process of ``rank`` (its ``incarnation``-th start, >= 1) back in the
        running job: the job's token and ``peers``' endpoints from ``store`` (published at the
        job's rendezvous; the store must outlive the rank's first process), a connection to
        each of them, and this process's own endpoints republished. TCP only: a restarted
        process gets no shared-memory link (its peers' shared-memory state is the old
        process's). A peer accepts the connections as a new incarnation of ``rank`` and stops
        taking anything the old one sent; it sends back once it is asked to
        (:meth:`readmit` with :attr:`endpoints`, e.g. by the parameter server's rejoin request).
        ``reach``: peers that may have died meanwhile (other workers): each is dialed for at
        most ``reach_timeout`` s, and one that does not answer counts as lost (its process is
        gone: its listeners refuse at once) instead of failing the rejoin."""
        if incarnation < 1:
            raise ValueError(f"rank {rank}: a rejoining process needs an incarnation >= 1 (got {incarnation})")
        token = bytes.fromhex(store.get("token").decode())
        transport = cls(rank, world_size, token, channels=channels, bind_addrs=bind_addrs, connect_timeout=timeout,
                        shared_memory=False, priority=priority, incarnation=incarnation)
        try:
            store.set(f"endpoints/{rank}", json.dumps(transport.endpoints))
            transport.connect({peer: json.loads(store.get(f"endpoints/{peer}").decode()) for peer in peers})
            for peer in reach:
                transport._reach(peer, json.loads(store.get(f"endpoints/{peer}").decode()), reach_timeout)
        except BaseException:
            transport._shutdown()
            raise
        return transport

    def _reach(self, peer: int, endpoints: Mapping[str, str], timeout: float) -> None:
        """Dial ``peer`` on every channel within ``timeout`` s, or record it lost (why)."""
        check_endpoints(self.rank, peer, endpoints, self.channels)
        try:
            links = self._open_links(peer, endpoints, timeout)
        except (TransportError, OSError) as exc:
            self._peer_lost(peer, f"not reachable when this process rejoined ({exc})")
            return
        for name, link in links.items():
            self._outgoing[(peer, name)] = link

    def readmit(self, peer: int, endpoints: Mapping[str, str]) -> None:
        """Send to a new incarnation of ``peer`` (whose connections here were accepted as such)
        at ``endpoints``: dial it on every channel, replacing the old process's connections,
        and take it off the lost and departed peers. Raises TransportError naming the peer if
        it cannot be reached within ``connect_timeout``."""
        if not self.incarnations.get(peer):
            raise TransportError(f"rank {self.rank}: readmit(peer {peer}) but no restarted incarnation of it has "
                                 "connected here (it must connect first: TcpTransport.rejoin)")
        check_endpoints(self.rank, peer, endpoints, self.channels)
        links = self._open_links(peer, endpoints)
        with self._incarnation_lock:
            self.readmissions[peer] = self.readmissions.get(peer, 0) + 1
            self._shm_peers = self._shm_peers - {peer}
            old = [self._outgoing.get((peer, name)) for name in self.channels]
            for name, link in links.items():
                self._outgoing[(peer, name)] = link
            self.lost_peers.pop(peer, None)
            self.departed_peers.discard(peer)
            self.farewells.pop(peer, None)
        for link in old:
            if link is not None:
                link.close()
        log.info("rank %d: readmitted peer %d (incarnation %d)", self.rank, peer, self.incarnations[peer])
        self.mailbox.notify()

    def _open_links(self, peer: int, endpoints: Mapping[str, str],
                    timeout: float | None = None) -> dict[str, OrderedLink]:
        """One connection to ``peer`` per channel, each announcing this process (token, rank,
        incarnation, channel); the ones opened are closed again if another fails."""
        links: dict[str, OrderedLink] = {}
        try:
            for name in self.channels:
                sock = self._dial(peer, endpoints[name], timeout)
                sock.sendall(encode_header(self.token, self.rank, self.incarnation, self._channel_index[name]))
                links[name] = OrderedLink(self, peer, name, sock)
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def _dial(self, peer: int, endpoint: str, timeout: float | None = None) -> socket.socket:
        address = peer_address(endpoint)
        deadline = time.monotonic() + (self.connect_timeout if timeout is None else timeout)
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TransportError(f"rank {self.rank}: cannot connect to peer {peer} at "
                                         f"{endpoint}: {exc}") from exc
                time.sleep(CONNECT_RETRY_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        set_priority(sock, self.priority)
        return sock

    # -- sending ---------------------------------------------------------------------------

    def _send(self, peer: int, tag: int, payload: memoryview, channel: str, meta: bytes) -> SendHandle:
        if peer in self._shm_peers:  # no NIC on the way: nothing to pace either
            return self._shm.send(peer, tag, self._channel_index[channel], meta, payload)  # type: ignore[union-attr]
        socket_channel = self.channels[0] if channel == CONTROL_CHANNEL else channel
        connection = self._outgoing.get((peer, socket_channel))
        if connection is None:
            raise TransportError(f"rank {self.rank}: no connection to peer {peer} on channel {channel!r}")
        parts: list[memoryview] = []
        nbytes = add_frame(parts, tag, meta, payload, self._channel_index[channel])
        if self._pacer is not None and self._pacer.clock.paced(channel):
            return self._send_paced(connection, parts, channel, payload.nbytes)
        return connection.send(parts, None, nbytes)

    def send_many(self, peer: int, messages: Sequence[tuple[int, memoryview | bytes, bytes]], *,
                  channel: str = "0") -> SendHandle:
        """One ``sendmsg`` for many frames (the base class says why); on a shared-memory link,
        a paced channel or the control channel, one send each."""
        if (peer in self._shm_peers or channel == CONTROL_CHANNEL
                or (self._pacer is not None and self._pacer.clock.paced(channel))):
            return super().send_many(peer, messages, channel=channel)
        self._check_send(peer, channel)
        connection = self._outgoing.get((peer, channel))
        if connection is None:
            raise TransportError(f"rank {self.rank}: no connection to peer {peer} on channel {channel!r}")
        index = self._channel_index[channel]
        handle: SendHandle = DONE
        payload_bytes = 0
        for first in range(0, len(messages), MESSAGES_PER_CALL):
            parts: list[memoryview] = []
            nbytes = 0
            for tag, payload, meta in messages[first:first + MESSAGES_PER_CALL]:
                view = byte_view(payload)
                nbytes += add_frame(parts, tag, meta, view, index)
                payload_bytes += view.nbytes
            # One connection: the last completes last. The sender thread copies the batch into
            # the kernel (the copy releases the GIL), so the caller goes on at once: a server
            # answering several workers does not hold the later ones' first bytes behind it.
            handle = connection.send(parts, None, nbytes, inline=False)
        self._count_sent(peer, channel, payload_bytes, len(messages))
        return handle

    def _send_paced(self, connection: OrderedLink, parts: list[memoryview], channel: str,
                    nbytes: int) -> SendHandle:
        """Hand the message to the connection when the channel's virtual link is done with it."""
        handle = SendHandle(done=False)

        def send_now() -> None:
            if not self._stop.is_set():
                connection.send(parts, handle)  # completes the handle once the kernel holds it

        self._pacer.submit(channel, nbytes, send_now)
        return handle

    # -- receiving -------------------------------------------------------------------------

    def take_or_offer(self, channel: str, tag: int, src: int, destination: memoryview,
                      meta: bytes) -> Message | None:
        """The message if it is here; otherwise leave ``destination`` for its payload, which
        the reader then receives in place (if its size and meta match; the message is then
        delivered with ``in_place`` set). Call :meth:`withdraw_offer` if the message is no
        longer wanted."""
        key = (channel, tag, src)
        with self._offer_lock:
            msg = self.mailbox.take(channel, tag, src)
            if msg is None:
                self._offers[key] = Offer(destination, meta)
            else:
                # Its header may have been read before the offer was made: drop the offer.
                self._offers.pop(key, None)
            return msg

    def withdraw_offer(self, channel: str, tag: int, src: int) -> None:
        with self._offer_lock:
            self._offers.pop((channel, tag, src), None)

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                sock, address = listener.accept()
            except OSError:
                return  # the listener was closed: shutting down
            with self._incoming_lock:
                if self._stop.is_set():
                    sock.close()
                    return
                self._incoming.add(sock)
            self._start(self._read, sock, address, name=f"mlfabric-tcp-recv-{self.rank}")

    def _read(self, sock: socket.socket, address: tuple) -> None:
        src = None
        incarnation = 0
        try:
            admitted = self._handshake(sock, address)
            if admitted is not None:
                src, incarnation = admitted
                self._read_messages(sock, src, incarnation)
        except OSError as exc:
            if not self._stop.is_set() and src is not None:
                log.debug("rank %d: connection from peer %d failed: %s", self.rank, src, exc)
        finally:
            with self._incoming_lock:
                self._incoming.discard(sock)
            sock.close()
        if src is not None and not self._stop.is_set() and self.incarnations.get(src, 0) == incarnation:
            self.link_ended(src, "its connection closed without a goodbye (process died?)")

    def _handshake(self, sock: socket.socket, address: tuple) -> tuple[int, int] | None:
        """The source rank and incarnation of a connection that proves it belongs to the job;
        None (after logging the rejection) for anything else."""
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        raw = bytearray(HANDSHAKE_BYTES)
        try:
            complete = recv_exactly(sock, memoryview(raw))
        except OSError as exc:
            complete = False
            reason = f"no handshake ({exc})"
        else:
            reason = "connection closed during the handshake"
        if not complete:
            if not self._stop.is_set():
                self._reject(f"{reason} from {address}")
            return None
        try:
            src, incarnation, channel_index = decode_header(raw, self.token)
        except ValueError as exc:
            self._reject(f"{exc} from {address}")
            return None
        if not 0 <= src < self.world_size or src == self.rank or channel_index not in self._index_channel:
            self._reject(f"bad source {src} or channel index {channel_index} from {address}")
            return None
        if not self._admit(src, incarnation, address):
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        set_priority(sock, self.priority)  # its ACKs
        return src, incarnation

    def _admit(self, src: int, incarnation: int, address: tuple) -> bool:
        """Whether a connection of ``src``'s ``incarnation`` is taken. An older incarnation
        than the newest seen is refused (a message of a process that was replaced is never
        delivered); a newer one replaces the old process: the old one is reported lost now if
        it was not yet (a restarted rank proves its old process gone), and from here on the
        old process's connections deliver nothing."""
        with self._incarnation_lock:
            known = self.incarnations.get(src, 0)
            if incarnation < known:
                stale = True
            else:
                stale = False
                if incarnation > known:
                    self.incarnations[src] = incarnation
                    if src in self._shm_peers:
                        self._stale_shm.add(src)
        if stale:
            self._reject(f"a connection of peer {src}'s incarnation {incarnation} from {address}, but its "
                         f"incarnation {known} has replaced it (a message of the old process)")
            return False
        if incarnation > known:
            log.warning("rank %d: peer %d connected as incarnation %d (was %d): its old process is gone",
                        self.rank, src, incarnation, known)
            self._peer_lost(src, f"replaced by its incarnation {incarnation} (restarted)")
        return True

    def _read_messages(self, sock: socket.socket, src: int, incarnation: int = 0) -> None:
        stream = FrameReader(sock)
        while True:
            frame = stream.frame(self, src)
            if frame is None:
                return
            _, tag, channel, meta, nbytes = frame
            if self.incarnations.get(src, 0) != incarnation:
                # The process that sent it was replaced by a restarted one while its bytes
                # were on the way: drop it, and everything after it on this connection
                # (before its payload could land in a destination offered to the new one).
                self._reject(f"a message of peer {src}'s replaced incarnation {incarnation} (tag {tag})")
                return
            payload, in_place = self.payload_destination(channel, tag, src, meta, nbytes)
            if nbytes and not stream.read_into(payload):
                return
            if self.incarnations.get(src, 0) != incarnation:  # replaced while its payload arrived
                self._reject(f"a message of peer {src}'s replaced incarnation {incarnation} (tag {tag})")
                return
            self._arrived(src, tag, channel, meta, payload, in_place)

    # -- what the links call (framing.LinkOwner) ---------------------------------------------

    def channel_at(self, index: int) -> str | None:
        return self._index_channel.get(index)

    def reject_link(self, reason: str) -> None:
        self._reject(reason)

    def payload_destination(self, channel: str, tag: int, src: int, meta: bytes, nbytes: int) -> tuple[memoryview, bool]:
        """Where an arriving payload goes (its header was just read): the destination
        offered for it if size and meta match (True: in place), else a fresh buffer."""
        offer = None
        if self._offers:  # lock-free look first: offers are rare (receives of >= 64 KiB)
            with self._offer_lock:
                offer = self._offers.pop((channel, tag, src), None)
        if offer is not None and offer.destination.nbytes == nbytes and offer.meta == meta:
            return offer.destination, True
        if nbytes:
            # np.empty: no zero-filling of memory that is about to be overwritten.
            return memoryview(np.empty(nbytes, dtype=np.uint8)), False
        return memoryview(b""), False

    def payload_received(self, src: int, tag: int, channel: str, meta: bytes, payload: memoryview, in_place: bool) -> None:
        """A payload has fully arrived (over TCP or shared memory): count and deliver it."""
        if self._stale_shm and src in self._stale_shm:
            # Only a replaced process ever had a shared-memory link with a restarted rank.
            self._reject(f"a message of peer {src}'s replaced process on its old shared-memory link (tag {tag})")
            return
        self._arrived(src, tag, channel, meta, payload, in_place)

    def _arrived(self, src: int, tag: int, channel: str, meta: bytes, payload: memoryview, in_place: bool) -> None:
        """A payload has fully arrived from a live incarnation: count and deliver it."""
        if in_place:
            with self._offer_lock:  # readers of several connections count here
                self.bytes_in_place += payload.nbytes
        self._deliver(Message(src, tag, channel, meta, payload, in_place=in_place))

    def link_ended(self, peer: int, reason: str) -> None:
        """A connection with ``peer`` ended: a peer that said goodbye left; one that did not
        died. The goodbye rides the first channel and may still be in flight on it. A link of
        a process that a restarted one replaced meanwhile says nothing about the new one."""
        admissions = (self.incarnations.get(peer, 0), self.readmissions.get(peer, 0))
        deadline = time.monotonic() + GOODBYE_GRACE_S
        while time.monotonic() < deadline and peer not in self.departed_peers and not self._stop.is_set():
            time.sleep(0.01)
        if admissions != (self.incarnations.get(peer, 0), self.readmissions.get(peer, 0)):
            return
        if peer not in self.departed_peers and not self._stop.is_set():
            self._peer_lost(peer, reason)

    # -- pacing ----------------------------------------------------------------------------

    def pace_connection(self, peer: int, channel: str, rate_bps: float | None) -> bool:
        if peer in self._shm_peers:
            return True  # memory, not a NIC: there is no share to keep to
        if not KERNEL_PACING:
            return False
        connection = self._outgoing.get((peer, channel))
        if connection is None:
            raise TransportError(f"rank {self.rank}: no connection to peer {peer} on channel {channel!r} to pace")
        cap = pacing_cap_for(rate_bps)
        try:
            set_pacing(connection.sock, cap)
        except OSError as exc:
            log.warning("rank %d: could not pace the connection to peer %d on channel %r: %s",
                        self.rank, peer, channel, exc)
            return False
        return True

    def pacing_of(self, peer: int, channel: str) -> int | None:
        """The kernel's pacing cap (bytes/s) of the connection to ``peer`` on ``channel``;
        None when uncapped or not connected."""
        connection = self._outgoing.get((peer, channel))
        return None if connection is None else pacing_cap(connection.sock)

    def send_buffer_of(self, peer: int, channel: str) -> int | None:
        """The kernel's send buffer of the connection to ``peer`` on ``channel`` (as the
        kernel reports it: twice what was set); None when not connected."""
        connection = self._outgoing.get((peer, channel))
        return None if connection is None else send_buffer(connection.sock)

    # -- shutdown --------------------------------------------------------------------------

    def _shutdown(self) -> None:
        # Let queued messages (the goodbye, an abort notice) reach the kernel first; the
        # kernel still delivers what it holds after close.
        deadline = time.monotonic() + 2.0
        for (peer, _), connection in self._outgoing.items():
            if peer not in self.departed_peers and peer not in self.lost_peers:
                connection.flush(deadline)
        if self._shm is not None:
            self._shm.flush(deadline)
        self._stop.set()
        if self._shm is not None:
            self._shm.close()
        if self._pacer is not None:
            self._pacer.close()
        for listener in self._listeners.values():
            shut(listener)
            listener.close()
        for connection in self._outgoing.values():
            connection.close()
        with self._incoming_lock:
            incoming = list(self._incoming)
        shut_and_join(incoming, self._threads)
