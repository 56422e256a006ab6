"""torch.distributed transport: messages as isend/irecv on process groups (gloo or NCCL).

Each channel (and the control channel) gets its own process group, so traffic of different
channels never queues behind each other. A message is three point-to-point transfers on
the channel's group: a fixed-size header (job token, source, tag, sizes), the collective
description, and the payload. A receive thread keeps one header receive posted per (peer,
channel) and polls them, so the design needs no any-source receive and works on NCCL too
(where staging tensors live on the rank's GPU, ``cuda:LOCAL_RANK``).

Exercise it with ``python -m pytest tests/local/test_torchdist.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import CONTROL_CHANNEL, TOKEN_BYTES, Message, SendHandle, Transport

log = logging.getLogger("mlfabric.transport.torchdist")

_HEADER_LEN = 6  # token, src, tag, channel index, meta bytes, payload bytes
_POLL_S = 0.0002


class _WorkHandle(SendHandle):
    """Send completion of the isend works; keeps the tensors alive until then."""

    __slots__ = ("_works", "_tensors")

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        super().__init__(False)
        self._works = works
        self._tensors = tensors

    def done(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._works):
            self._done = True
            self._works = []
            self._tensors = []
        return self._done


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
        self._thread = threading.Thread(target=self._recv_loop, name=f"mlfabric-torchdist-{rank}", daemon=True)
        self._thread.start()

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
            tensors.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self._device))
        if payload.nbytes:
            tensors.append(torch.frombuffer(payload, dtype=torch.uint8).to(self._device))
        with self._send_lock:
            works = [dist.isend(t, dst=peer, group=group) for t in tensors]
        return _WorkHandle(works, tensors)

    def _post_header(self, peer: int, channel: str):
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._device)
        return dist.irecv(header, src=peer, group=self._groups[channel]), header

    def _recv_loop(self) -> None:
        names = [*self.channels, CONTROL_CHANNEL]
        posted = {(peer, name): self._post_header(peer, name)
                  for peer in range(self.world_size) if peer != self.rank for name in names}
        while not self._stop.is_set():
            idle = True
            for key, (work, header) in list(posted.items()):
                if not work.is_completed():
                    continue
                idle = False
                peer, name = key
                self._receive_body(peer, name, header.cpu().tolist())
                posted[key] = self._post_header(peer, name)
            if idle:
                time.sleep(_POLL_S)

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
        # Posted header receives cannot be cancelled; the thread is a daemon and stops polling.
        self._stop.set()
