"""Point-to-point sends and receives between two ranks, with torch.distributed's matching rules.

    p2p = PointToPoint(comm.transport, timeout=60)
    p2p.send_async(tensor, peer=1, tag=7).wait()          # rank 0
    source = p2p.recv_async(out, peer=0, tag=7).wait()    # rank 1 (peer=None: from anyone)

Unlike collectives, sends and receives are not called by every rank in one order, so they
cannot borrow a collective's sequence number. Matching follows MPI's and torch's rules
instead: the k-th send from A to B with tag t meets the k-th receive posted on B for (A, t)
(or for any source with tag t), receives complete in the order they were posted, and a
message that arrives before its receive waits in the transport's mailbox. The transports
deliver each connection's messages in order, so the mailbox's oldest message from A with tag
t is always the next one. On the wire a message's tag is the user's tag with bit
:data:`P2P_TAG_BIT` set, above every collective's tag (sequence number << 24), and its meta
names the dtype, so a receive of the wrong size or dtype fails naming the peer.

One thread per instance (started on first use) completes receives as their messages arrive,
sends as the transport releases their buffers, and fails what passes its deadline or waits
on a peer that was lost or left, so futures complete while the caller computes.

Exercise it with ``python -m pytest tests/unit/test_p2p.py``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from mlfabric.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from mlfabric.schedule import DEFAULT_CHANNEL
from mlfabric.transport.base import Message, SendHandle, Transport

from .communicator import _dtype_name
from .executor import tensor_bytes

#: Set in the wire tag of every point-to-point message; collectives' tags stay below it.
P2P_TAG_BIT = 1 << 62
#: User tags are unsigned 32-bit, as gloo's.
MAX_TAG = (1 << 32) - 1
# How long the thread sleeps at most between looks at deadlines and lost peers.
_POLL_S = 0.1


@dataclass(eq=False)
class _Pending:
    """A posted receive (``handle`` None) or a send whose buffer the transport still reads."""

    future: torch.futures.Future
    peer: int | None
    tag: int
    deadline: float
    tensor: torch.Tensor  # receive: where the payload goes; send: the payload's owner
    handle: SendHandle | None = None

    def describe(self, rank: int) -> str:
        what = "send to" if self.handle is not None else "receive from"
        who = "any peer" if self.peer is None else f"peer {self.peer}"
        return (f"rank {rank}: {what} {who} (tag {self.tag}, {self.tensor.numel()} x "
                f"{_dtype_name(self.tensor)})")


class PointToPoint:
    """Tagged sends and receives of tensors over ``transport`` (see the module docstring).
    ``timeout`` (seconds) bounds every operation unless a call gives its own."""

    def __init__(self, transport: Transport, *, timeout: float, channel: str = DEFAULT_CHANNEL) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if channel not in transport.channels:
            raise ValueError(f"unknown channel {channel!r}; this transport has {transport.channels}")
        self.transport = transport
        self.timeout = float(timeout)
        self.channel = channel
        self._lock = threading.Lock()
        self._receives: deque[_Pending] = deque()  # in posting order: that is the matching order
        self._sends: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self.transport.rank

    def send_async(self, tensor: torch.Tensor, peer: int, tag: int = 0, *,
                   timeout: float | None = None) -> torch.futures.Future:
        """Send ``tensor`` to ``peer``; the future resolves to ``peer`` once ``tensor`` may be
        modified again (do not change it before)."""
        self._check(peer, tag, "send to")
        staged = tensor.detach()
        if not (staged.is_cpu and staged.is_contiguous()):
            staged = staged.to("cpu").contiguous()  # a private copy: the caller's tensor is free
        payload = tensor_bytes(staged.reshape(-1)) if staged.numel() else memoryview(b"")
        handle = self.transport.send(peer, P2P_TAG_BIT | tag, payload, channel=self.channel,
                                     meta=_dtype_name(staged).encode())
        future: torch.futures.Future = torch.futures.Future()
        if handle.done():
            future.set_result(peer)
            return future
        self._post(_Pending(future, peer, tag, self._deadline(timeout), staged, handle))
        return future

    def recv_async(self, tensor: torch.Tensor, peer: int | None = None, tag: int = 0, *,
                   timeout: float | None = None) -> torch.futures.Future:
        """Receive into ``tensor`` from ``peer`` (None: the first sender with this tag); the
        future resolves to the source rank once ``tensor`` holds the message."""
        if peer is not None:
            self._check(peer, tag, "receive from")
        else:
            self._check_tag(tag)
        future: torch.futures.Future = torch.futures.Future()
        self._post(_Pending(future, peer, tag, self._deadline(timeout), tensor))
        return future

    def close(self, reason: str = "the process group was shut down") -> None:
        """Fail whatever is still pending (saying ``reason``) and stop the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [*self._receives, *self._sends]
            self._receives.clear()
            self._sends.clear()
        self.transport.mailbox.notify()
        for item in pending:
            _fail(item.future, CollectiveError(f"{item.describe(self.rank)} did not complete: {reason}",
                                               rank=self.rank, peer=item.peer))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- internals ---------------------------------------------------------------------------

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"rank {self.rank}: tag {tag} is outside 0..{MAX_TAG}")

    def _check(self, peer: int, tag: int, what: str) -> None:
        self._check_tag(tag)
        if not 0 <= peer < self.transport.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: cannot {what} peer {peer} (world size "
                             f"{self.transport.world_size}, and a rank does not message itself)")

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _post(self, item: _Pending) -> None:
        with self._lock:
            if self._closed:
                raise CollectiveError(f"{item.describe(self.rank)}: the process group was shut down",
                                      rank=self.rank, peer=item.peer)
            (self._sends if item.handle is not None else self._receives).append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"mlfabric-p2p-{self.rank}")
                self._thread.start()
        self.transport.mailbox.notify()

    def _loop(self) -> None:
        transport = self.transport
        while not self._closed:
            version = transport.mailbox.version
            finished, failed = self._match(time.monotonic())
            # Futures complete outside the lock: their callbacks may post more work.
            for item, source in finished:
                item.future.set_result(source)
            for item, error in failed:
                _fail(item.future, error)
            with self._lock:
                deadlines = [item.deadline for item in (*self._receives, *self._sends)]
            wait = min([_POLL_S, *(d - time.monotonic() for d in deadlines)])
            transport.progress(version, max(0.0, wait))

    def _match(self, now: float) -> tuple[list[tuple[_Pending, int | None]], list[tuple[_Pending, Exception]]]:
        """Complete what can complete; fail what cannot any more. Receives are matched in
        posting order, each with the oldest message for it."""
        finished: list[tuple[_Pending, int | None]] = []
        failed: list[tuple[_Pending, Exception]] = []
        mailbox = self.transport.mailbox
        with self._lock:
            still: deque[_Pending] = deque()
            for item in self._receives:
                msg = mailbox.take(self.channel, P2P_TAG_BIT | item.tag, item.peer)
                if msg is not None:
                    try:
                        _land(msg, item.tensor, self.rank, item.tag)
                        finished.append((item, msg.src))
                    except CollectiveError as exc:
                        failed.append((item, exc))
                    continue
                error = self._why_never(item, now)
                if error is not None:
                    failed.append((item, error))
                else:
                    still.append(item)
            self._receives = still
            sends = []
            for item in self._sends:
                if item.handle is not None and item.handle.done():
                    finished.append((item, item.peer))
                elif (error := self._why_never(item, now)) is not None:
                    failed.append((item, error))
                else:
                    sends.append(item)
            self._sends = sends
        return finished, failed

    def _why_never(self, item: _Pending, now: float) -> CollectiveError | None:
        """The error for an operation that can no longer complete (None: it still can)."""
        transport = self.transport
        peers = ([item.peer] if item.peer is not None
                 else [p for p in range(transport.world_size) if p != self.rank])
        gone = {p: transport.lost_peers.get(p, "it left the job") for p in peers
                if p in transport.lost_peers or p in transport.departed_peers}
        if gone and len(gone) == len(peers):
            peer, reason = next(iter(gone.items()))
            return PeerLostError(f"{item.describe(self.rank)} cannot complete: peer {peer} is gone "
                                 f"({reason})", rank=self.rank, peer=peer)
        if now > item.deadline:
            return CollectiveTimeoutError(
                f"{item.describe(self.rank)} timed out: the peer never sent a matching message (check "
                "that both sides use the same peer and tag) or is slow; raise the timeout with "
                "init_process_group(timeout=...)", rank=self.rank, peer=item.peer)
        return None


def _land(msg: Message, tensor: torch.Tensor, rank: int, tag: int) -> None:
    """Copy ``msg``'s payload into ``tensor``, after checking its dtype and size."""
    expected = tensor.numel() * tensor.element_size()
    dtype = msg.meta.decode(errors="replace")
    if dtype != _dtype_name(tensor) or msg.nbytes != expected:
        raise CollectiveMismatchError(
            f"rank {rank}: receive from peer {msg.src} (tag {tag}) expected {tensor.numel()} x "
            f"{_dtype_name(tensor)} ({expected} bytes) but the peer sent {msg.nbytes} bytes of "
            f"{dtype}: sender and receiver must use tensors of one size and dtype",
            rank=rank, peer=msg.src)
    if not expected:
        return
    if tensor.is_cpu and tensor.is_contiguous():
        target = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        np.copyto(target, np.frombuffer(msg.payload, dtype=np.uint8))
    else:
        staged = torch.from_numpy(np.frombuffer(msg.payload, dtype=np.uint8).copy())
        tensor.detach().copy_(staged.view(tensor.dtype).view(tensor.shape))


def _fail(future: torch.futures.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
