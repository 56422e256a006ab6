"""Small models for the training workloads.

    .venv/bin/python -c "from mlfabric.train.models import MLP; print(MLP(in_features=32, hidden=256, depth=3, classes=10))"
    .venv/bin/python -c "from mlfabric.train.models import *; print(count_parameters(LeNet5()))"   # 3,274,634
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LeNet5", "MLP", "MODELS", "count_parameters"]


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


class LeNet5(nn.Sequential):
    """LeNet-5 as BML §4.2 counts it (3.27 million parameters, 12.5 MiB of float32 gradients):
    TensorFlow's MNIST LeNet-5, two 5x5 convolutions (32 and 64 channels, 'same' padding) with
    2x2 max-pooling, a 1024-unit fully connected layer and the classifier, on 1x28x28 inputs.
    3,274,634 parameters, 97% of them in the first fully connected layer (7*7*64 x 1024)."""

    def __init__(self, *, image_size: int = 28, channels: int = 1, classes: int = 10) -> None:
        if image_size < 4 or image_size % 4 or channels < 1 or classes < 2:
            raise ValueError(f"LeNet5 needs an image size divisible by 4, >= 1 channel and >= 2 classes, got "
                             f"image_size={image_size}, channels={channels}, classes={classes}")
        side = image_size // 4
        super().__init__(
            nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(side * side * 64, 1024), nn.ReLU(), nn.Linear(1024, classes))


#: Model names of ``TrainConfig.model``.
MODELS = ("mlp", "lenet5")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
