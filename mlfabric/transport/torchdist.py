"""torch.distributed transport: messages as isend/irecv on process groups (gloo or NCCL).

Each channel (and the control channel) gets its own process group, so traffic of different
channels never queues behind each other. A message is three point-to-point transfers on
the channel's group: a fixed-size header (job token, source, tag, sizes), the collective
description, and the payload.

Receiving: on gloo one thread per channel blocks in an any-source receive of the next
header, then pulls the body from that source; NCCL has no any-source receive, so there it
is one thread per (channel, peer), with staging tensors on ``cuda:LOCAL_RANK``.
Sending: the payload is staged into a fresh tensor so the caller's buffer is free at once
(gloo only reports a send complete from ``wait()``), and a reaper thread waits on the
sends in order, so a failed send is logged rather than lost. Closing waits (at most
:data:`CLOSE_LINGER_S`) for the sends still in flight -- the goodbyes and abort notices --
to complete: a process that exits right after ``close()`` would otherwise tear its
connections down under them, and a peer that never heard of the abort waited for its
collective's timeout.

Exercise it with ``python -m pytest tests/local/test_torchdist.py``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import COMPLETED, CONTROL_CHANNEL, TOKEN_BYTES, Message, SendHandle, Transport

log = logging.getLogger("mlfabric.transport.torchdist")

_HEADER_LEN = 6  # token, src, tag, channel index, meta bytes, payload bytes
#: How long closing waits for its sends in flight to complete (as the zmq transport's linger
#: towards peers still there): long enough for a goodbye on a live connection, short enough
#: that a dead peer's send does not hold the close up.
CLOSE_LINGER_S = 1.0


class TorchDistTransport(Transport):
    def __init__(self, rank: int, world_size: int, token: bytes, groups: dict[str, object],
                 device: torch.device, channels: tuple[str, ...]) -> None:
        super().__init__(rank, world_size, channels)
        self._token = int.from_bytes(token[:8], "little", signed=True)
        self._groups = groups
        self._device = device
        self._channel_index = {name: i for i, name in enumerate([*self.channels, CONTROL_CHANNEL])}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._sent: queue.Queue = queue.Queue()
        threading.Thread(target=self._reap_sends, name=f"mlfabric-torchdist-reaper-{rank}",
                         daemon=True).start()
        any_source = device.type == "cpu"  # gloo; NCCL cannot receive from any source
        for name in (*self.channels, CONTROL_CHANNEL):
            sources = [None] if any_source else [p for p in range(world_size) if p != rank]
            for src in sources:
                threading.Thread(target=self._recv_loop, args=(name, src), daemon=True,
                                 name=f"mlfabric-torchdist-recv-{rank}-{name}-{src}").start()

    @classmethod
    def create(cls, store, rank: int, world_size: int, *, backend: str = "gloo",
               channels: tuple[str, ...] = ("0",), timeout: float = 60.0) -> "TorchDistTransport":
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"torch transport backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA, which this machine does not have; use 'gloo'")
        if rank == 0:
            store.set("token", os.urandom(TOKEN_BYTES).hex())
        token = bytes.fromhex(store.get("token").decode())
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        groups = {name: dist.new_group(backend=backend) for name in (*channels, CONTROL_CHANNEL)}
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                  if backend == "nccl" else torch.device("cpu"))
        return cls(rank, world_size, token, groups, device, channels)

    def _send(self, peer: int, tag: int, payload: memoryview, channel: str, meta: bytes) -> SendHandle:
        group = self._groups[channel]
        header = torch.tensor([self._token, self.rank, tag, self._channel_index[channel],
                               len(meta), payload.nbytes], dtype=torch.int64, device=self._device)
        tensors = [header]
        if meta:
            tensors.append(_staged(meta, self._device))
        if payload.nbytes:
            tensors.append(_staged(payload, self._device))
        with self._send_lock:
            works = [dist.isend(t, dst=peer, group=group) for t in tensors]
        self._sent.put((peer, works, tensors))
        return COMPLETED

    def _reap_sends(self) -> None:
        while True:
            item = self._sent.get()
            if isinstance(item, threading.Event):  # closing: every send before it has completed
                item.set()
                continue
            peer, works, _tensors = item
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # the peer died; liveness is reported by timeouts
                if not self._stop.is_set():
                    log.warning("rank %d: send to peer %d failed: %s", self.rank, peer, exc)

    def _recv_loop(self, channel: str, src: int | None) -> None:
        group = self._groups[channel]
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._device)
        while not self._stop.is_set():
            try:
                work = dist.irecv(header, src=src, group=group)
                work.wait()
                peer = src if src is not None else work._source_rank()
                self._receive_body(peer, channel, header.cpu().tolist())
            except Exception as exc:
                if not self._stop.is_set():
                    log.warning("rank %d: receive loop on channel %r stopped: %s", self.rank, channel, exc)
                return

    def _receive_body(self, peer: int, channel: str, header: list[int]) -> None:
        token, src, tag, channel_index, meta_len, nbytes = header
        group = self._groups[channel]

        def pull(n: int) -> torch.Tensor:
            buf = torch.empty(n, dtype=torch.uint8, device=self._device)
            if n:
                dist.recv(buf, src=peer, group=group)
            return buf.cpu()

        meta, payload = pull(meta_len), pull(nbytes)
        if token != self._token or src != peer or channel_index != self._channel_index[channel]:
            self._reject(f"header {header} from peer {peer} on channel {channel!r}")
            return
        self._deliver(Message(src, tag, channel, bytes(meta.numpy()), memoryview(payload.numpy())))

    def _shutdown(self) -> None:
        # Deliver the goodbyes and abort notices first (bounded): without this a process that
        # exited right after close() reset its connections under them, and a peer waiting in a
        # mismatched collective learnt of the abort only from its timeout (30 s; it happened in
        # about 1 of 2 runs of tests/local/test_torchdist.py).
        drained = threading.Event()
        self._sent.put(drained)
        if not drained.wait(CLOSE_LINGER_S):
            log.info("rank %d: closing with sends still in flight after %.1f s (a peer gone?)", self.rank,
                     CLOSE_LINGER_S)
        # A posted receive cannot be cancelled: the receive threads are daemons, left blocked.
        self._stop.set()


def _staged(data: bytes | memoryview, device: torch.device) -> torch.Tensor:
    """A private copy of ``data`` as a uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
