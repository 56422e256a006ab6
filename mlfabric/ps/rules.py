"""How a server applies an update to its shard: MLfabric's eq. (1)-(2), SGD with momentum.

    python -m pytest tests/unit/test_ps.py -k rule

Workers push gradients ``g``; the server owns the learning rate ``lr`` (eta) and momentum
``gamma`` (both declared by the workers' optimizer when the model is registered) and applies

    u         = -lr * g                                  (eq. 1: the update)
    w_{t+1}   = w_t + u + gamma * (w_t - w_{t-1})        (eq. 2)

keeping ``h = w_t - w_{t-1}`` (the update history, MLfabric §5.3's h) per shard. For a
constant ``lr`` this is ``torch.optim.SGD(momentum=gamma)`` exactly: its buffer ``b = gamma b
+ g`` and step ``w -= lr b`` give the same ``h = -lr b``.

An applied update may combine several workers' gradients (a BSP round, an aggregate);
``weight`` scales it: BSP rounds apply the mean of their ``m`` gradients (``1/m``), SSP and
async apply each worker's gradient as its share of the job (``1/W``), so one pass of every
worker moves the model as far as one synchronous step (see docs/parameter_server.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """What the server knows about an update when it applies it."""

    model: str
    server: int
    version: int                 # the shard's version before this update
    workers: tuple[int, ...]     # whose gradients it sums
    computed_from: tuple[int, ...]  # per worker, the version its gradient was computed from
    weight: float                # the scale the rule applies to the summed gradient


class UpdateRule(Protocol):
    def __call__(self, shard: torch.Tensor, gradient: torch.Tensor, info: UpdateInfo) -> None:
        """Apply ``gradient`` (a sum of ``len(info.workers)`` gradients) to ``shard`` in place."""


class SGDMomentum:
    """eq. (1)-(2), see the module docstring. One instance per shard (it keeps ``h``)."""

    def __init__(self, lr: float, momentum: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.history: torch.Tensor | None = None  # h = w_t - w_{t-1}

    def __call__(self, shard: torch.Tensor, gradient: torch.Tensor, info: UpdateInfo) -> None:
        step = gradient.to(shard.dtype).mul(-self.lr * info.weight)
        if self.momentum:
            if self.history is None:
                self.history = torch.zeros_like(shard)
            step.add_(self.history, alpha=self.momentum)
            self.history.copy_(step)
        shard.add_(step)


def make_default_rule(lr: float, momentum: float) -> Callable[[], UpdateRule]:
    return lambda: SGDMomentum(lr, momentum)
