"""Synthetic classification data from a seed: Gaussian inputs labelled by a random teacher MLP.

    .venv/bin/python -c "from mlfabric.train.data import *; print(make_dataset(DataConfig()).train_x.shape)"

No downloads, identical on every rank and every run with the same seed: a fixed random
teacher network (one tanh hidden layer) labels standard-normal inputs with the argmax of its
logits, so a student MLP can learn the task well but not instantly. Train and test sets
are drawn from the same distribution with different streams of the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataConfig", "Dataset", "make_dataset", "shard"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    features: int = 32
    classes: int = 10
    teacher_hidden: int = 64
    train_samples: int = 16_384
    test_samples: int = 4_096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("features", "classes", "teacher_hidden", "train_samples", "test_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name} must be positive, got {getattr(self, name)}")
        if self.classes < 2:
            raise ValueError(f"a classification task needs at least 2 classes, got {self.classes}")


@dataclass(frozen=True, kw_only=True)
class Dataset:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def make_dataset(config: DataConfig) -> Dataset:
    """The train and test sets of ``config`` (float32 inputs, int64 labels)."""
    gen = torch.Generator().manual_seed(config.seed)
    w1 = torch.randn(config.features, config.teacher_hidden, generator=gen) / config.features ** 0.5
    b1 = torch.randn(config.teacher_hidden, generator=gen) * 0.5
    w2 = torch.randn(config.teacher_hidden, config.classes, generator=gen) / config.teacher_hidden ** 0.5

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, config.features, generator=gen)
        with torch.no_grad():
            y = (torch.tanh(x @ w1 + b1) @ w2).argmax(dim=1)
        return x, y

    train_x, train_y = draw(config.train_samples)
    test_x, test_y = draw(config.test_samples)
    return Dataset(train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y)


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s strided share of a dataset (like DistributedSampler without shuffling)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not valid in a world of {world_size}")
    return x[rank::world_size], y[rank::world_size]
