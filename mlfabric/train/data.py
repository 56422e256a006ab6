"""Synthetic classification data from a seed: Gaussian inputs labelled by a random teacher MLP,
or MNIST-shaped images.

    .venv/bin/python -c "from mlfabric.train.data import *; print(make_dataset(DataConfig()).train_x.shape)"
    .venv/bin/python -c "from mlfabric.train.data import *; print(make_dataset(DataConfig(kind='images')).train_x.shape)"

No downloads, identical on every rank and every run with the same seed. ``kind="teacher"``: a
fixed random teacher network (one tanh hidden layer) labels standard-normal inputs with the
argmax of its logits, so a student MLP can learn the task well but not instantly.
``kind="images"`` (MNIST-shaped, for LeNet-5; MNIST itself would need a download): 1 x
``image_size`` x ``image_size`` images in [0, 1], each a smooth random template of its class
(one per class) shifted by up to 3 pixels, scaled in brightness and with pixel noise added.
Train and test sets are drawn from the same distribution with different streams of the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataConfig", "Dataset", "make_dataset", "shard"]


DATA_KINDS = ("teacher", "images")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    kind: str = "teacher"  # or "images" (MNIST-shaped; ``features`` and ``teacher_hidden`` unused)
    features: int = 32
    classes: int = 10
    teacher_hidden: int = 64
    image_size: int = 28
    train_samples: int = 16_384
    test_samples: int = 4_096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(f"unknown data kind {self.kind!r}; choose one of {', '.join(DATA_KINDS)}")
        for name in ("features", "classes", "teacher_hidden", "image_size", "train_samples", "test_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name} must be positive, got {getattr(self, name)}")
        if self.classes < 2:
            raise ValueError(f"a classification task needs at least 2 classes, got {self.classes}")
        if self.kind == "images" and self.image_size < 8:
            raise ValueError(f"images need image_size >= 8, got {self.image_size}")


@dataclass(frozen=True, kw_only=True)
class Dataset:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def make_dataset(config: DataConfig) -> Dataset:
    """The train and test sets of ``config`` (float32 inputs, int64 labels)."""
    if config.kind == "images":
        return _make_images(config)
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


def _make_images(config: DataConfig) -> Dataset:
    gen = torch.Generator().manual_seed(config.seed)
    side, pad = config.image_size, 3
    # One smooth template per class: coarse noise upsampled, so neighbouring pixels correlate
    # like strokes do, then squashed to [0, 1].
    coarse = torch.randn(config.classes, 1, side // 4 + 2, side // 4 + 2, generator=gen)
    smooth = torch.nn.functional.interpolate(coarse, size=(side + 2 * pad, side + 2 * pad), mode="bilinear",
                                             align_corners=False)
    templates = torch.sigmoid(3.0 * smooth)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, config.classes, (n,), generator=gen)
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
        rows = (dy[:, None] + torch.arange(side)[None, :])[:, :, None]  # n x side x 1
        cols = (dx[:, None] + torch.arange(side)[None, :])[:, None, :]  # n x 1 x side
        x = templates[y, 0][torch.arange(n)[:, None, None], rows, cols].unsqueeze(1)
        scale = 0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=gen)
        x = (x * scale + 0.25 * torch.randn(x.shape, generator=gen)).clamp_(0.0, 1.0)
        return x, y

    train_x, train_y = draw(config.train_samples)
    test_x, test_y = draw(config.test_samples)
    return Dataset(train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y)


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s strided share of a dataset (like DistributedSampler without shuffling)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not valid in a world of {world_size}")
    return x[rank::world_size], y[rank::world_size]
