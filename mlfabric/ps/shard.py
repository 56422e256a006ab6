"""A server's state per model: its shard of the values, version, rule, open BSP rounds and waiting pulls.

    .venv/bin/python -m pytest tests/unit/test_ps.py -q

Shared by the server (:mod:`mlfabric.ps.server`), the replica that takes over one
(:mod:`mlfabric.ps.replica`) and the policies that hold pushes or answer pulls
(:mod:`mlfabric.ps.policies`), which reach it through :class:`mlfabric.ps.policy.ServerPort`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .model import ModelSpec
from .rules import UpdateInfo

UpdateRule = Callable[[torch.Tensor, torch.Tensor, UpdateInfo], None]


@dataclass
class PendingPull:
    rank: int
    worker: int
    request_id: int
    clock: int
    staleness: float
    arrived: float
    #: The worker asks to be answered by the server itself (its distributor was lost).
    direct: bool = False
    #: An ordered pull (``mlfabric.ps.policies.ordered``): per tensor, in this order; None: one flat reply.
    order: str | None = None


@dataclass
class Round:
    """BSP: the sum of one iteration's gradients for one shard, and who is in it."""

    total: torch.Tensor
    workers: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class Shard:
    """A server's range of one model, its version, rule and statistics."""

    def __init__(self, spec: ModelSpec, offset: int, length: int, values: torch.Tensor, rule: UpdateRule, *,
                 lr: float, momentum: float) -> None:
        self.spec, self.offset, self.length = spec, offset, length
        self.lr, self.momentum = lr, momentum  # what the workers registered (replicas get them)
        self.values = values
        self.rule = rule
        self.version = 0
        self.rounds: dict[int, Round] = {}
        self.pulls: list[PendingPull] = []
        #: Send order of the tensors for ordered pulls (key -> priority, lower first), if registered.
        self.priorities: dict[str, int] | None = None
        self._snapshot: tuple[int, torch.Tensor] | None = None

    def snapshot(self) -> torch.Tensor:
        """A copy of the values at the current version, shared by every pull of that version
        (the transport reads it in the background while updates go on)."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.values.clone())
        return self._snapshot[1]

    @property
    def history(self) -> torch.Tensor | None:
        """The rule's update history (momentum), which a replica needs to give the same values."""
        return getattr(self.rule, "history", None)
