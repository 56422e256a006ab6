"""ZeroMQ TCP transport: one listening ROUTER socket per channel, one DEALER per (peer, channel).

A host with k NICs binds k addresses, one per channel, so that BCube traffic of level l
leaves through NIC l (set ``MLFABRIC_CHANNEL_ADDRS="0=10.0.0.2,1=10.1.0.2"`` or pass
``channel_addrs``). Addresses and a random job token are exchanged through the rendezvous
store. Large payloads go out as zero-copy frames whose completion is tracked. Receiving
happens in :meth:`ZmqTransport.progress`, on the thread that waits for messages (the
executor's progress thread), so an arriving chunk is reduced without a thread hand-off: it
polls the sockets, checks every message's job token (junk and foreign jobs are logged and
dropped) and watches connections so that a dead peer is reported within a second.

:meth:`ZmqTransport.pace_connection` caps a connection's rate in the kernel (Linux's
``SO_MAX_PACING_RATE``, which turns on TCP's own pacing): libzmq reports the descriptor of
each connection it makes (the monitor's ``EVENT_CONNECTED``), and the cap is set on it, and
again on every reconnection, after checking that the descriptor still leads to that peer.
A paced connection's send buffer shrinks to ~20 ms at its cap (:func:`paced_buffer_bytes`).

Exercise it with ``python -m pytest tests/local/test_socket_transports.py``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import threading
import time
from typing import Iterator, Mapping

try:
    import zmq
except ImportError as _missing:  # pyzmq is an optional extra: say which
    raise ImportError(
        "the zmq transport needs pyzmq, which mlfabric installs only with its 'zmq' extra: "
        "pip install 'mlfabric[zmq]' (or pip install pyzmq); or use the default transport, "
        "'tcp', which needs nothing more") from _missing

from mlfabric.errors import TransportError

from .base import (
    CONTROL_CHANNEL,
    TOKEN_BYTES,
    Message,
    SendHandle,
    Transport,
    decode_header,
    encode_header,
)
from .memory import keep_freed_memory
from .pacing import Pacer
from .sockets import (
    GOODBYE_GRACE_S,
    KERNEL_PACING,
    SOCKET_BUFFER_BYTES,
    channel_indices,
    check_endpoints,
    pacing_cap,
    pacing_cap_for,
    peer_address,
    priority_from_env,
    priority_tos,
    rendezvous,
    send_buffer,
    set_pacing,
)

log = logging.getLogger("mlfabric.transport.zmq")

# Below this size a copy costs less than tracking a zero-copy frame.
ZERO_COPY_MIN_BYTES = 64 * 1024

_DONE = SendHandle(done=True)

# What setting a cap on a descriptor libzmq has just closed or reused can raise.
_GONE_ERRNOS = (errno.EBADF, errno.ENOTSOCK, errno.ENOTCONN)


class ZmqTransport(Transport):
    """See the module docstring. Build it with :meth:`create` (rendezvous through a store)."""

    def __init__(self, rank: int, world_size: int, token: bytes, *,
                 channels: tuple[str, ...] = ("0",), bind_addrs: Mapping[str, str] | None = None,
                 pace_bps: Mapping[str, float] | None = None) -> None:
        super().__init__(rank, world_size, channels)
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"job token must be {TOKEN_BYTES} bytes")
        keep_freed_memory()  # libzmq's receive buffers: reuse them, do not fault in fresh pages
        #: The job's traffic priority (``MLFABRIC_PRIORITY``, MLNET §3) in every packet's IP TOS.
        self.priority = priority_from_env()
        self.token = token
        self._ctx = zmq.Context(io_threads=1)
        self._channel_index, self._index_channel = channel_indices(self.channels)
        self._send_lock = threading.Lock()
        self._routers: dict[str, zmq.Socket] = {}
        self._router_channel: dict[zmq.Socket, str] = {}
        self.endpoints: dict[str, str] = {}
        bind_addrs = dict(bind_addrs or {})
        # Control messages ride the first channel's sockets with their own channel index.
        for name in self.channels:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.RCVHWM, 0)
            router.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.TOS, priority_tos(self.priority))  # the job's priority, on its ACKs
            host = bind_addrs.get(name, "127.0.0.1")
            port = router.bind_to_random_port(f"tcp://{host}")
            self._routers[name] = router
            self._router_channel[router] = name
            self.endpoints[name] = f"tcp://{host}:{port}"
        self._dealers: dict[tuple[int, str], zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, tuple[str, int | None, str | None]] = {}
        # Pacing (pace_connection): per (peer, channel) the peer's address, the descriptor of
        # libzmq's connection to it once known, and the cap asked for (bytes/s; None: none).
        self._pacing_lock = threading.Lock()
        self._remote_addr: dict[tuple[int, str], tuple[str, int]] = {}
        self._connection_fd: dict[tuple[int, str], int] = {}
        self._pacing: dict[tuple[int, str], int | None] = {}
        self._disconnected_at: dict[int, float] = {}
        self._stop = threading.Event()
        # One thread at a time polls the sockets (zmq sockets are not thread-safe); others
        # wait on the mailbox. notify() interrupts the poll through this pipe.
        self._poll_lock = threading.Lock()
        self._poller: zmq.Poller | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.mailbox.on_notify = self._wake
        # Zero-copy sends complete when libzmq lets go of the buffer, which raises no event a
        # poller could see: this thread waits on the trackers (in send order) and wakes the
        # mailbox, so the progress thread never has to spin.
        self._tracked: queue.SimpleQueue = queue.SimpleQueue()
        self._tracker_thread = threading.Thread(target=self._complete_sends, daemon=True,
                                                name=f"mlfabric-zmq-sends-{rank}")
        self._tracker_thread.start()
        # User-space shaping (the emulator's fallback without root): see pacing.py.
        self._pacer = Pacer(pace_bps, name=f"mlfabric-pacer-{rank}") if pace_bps else None

    # -- setup -----------------------------------------------------------------------------

    @classmethod
    def create(cls, store, rank: int, world_size: int, *, channels: tuple[str, ...] = ("0",),
               bind_addrs: Mapping[str, str] | None = None, timeout: float = 60.0,
               pace_bps: Mapping[str, float] | None = None) -> "ZmqTransport":
        """Bind, publish our endpoints in ``store`` (a torch.distributed Store), learn
        everyone else's and connect to all peers."""
        return rendezvous(store, rank, world_size, lambda token: cls(
            rank, world_size, token, channels=channels, bind_addrs=bind_addrs, pace_bps=pace_bps))

    def connect(self, peers: Mapping[int, Mapping[str, str]]) -> None:
        for peer, endpoints in peers.items():
            check_endpoints(self.rank, peer, endpoints, self.channels)
            for name in self.channels:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.SNDHWM, 0)
                dealer.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
                dealer.setsockopt(zmq.LINGER, 2000)
                dealer.setsockopt(zmq.IMMEDIATE, 0)
                dealer.setsockopt(zmq.TOS, priority_tos(self.priority))  # the job's priority (MLNET §3)
                monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
                self._monitors[monitor] = ("dealer", peer, name)
                self._remote_addr[(peer, name)] = peer_address(endpoints[name])
                dealer.connect(endpoints[name])
                self._dealers[(peer, name)] = dealer
        for name, router in self._routers.items():
            monitor = router.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            self._monitors[monitor] = ("router", None, None)
        poller = zmq.Poller()
        for router in self._routers.values():
            poller.register(router, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._poller = poller

    # -- sending ---------------------------------------------------------------------------

    def _send(self, peer: int, tag: int, payload: memoryview, channel: str, meta: bytes) -> SendHandle:
        socket_channel = self.channels[0] if channel == CONTROL_CHANNEL else channel
        dealer = self._dealers.get((peer, socket_channel))
        if dealer is None:
            raise TransportError(f"rank {self.rank}: no connection to peer {peer} on channel {channel!r}")
        header = encode_header(self.token, self.rank, tag, self._channel_index[channel])
        if self._pacer is not None and self._pacer.clock.paced(channel):
            return self._send_paced(dealer, [header, meta, payload], channel)
        with self._send_lock:
            if payload.nbytes < ZERO_COPY_MIN_BYTES:
                dealer.send_multipart([header, meta, payload], copy=True)
                return _DONE
            tracker = dealer.send_multipart([header, meta, payload], copy=False, track=True)
        handle = SendHandle(done=False)
        self._tracked.put((tracker, handle))
        return handle

    def _send_paced(self, dealer: zmq.Socket, frames: list, channel: str) -> SendHandle:
        """Hand the message to the socket when the channel's virtual link is done with it."""
        handle = SendHandle(done=False)
        payload = frames[2]

        def send_now() -> None:
            if self._stop.is_set():
                return
            if payload.nbytes < ZERO_COPY_MIN_BYTES:
                with self._send_lock:
                    dealer.send_multipart(frames, copy=True)
                handle.set_done()
                self.mailbox.notify()
            else:
                with self._send_lock:
                    tracker = dealer.send_multipart(frames, copy=False, track=True)
                self._tracked.put((tracker, handle))

        self._pacer.submit(channel, payload.nbytes, send_now)
        return handle

    def _complete_sends(self) -> None:
        while True:
            item = self._tracked.get()
            if item is None:
                return
            tracker, handle = item
            while not tracker.done:
                try:
                    tracker.wait(timeout=0.5)
                except zmq.NotDone:
                    if self._stop.is_set():
                        return
            handle.set_done()
            self.mailbox.notify()

    # -- pacing ----------------------------------------------------------------------------

    def pace_connection(self, peer: int, channel: str, rate_bps: float | None) -> bool:
        if not KERNEL_PACING:
            return False
        connection = (peer, channel)
        if connection not in self._remote_addr:
            raise TransportError(f"rank {self.rank}: no connection to peer {peer} on channel {channel!r} to pace")
        cap = pacing_cap_for(rate_bps)
        with self._pacing_lock:
            self._pacing[connection] = cap
            fd = self._connection_fd.get(connection)
        # Not connected yet: _connected() applies the cap when libzmq reports the connection.
        return fd is None or self._set_pacing(connection, fd, cap)

    def _connected(self, peer: int, channel: str, fd: int) -> None:
        connection = (peer, channel)
        with self._pacing_lock:
            self._connection_fd[connection] = fd
            cap = self._pacing.get(connection)
        if cap is not None:
            self._set_pacing(connection, fd, cap)

    def _set_pacing(self, connection: tuple[int, str], fd: int, cap: int | None) -> bool:
        """Set the kernel's pacing cap of libzmq's socket ``fd`` (through a duplicate of the
        descriptor) if it still leads to ``connection``'s peer: libzmq may have closed it and
        the number may name another socket by now (then the next ``EVENT_CONNECTED`` applies
        the cap). False only when the kernel refuses the cap: pacing is unavailable."""
        try:
            with self._libzmq_socket(connection, fd) as sock:
                if sock is None:
                    return True  # a stale descriptor: the reconnection will be paced
                set_pacing(sock, cap)
            return True
        except OSError as exc:
            # A descriptor libzmq closed a moment ago (the peer left, a reconnection) is
            # expected; anything else means the kernel refused the cap.
            gone = exc.errno in _GONE_ERRNOS
            log.log(logging.DEBUG if gone else logging.WARNING,
                    "rank %d: could not pace the connection to peer %d on channel %r: %s",
                    self.rank, connection[0], connection[1], exc)
            return gone

    def pacing_of(self, peer: int, channel: str) -> int | None:
        """The kernel's pacing cap (bytes/s) of the connection to ``peer`` on ``channel``, read
        back from its socket; None when it is unknown (not connected) or uncapped."""
        return self._read_connection(peer, channel, pacing_cap)

    def send_buffer_of(self, peer: int, channel: str) -> int | None:
        """The kernel's send buffer (bytes, as the kernel reports it: twice what was set) of
        the connection to ``peer`` on ``channel``; None when it is unknown."""
        return self._read_connection(peer, channel, send_buffer)

    def _read_connection(self, peer: int, channel: str, read):
        with self._pacing_lock:
            fd = self._connection_fd.get((peer, channel))
        if fd is None:
            return None
        try:
            with self._libzmq_socket((peer, channel), fd) as sock:
                return None if sock is None else read(sock)
        except OSError:
            return None  # closed since libzmq reported it

    @contextlib.contextmanager
    def _libzmq_socket(self, connection: tuple[int, str], fd: int) -> Iterator[socket.socket | None]:
        """A duplicate of libzmq's descriptor ``fd`` for ``connection``, or None when the number
        no longer leads to that peer (libzmq closed it and the kernel gave it to another
        socket): the one place that decides which kernel socket pacing may touch. OSError
        from a closed descriptor propagates."""
        with socket.socket(fileno=os.dup(fd)) as sock:
            leads_there = (sock.type == socket.SOCK_STREAM
                           and sock.getpeername()[:2] == self._remote_addr[connection])
            yield sock if leads_there else None

    # -- receiving -------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def progress(self, seen_version: int, timeout: float) -> int:
        if self._poller is None or self._stop.is_set() or not self._poll_lock.acquire(blocking=False):
            return self.mailbox.wait(seen_version, timeout)
        try:
            wait_ms = 0 if self.mailbox.version != seen_version else int(timeout * 1000)
            try:
                events = self._poller.poll(wait_ms)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return self.mailbox.version
                raise
            for sock, _ in events:
                if sock == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                elif sock in self._router_channel:
                    self._drain_router(sock, self._router_channel[sock])
                else:
                    self._handle_monitor(sock)
            self._expire_disconnects()
        finally:
            self._poll_lock.release()
        return self.mailbox.version

    def _drain_router(self, router: zmq.Socket, channel: str) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 4:
                self._reject(f"{len(frames) - 1} frames on channel {channel!r}, expected 3")
                continue
            _, header, meta, payload = frames
            try:
                src, tag, channel_index = decode_header(header.bytes, self.token)
            except ValueError as exc:
                self._reject(f"{exc} on channel {channel!r}")
                continue
            name = self._index_channel.get(channel_index)
            if not 0 <= src < self.world_size or src == self.rank or name is None:
                self._reject(f"bad source {src} or channel index {channel_index}")
                continue
            self._deliver(Message(src, tag, name, meta.bytes, payload.buffer))

    def _handle_monitor(self, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        kind, peer, channel = self._monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            code = event["event"]
            if kind == "router" and code in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._reject(f"connection failed the protocol handshake ({event['endpoint']!r})")
            elif kind == "dealer" and peer is not None and channel is not None:
                if code == zmq.EVENT_CONNECTED:
                    self._connected(peer, channel, int(event["value"]))
                elif code == zmq.EVENT_DISCONNECTED:
                    with self._pacing_lock:
                        self._connection_fd.pop((peer, channel), None)
                    self._disconnected_at.setdefault(peer, time.monotonic())

    def _expire_disconnects(self) -> None:
        now = time.monotonic()
        for peer, since in list(self._disconnected_at.items()):
            if peer in self.departed_peers:
                del self._disconnected_at[peer]
            elif now - since >= GOODBYE_GRACE_S:
                del self._disconnected_at[peer]
                self._peer_lost(peer, "its connection closed without a goodbye (process died?)")

    # -- shutdown --------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stop.set()
        if self._pacer is not None:
            self._pacer.close()
        self._tracked.put(None)
        with self._poll_lock:  # wait for a poll in progress to return
            self._poller = None
        self.mailbox.on_notify = None  # the pipe's descriptors may be reused once closed
        os.close(self._wake_r)
        os.close(self._wake_w)
        # Close the watched sockets first and the monitor sockets last, and never call
        # disable_monitor(): with its reader already closed it can block forever (seen in
        # about 1 of 15 shutdowns; regression test in tests/local/test_socket_transports.py).
        for (peer, _), dealer in self._dealers.items():
            # Linger only towards peers still there, so a goodbye or abort notice is
            # delivered; messages to a departed peer would only hold up context.term().
            gone = peer in self.departed_peers or peer in self.lost_peers
            dealer.close(linger=0 if gone else 1000)
        for router in self._routers.values():
            router.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._ctx.term()
