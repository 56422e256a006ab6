"""Routing policies: how a worker's pushes reach the servers and how models get back.

    python -m pytest tests/unit/test_ps.py -k routing

The runtime (``worker.py``, ``server.py``) decides *what* moves (which update, computed from
which version, answered under which consistency); a policy decides *how* it travels. This is
the seam where MLNET's aggregation/multicast trees and MLfabric's scheduled aggregation plug
in: they replace this object, not the runtime.

``direct`` (BASELINE in MLNET, vanilla Async in MLfabric): every worker sends each server its
component of an update in one message, and each server answers each pull itself.
``scheduled`` (MLfabric, :mod:`mlfabric.ps.scheduling`): pushes as the scheduler decides, pulls
answered in batches through distributors (§10.3).
``mlnet`` (MLNET, :mod:`mlfabric.ps.mlnet`): pushes summed up per-server trees, pulls
multicast down them, SSP's bound applied inside the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from mlfabric.runtime.executor import tensor_bytes
from mlfabric.transport.base import SendHandle

from . import protocol

if TYPE_CHECKING:
    from .server import ParameterServer, PendingPull
    from .worker import PSWorker


class RoutingPolicy(Protocol):
    name: str

    def send_push(self, worker: "PSWorker", model: str, components: list[torch.Tensor],
                  headers: list[bytes]) -> list[SendHandle] | None:
        """Send component ``j`` of an update (with header ``j``) toward server ``j``; None if
        the policy dropped the update instead (MLfabric's scheduler, Alg. 2)."""

    def send_pull(self, worker: "PSWorker", headers: list[bytes], *, clocks: list[bytes] | None = None) -> None:
        """Ask every server for its shard (header ``j`` to server ``j``), after the CLOCK
        header ``clocks[j]`` where given (in the same hand-off, :func:`send_pulls_directly`)."""

    def answer_pulls(self, server: "ParameterServer", pulls: "list[PendingPull]", shard: torch.Tensor,
                     header: bytes) -> list[SendHandle]:
        """Send ``shard`` (a snapshot that stays untouched until the handles are done) to
        the workers of ``pulls``."""

    def ready_to_answer(self, server: "ParameterServer") -> bool:
        """Whether the server answers the pulls that are ready now, or holds them to answer
        them in one batch later (MLfabric's model distribution batches requests)."""

    def answer_at(self) -> float | None:
        """When held pulls can be answered (``time.monotonic()``), so the server wakes then;
        None: no time of its own."""


def send_pulls_directly(worker: "PSWorker", headers: list[bytes], *, clocks: list[bytes] | None = None) -> None:
    """Pull header ``j`` to server ``j``; with ``clocks``, CLOCK header ``clocks[j]`` just
    before it, in one transport call (one segment on tcp, so the server takes both in one turn)."""
    tag = protocol.request_tag(worker.config.session)
    for j, header in enumerate(headers):
        if clocks is None:
            worker.transport.send(worker.server_rank(j), tag, b"", meta=header, channel=worker.channel)
        else:
            worker.transport.send_many(worker.server_rank(j), [(tag, b"", clocks[j]), (tag, b"", header)],
                                       channel=worker.channel)


def answer_directly(server: "ParameterServer", pulls: "list[PendingPull]", shard: torch.Tensor,
                    header: bytes) -> list[SendHandle]:
    """The server sends ``shard`` to each puller itself."""
    payload = tensor_bytes(shard)
    return [server.transport.send(p.rank, protocol.reply_tag(server.config.session, p.request_id), payload,
                                  meta=header, channel=server.channel)
            for p in pulls]


class DirectRouting:
    name = "direct"

    def send_push(self, worker: "PSWorker", model: str, components: list[torch.Tensor],
                  headers: list[bytes]) -> list[SendHandle]:
        tag = protocol.request_tag(worker.config.session)
        return [worker.transport.send(worker.server_rank(j), tag, tensor_bytes(component), meta=header,
                                      channel=worker.channel)
                for j, (component, header) in enumerate(zip(components, headers))]

    def send_pull(self, worker: "PSWorker", headers: list[bytes], *, clocks: list[bytes] | None = None) -> None:
        send_pulls_directly(worker, headers, clocks=clocks)

    def answer_pulls(self, server: "ParameterServer", pulls: "list[PendingPull]", shard: torch.Tensor,
                     header: bytes) -> list[SendHandle]:
        return answer_directly(server, pulls, shard, header)

    def ready_to_answer(self, server: "ParameterServer") -> bool:
        return True

    def answer_at(self) -> float | None:
        return None


POLICIES = ("direct", "scheduled", "mlnet")


def routing_policy(name: str, settings: object = None) -> RoutingPolicy:
    """``direct``, ``scheduled`` (MLfabric's scheduler: :mod:`mlfabric.ps.scheduling`) or
    ``mlnet`` (MLNET's trees, ``settings`` an :class:`mlfabric.ps.mlnet.MLNetSettings`)."""
    if name == "direct":
        return DirectRouting()
    if name == "mlnet":
        from .mlnet import MLNetRouting

        return MLNetRouting(settings)  # type: ignore[arg-type]
    if name == "scheduled":
        from .scheduling import ScheduledRouting

        return ScheduledRouting(settings)  # type: ignore[arg-type]
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
