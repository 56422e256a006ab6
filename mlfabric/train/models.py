"""Small models for the training workloads.

    .venv/bin/python -c "from mlfabric.train.models import MLP; print(MLP(in_features=32, hidden=256, depth=3, classes=10))"
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP", "count_parameters"]


class MLP(nn.Sequential):
    """``depth`` hidden layers of width ``hidden`` with ReLU, then a linear classifier."""

    def __init__(self, *, in_features: int, hidden: int, depth: int, classes: int) -> None:
        if min(in_features, hidden, classes) < 1 or depth < 1:
            raise ValueError(f"MLP needs positive sizes and depth >= 1, got in_features={in_features}, "
                             f"hidden={hidden}, depth={depth}, classes={classes}")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        super().__init__(*layers)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
