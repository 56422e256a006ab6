"""In-process transport: ranks are threads of one process sharing a :class:`LocalFabric`.

For fast tests of every algorithm without sockets. Sends copy the payload, so a send is
complete as soon as it returns. ``LocalFabric.kill(rank)`` simulates a process crash: every
other rank sees the peer as lost, like the TCP transport does when a connection drops.

Exercise it with ``python -m pytest tests/unit/test_runtime.py``.
"""

from __future__ import annotations

import threading

from .base import COMPLETED, Message, SendHandle, Transport


class LocalFabric:
    """The shared wire between the threads of one in-process job."""

    def __init__(self, world_size: int, channels: tuple[str, ...] = ("0",)) -> None:
        self.world_size = world_size
        self.channels = channels
        self._lock = threading.Lock()
        self._endpoints: dict[int, LocalTransport] = {}

    def transport(self, rank: int) -> "LocalTransport":
        with self._lock:
            if rank in self._endpoints:
                raise ValueError(f"rank {rank} already has a transport on this fabric")
            endpoint = LocalTransport(self, rank)
            self._endpoints[rank] = endpoint
            return endpoint

    def transports(self) -> list["LocalTransport"]:
        return [self.transport(rank) for rank in range(self.world_size)]

    def _endpoint(self, rank: int) -> "LocalTransport | None":
        with self._lock:
            return self._endpoints.get(rank)

    def kill(self, rank: int) -> None:
        """Make ``rank`` vanish without a goodbye, as a crashed process would."""
        with self._lock:
            victim = self._endpoints.pop(rank, None)
            others = list(self._endpoints.values())
        if victim is not None:
            victim._closed = True
        for endpoint in others:
            endpoint._peer_lost(rank, "in-process peer was killed")


class LocalTransport(Transport):
    def __init__(self, fabric: LocalFabric, rank: int) -> None:
        super().__init__(rank, fabric.world_size, fabric.channels)
        self.fabric = fabric

    def _send(self, peer: int, tag: int, payload: memoryview, channel: str, meta: bytes) -> SendHandle:
        target = self.fabric._endpoint(peer)
        if target is None or target._closed:
            # Like TCP to a dead host: the data is silently lost; liveness reports the peer.
            return COMPLETED
        target._deliver(Message(self.rank, tag, channel, bytes(meta), memoryview(bytearray(payload))))
        return COMPLETED

    def _shutdown(self) -> None:
        with self.fabric._lock:
            if self.fabric._endpoints.get(self.rank) is self:
                del self.fabric._endpoints[self.rank]
