"""The training workloads of ``mlfabric train``, synthetic and seeded: eager-SGD's hyperplane
regression and LSTM video-classification stand-in, BML's LeNet-5 on MNIST-shaped images and
an MLP on a random-teacher classification.

    .venv/bin/python -c "from mlfabric.train.workloads import *; print(Hyperplane(HyperplaneSpec(dim=64)).val()[0].shape)"

* :class:`Hyperplane` (eager-SGD §6.2.1): ``y = a . x + noise`` in ``dim`` = 8,192
  dimensions, ``x`` and ``a`` standard normal, noise ``N(0, noise^2)`` (so the best possible
  validation MSE is ``noise^2``); the model is a one-layer MLP (``nn.Linear(dim, 1)``), the
  loss and the validation metric the mean squared error. The training set is made of blocks
  of 256 samples, block ``j`` drawn from its own seed, so a worker generates only its own
  shard (8 workers of the paper's 32,768-sample set hold 128 MiB each, not the whole GiB).
* :class:`SequenceTask` (eager-SGD §6.3, LSTM on UCF101): sequences of ``features``-wide
  frame vectors whose lengths follow UCF101's long tail (29-1,776 frames, median 167,
  standard deviation 97: a log-normal with those moments, clipped) divided by
  ``length_scale``; every frame is noise plus, inside one window covering a random 30-70%
  of the sequence, a faint class prototype. The model (:class:`SequenceClassifier`) is an
  LSTM over the packed sequences plus a linear classifier on its last hidden state. A step's
  compute grows with the longest sequence of the batch, so the workers' steps are unequal by
  nature, as in the paper's video model.

* :class:`LeNet5Task` (BML §4.2's LeNet-5 job): MNIST-shaped 1 x 28 x 28 images of 10
  classes, each a smooth random template of its class shifted by up to 3 pixels, scaled in
  brightness and with pixel noise (:func:`mlfabric.train.data.make_dataset`, ``kind="images"``);
  the model is :class:`~mlfabric.train.models.LeNet5` (3.27 million parameters, 12.5 MiB of
  float32 gradients per step: the communication-heavy workload), the loss cross-entropy,
  the metric accuracy.
* :class:`MlpTask`: standard-normal ``features``-wide inputs labelled by a fixed random
  teacher network (one tanh hidden layer, the argmax of its logits: a 10-class
  classification with unequal classes) (:func:`~mlfabric.train.data.make_dataset`,
  ``kind="teacher"``); the model is :class:`~mlfabric.train.models.MLP` (``depth`` ReLU
  layers of ``hidden``: 142k parameters by default), the loss cross-entropy, the metric
  accuracy (the student reaches about 77% on the validation set: the teacher's boundaries
  are learnt slowly, so the curve keeps rising for many epochs; the majority class is 20%).

The fifth workload, ``lda`` (distributed LDA by collapsed Gibbs sampling on a corpus drawn from
LDA's generative model, MLfabric §7; metric: held-out log-likelihood), lives in
:mod:`mlfabric.train.lda`: its "model" is a count matrix whose updates add up.

All give every rank the same data for the same seed and need no download. The two
classification tasks draw their whole training set on every rank (one generator stream;
the validation set comes after it in the same stream) and shard it strided, like
``DistributedSampler`` without shuffling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "UCF101_FRAMES", "Hyperplane", "HyperplaneSpec", "LeNet5Spec", "LeNet5Task", "LstmSpec", "MlpSpec", "MlpTask",
    "SequenceClassifier", "SequenceTask", "ucf101_like_lengths",
]

_BLOCK = 256  # hyperplane samples per seeded block
# UCF101's training videos (eager-SGD §2.1): 29 to 1,776 frames, median 167, std 97.
UCF101_FRAMES = {"min": 29, "max": 1776, "median": 167, "std": 97}


@dataclass(frozen=True, kw_only=True)
class HyperplaneSpec:
    dim: int = 8192
    train_samples: int = 32_768  # eager-SGD Table 1
    val_samples: int = 2_048
    noise: float = 2.0  # standard deviation of the label noise
    #: Emulated accelerator seconds per step (a sleep after the CPU's, as LeNet5Spec's): gives
    #: runs a known length, e.g. the worker kills and rejoins of mlfabric.train.ps_rejoin.
    compute_time_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.dim, self.train_samples, self.val_samples) < 1 or not self.noise >= 0:
            raise ValueError(f"hyperplane sizes must be positive and noise >= 0, got {self}")
        _check_compute_time(self.compute_time_s)


class Hyperplane:
    """The regression task of ``spec`` for ``seed`` (see module)."""

    metric = "mse"  # lower is better

    def __init__(self, spec: HyperplaneSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        gen = torch.Generator().manual_seed(_mix(seed, 0))
        self.coefficients = torch.randn(spec.dim, generator=gen)

    def _block(self, index: int, n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(_mix(self.seed, stream, index))
        x = torch.randn(n, self.spec.dim, generator=gen)
        y = x @ self.coefficients + self.spec.noise * torch.randn(n, generator=gen)
        return x, y

    def shard(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of the training set: blocks ``rank, rank + P, ...``."""
        blocks = math.ceil(self.spec.train_samples / _BLOCK)
        parts = [self._block(j, min(_BLOCK, self.spec.train_samples - j * _BLOCK), 1)
                 for j in range(rank, blocks, world_size)]
        if not parts:
            raise ValueError(f"{self.spec.train_samples} training samples leave rank {rank} of {world_size} "
                             "without data; raise train_samples")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def val(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._block(0, self.spec.val_samples, 2)

    @staticmethod
    def batch(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[index]

    def device_time(self, x: torch.Tensor) -> float:
        """Emulated accelerator seconds of a batch: the spec's fixed ``compute_time_s``."""
        return self.spec.compute_time_s

    def model(self) -> nn.Module:
        return nn.Linear(self.spec.dim, 1)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x).squeeze(1), y)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(loss, metric) on ``x, y``: both the MSE here."""
        with torch.no_grad():
            mse = float(self.loss(model, x, y))
        return mse, mse


@dataclass(frozen=True, kw_only=True)
class LstmSpec:
    features: int = 32
    hidden: int = 64
    classes: int = 10
    train_samples: int = 4_096
    val_samples: int = 2_048
    length_scale: float = 8.0    # UCF101's frame counts are divided by this
    signal: float = 0.15         # prototype amplitude inside the window (noise: 1 per feature)
    # Emulated accelerator time per padded time step (seconds): a worker sleeps this times
    # the longest sequence of its batch, as if its LSTM ran on a device of its own. 0: off.
    frame_time_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.features, self.hidden, self.train_samples, self.val_samples) < 1 or self.classes < 2:
            raise ValueError(f"LSTM task sizes must be positive (and classes >= 2), got {self}")
        if not self.length_scale >= 1 or not self.signal > 0 or not self.frame_time_s >= 0:
            raise ValueError("length_scale must be >= 1, signal > 0 and frame_time_s >= 0")


def ucf101_like_lengths(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """``n`` sequence lengths with UCF101's median and spread (log-normal, clipped to its
    29..1,776 range), divided by ``scale`` (at least 2 frames)."""
    median, std = UCF101_FRAMES["median"], UCF101_FRAMES["std"]
    # A log-normal with median m has variance m^2 u (u - 1), u = exp(sigma^2).
    ratio = (std / median) ** 2
    u = (1 + math.sqrt(1 + 4 * ratio)) / 2
    sigma = math.sqrt(math.log(u))
    raw = torch.exp(math.log(median) + sigma * torch.randn(n, generator=gen))
    raw = raw.clamp(UCF101_FRAMES["min"], UCF101_FRAMES["max"])
    return torch.clamp(torch.round(raw / scale), min=2).to(torch.int64)


class SequenceClassifier(nn.Module):
    """LSTM over packed sequences, then a linear classifier on the last hidden state."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


class SequenceTask:
    """The sequence-classification task of ``spec`` for ``seed`` (see module). Batches are
    ``(frames, lengths)`` pairs: frames padded to the longest sequence of the batch."""

    metric = "accuracy"  # higher is better

    def __init__(self, spec: LstmSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        gen = torch.Generator().manual_seed(_mix(seed, 10))
        self.prototypes = torch.randn(spec.classes, spec.features, generator=gen)

    def _draw(self, n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec = self.spec
        gen = torch.Generator().manual_seed(_mix(self.seed, stream))
        lengths = ucf101_like_lengths(n, gen, spec.length_scale)
        labels = torch.randint(0, spec.classes, (n,), generator=gen)
        longest = int(lengths.max())
        frames = torch.randn(n, longest, spec.features, generator=gen)
        steps = torch.arange(longest)[None, :]
        # The class shows inside one window of each sequence (30-70% of it, anywhere).
        width = torch.clamp((lengths.float() * (0.3 + 0.4 * torch.rand(n, generator=gen))).round().long(), min=1)
        begin = (torch.rand(n, generator=gen) * (lengths - width + 1).float()).long()
        window = (steps >= begin[:, None]) & (steps < (begin + width)[:, None])
        frames += spec.signal * window[:, :, None] * self.prototypes[labels][:, None, :]
        frames *= (steps < lengths[:, None])[:, :, None]  # zero padding
        return frames, lengths, labels

    def shard(self, rank: int, world_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        frames, lengths, labels = self._draw(self.spec.train_samples, 1)
        mine = slice(rank, None, world_size)
        if frames[mine].shape[0] == 0:
            raise ValueError(f"{self.spec.train_samples} sequences leave rank {rank} of {world_size} without data")
        return (frames[mine].contiguous(), lengths[mine].contiguous()), labels[mine].contiguous()

    def val(self) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        frames, lengths, labels = self._draw(self.spec.val_samples, 2)
        return (frames, lengths), labels

    @staticmethod
    def batch(x: tuple[torch.Tensor, torch.Tensor], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames, lengths = x
        picked = lengths[index]
        return frames[index, :int(picked.max())], picked

    def model(self) -> nn.Module:
        return SequenceClassifier(self.spec.features, self.spec.hidden, self.spec.classes)

    def loss(self, model: nn.Module, x: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(*x), y)

    def device_time(self, x: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Emulated accelerator seconds of a batch (``frame_time_s`` x its longest sequence)."""
        return self.spec.frame_time_s * int(x[1].max()) if self.spec.frame_time_s else 0.0

    def evaluate(self, model: nn.Module, x: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> tuple[float, float]:
        """(cross-entropy, accuracy) on ``x, y``, in chunks of similar lengths."""
        order = torch.argsort(x[1])
        total_loss, correct = 0.0, 0
        with torch.no_grad():
            for chunk in torch.split(order, 128):
                batch = self.batch(x, chunk)
                logits = model(*batch)
                total_loss += float(nn.functional.cross_entropy(logits, y[chunk], reduction="sum"))
                correct += int((logits.argmax(dim=1) == y[chunk]).sum())
        n = y.shape[0]
        return total_loss / n, correct / n


@dataclass(frozen=True, kw_only=True)
class LeNet5Spec:
    """LeNet-5's synthetic MNIST-shaped task (see module). 4,096 training images make 32-step
    epochs for 4 workers of 32: the model is above 95% accuracy within about two of them."""

    image_size: int = 28
    classes: int = 10
    train_samples: int = 4_096
    val_samples: int = 1_024
    #: Emulated accelerator seconds per step (slept after the CPU's forward/backward), so that
    #: compute:communication can be set like a GPU job's on a machine of a few cores.
    compute_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size < 8 or self.image_size % 4:
            raise ValueError(f"LeNet-5 images need a side >= 8 divisible by 4, got image_size={self.image_size}")
        if self.classes < 2 or min(self.train_samples, self.val_samples) < 1:
            raise ValueError(f"LeNet-5 task: classes must be >= 2 and sample counts positive, got {self}")
        _check_compute_time(self.compute_time_s)


@dataclass(frozen=True, kw_only=True)
class MlpSpec:
    """The MLP student on the teacher task (see module): data sizes and the student's shape."""

    features: int = 32
    classes: int = 10
    teacher_hidden: int = 64
    hidden: int = 256
    depth: int = 3
    train_samples: int = 32_768
    val_samples: int = 4_096
    compute_time_s: float = 0.0  # as LeNet5Spec's

    def __post_init__(self) -> None:
        if min(self.features, self.teacher_hidden, self.hidden, self.depth, self.train_samples,
               self.val_samples) < 1 or self.classes < 2:
            raise ValueError(f"MLP task sizes must be positive (and classes >= 2), got {self}")
        _check_compute_time(self.compute_time_s)


def _check_compute_time(seconds: float) -> None:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"compute_time_s must be a finite number of seconds >= 0, got {seconds}")


class _Classification:
    """What the two image/teacher tasks share: a dataset drawn once per task object (every
    rank draws the same one), strided shards, cross-entropy, accuracy in chunks."""

    metric = "accuracy"  # higher is better
    _EVAL_CHUNK = 512

    spec: Any  # LeNet5Spec or MlpSpec

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._dataset: Any = None

    def _data_config(self) -> Any:  # a mlfabric.train.data.DataConfig
        raise NotImplementedError

    def dataset(self) -> Any:
        """The whole training and validation sets (:class:`mlfabric.train.data.Dataset`), drawn once."""
        if self._dataset is None:
            from .data import make_dataset

            self._dataset = make_dataset(self._data_config())
        return self._dataset

    def shard(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s strided share of the training set: samples ``rank, rank + P, ...``."""
        from .data import shard

        data = self.dataset()
        x, y = shard(data.train_x, data.train_y, rank, world_size)
        if y.shape[0] == 0:
            raise ValueError(f"{data.train_y.shape[0]} training samples leave rank {rank} of {world_size} "
                             "without data; raise train_samples")
        return x.contiguous(), y.contiguous()

    def val(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.dataset()
        return data.test_x, data.test_y

    @staticmethod
    def batch(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[index]

    def device_time(self, x: torch.Tensor) -> float:
        """Emulated accelerator seconds of a batch: the spec's fixed ``compute_time_s``."""
        return self.spec.compute_time_s

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(cross-entropy, accuracy) on ``x, y``."""
        total_loss, correct = 0.0, 0
        with torch.no_grad():
            for xs, ys in zip(torch.split(x, self._EVAL_CHUNK), torch.split(y, self._EVAL_CHUNK)):
                logits = model(xs)
                total_loss += float(nn.functional.cross_entropy(logits, ys, reduction="sum"))
                correct += int((logits.argmax(dim=1) == ys).sum())
        n = y.shape[0]
        return total_loss / n, correct / n


class LeNet5Task(_Classification):
    """LeNet-5 on the synthetic MNIST-shaped images of ``spec`` for ``seed`` (see module)."""

    def __init__(self, spec: LeNet5Spec, seed: int = 0) -> None:
        super().__init__(seed)
        self.spec = spec

    def _data_config(self) -> Any:
        from .data import DataConfig

        return DataConfig(kind="images", image_size=self.spec.image_size, classes=self.spec.classes,
                          train_samples=self.spec.train_samples, test_samples=self.spec.val_samples,
                          seed=_mix(self.seed, 20))

    def model(self) -> nn.Module:
        from .models import LeNet5

        return LeNet5(image_size=self.spec.image_size, classes=self.spec.classes)


class MlpTask(_Classification):
    """The MLP student on the random-teacher classification of ``spec`` for ``seed`` (see module)."""

    def __init__(self, spec: MlpSpec, seed: int = 0) -> None:
        super().__init__(seed)
        self.spec = spec

    def _data_config(self) -> Any:
        from .data import DataConfig

        return DataConfig(kind="teacher", features=self.spec.features, classes=self.spec.classes,
                          teacher_hidden=self.spec.teacher_hidden, train_samples=self.spec.train_samples,
                          test_samples=self.spec.val_samples, seed=_mix(self.seed, 30))

    def model(self) -> nn.Module:
        from .models import MLP

        return MLP(in_features=self.spec.features, hidden=self.spec.hidden, depth=self.spec.depth,
                   classes=self.spec.classes)


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and platforms)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 31
    return value & 0x7FFFFFFFFFFFFFFF
