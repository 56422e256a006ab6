"""DDP training with mlfabric's comm hook on local ranks: loss curve, accuracy, step times.

    .venv/bin/python -c "from mlfabric.train import *; print(run_training(TrainConfig(steps=50), world_size=2).summary())"

:func:`run_training` launches ``world_size`` ranks (:mod:`mlfabric.bench.procs`); each
joins a gloo process group (DDP's bookkeeping) and an mlfabric communicator, wraps an
:class:`~mlfabric.train.models.MLP` (or, with ``model="lenet5"``, BML's
:class:`~mlfabric.train.models.LeNet5` on MNIST-shaped images) in DistributedDataParallel
with ``mlfabric.torch.allreduce_hook`` and trains it with SGD on its shard of the synthetic
task (:mod:`mlfabric.train.data`). ``algorithm="gloo"`` leaves DDP's own allreduce in place:
the synchronous baseline. Rank 0 reports ``{"step", "loss"}`` as it goes, for progress bars.
:func:`train_rank` is the per-rank body, usable under ``torchrun`` and ``mlfabric launch``
too; ``run_training(..., launch=...)`` runs the ranks elsewhere, e.g. on an emulated cluster
(:func:`mlfabric.emu.launcher.emulated_launch`, whose ``MLFABRIC_TOPOLOGY`` lets
``algorithm="bcube"`` run BML).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mlfabric.bench.procs import LaunchConfig, rank_env, report, run_ranks

from .data import DataConfig, make_dataset, shard

__all__ = ["BASELINE", "RankTrainResult", "TrainConfig", "TrainResult", "run_training", "train_rank"]

BASELINE = "gloo"  # DDP's default gradient allreduce, no mlfabric hook


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. ``batch_size`` is per rank; ``algorithm`` is an mlfabric allreduce
    algorithm for the comm hook, or ``"gloo"`` for DDP's default allreduce."""

    steps: int = 200
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    model: str = "mlp"  # or "lenet5" (needs data.kind="images")
    hidden: int = 256
    depth: int = 3
    algorithm: str = "ring"
    # The cluster's topology spec for the communicator (None: MLFABRIC_TOPOLOGY, which the
    # emulator sets); BML (algorithm="bcube") needs a BCube.
    topology: str | None = None
    transport: str = "tcp"
    bucket_cap_mb: float = 0.25  # small buckets: several allreduces per step, as in real models
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 0
    timeout_s: float = 300.0
    report_every: int = 1

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.collectives import ALLREDUCE_ALGORITHMS

        from .models import MODELS

        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.model == "lenet5" and self.data.kind != "images":
            raise ValueError("model lenet5 trains on images: use data=DataConfig(kind='images')")
        if self.model == "mlp" and self.data.kind != "teacher":
            raise ValueError("model mlp trains on the teacher task: use data=DataConfig(kind='teacher')")
        if self.steps < 1 or self.batch_size < 1 or self.report_every < 1:
            raise ValueError(f"steps, batch_size and report_every must be positive, got "
                             f"{self.steps}, {self.batch_size}, {self.report_every}")
        if self.lr <= 0 or self.bucket_cap_mb <= 0 or self.timeout_s <= 0:
            raise ValueError("lr, bucket_cap_mb and timeout_s must be positive")
        known = (*ALLREDUCE_ALGORITHMS, "auto", BASELINE)
        if self.algorithm not in known:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose from {', '.join(known)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")


@dataclass(frozen=True, kw_only=True)
class RankTrainResult:
    rank: int
    losses: tuple[float, ...]      # this rank's minibatch loss, per step
    step_times: tuple[float, ...]  # seconds: forward, backward (with the allreduce), optimizer step
    loop_s: float                  # wall time of the whole loop
    # On the test set, after training: rank 0 only (None on the others). DDP keeps every
    # replica's parameters identical, so one evaluation is the job's; on every rank it cost
    # each one a forward pass over the whole test set (LeNet-5, 1,024 images: ~1.4 s of CPU,
    # 9 ranks sharing a small machine's cores at the end of every bml-job run).
    accuracy: float | None
    test_loss: float | None
    parameters: int
    buckets_reduced: int           # by the mlfabric hook (0 for the baseline)
    bytes_reduced: int


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    config: TrainConfig
    world_size: int
    losses: tuple[float, ...]      # per step, mean over ranks (= loss of the global batch)
    step_times: tuple[float, ...]  # per step, slowest rank
    accuracy: float
    test_loss: float
    steps_per_s: float
    parameters: int
    per_rank: tuple[RankTrainResult, ...]

    @property
    def initial_loss(self) -> float:
        return self.losses[0]

    @property
    def loop_s(self) -> float:
        """Wall time of the training loop on the slowest rank: the job completion time (JCT)
        of ``config.steps`` iterations, without process start-up and rendezvous."""
        return max(r.loop_s for r in self.per_rank)

    @property
    def final_loss(self) -> float:
        """Mean of the last 10 steps' losses (a single minibatch loss is noisy)."""
        tail = self.losses[-min(10, len(self.losses)):]
        return sum(tail) / len(tail)

    def summary(self) -> dict[str, Any]:
        return {
            "algorithm": self.config.algorithm, "transport": self.config.transport,
            "world_size": self.world_size, "steps": self.config.steps, "parameters": self.parameters,
            "initial_loss": self.initial_loss, "final_loss": self.final_loss,
            "test_loss": self.test_loss, "accuracy": self.accuracy, "steps_per_s": self.steps_per_s,
            "median_step_s": statistics.median(self.step_times),
        }


def run_training(config: TrainConfig, *, world_size: int = 2,
                 on_step: Callable[[int, float], None] | None = None,
                 capture_output: bool = False, launch: LaunchConfig | None = None) -> TrainResult:
    """Train on ``world_size`` local ranks, or on the ranks ``launch`` describes (its world
    size wins); ``on_step(step, loss)`` follows rank 0."""
    if launch is None:
        launch = LaunchConfig(world_size=world_size, timeout_s=config.timeout_s, capture_output=capture_output)
    world_size = launch.world_size

    def on_report(rank: int, payload: Any) -> None:
        if on_step is not None and rank == 0 and isinstance(payload, dict):
            on_step(int(payload["step"]), float(payload["loss"]))

    ranks: list[RankTrainResult] = run_ranks(train_rank, config=launch, args=(config,), on_report=on_report)
    losses = tuple(statistics.fmean(step) for step in zip(*(r.losses for r in ranks)))
    step_times = tuple(max(step) for step in zip(*(r.step_times for r in ranks)))
    loop_s = max(r.loop_s for r in ranks)
    return TrainResult(config=config, world_size=world_size, losses=losses, step_times=step_times,
                       accuracy=_evaluated(ranks[0].accuracy), test_loss=_evaluated(ranks[0].test_loss),
                       steps_per_s=config.steps / loop_s, parameters=ranks[0].parameters,
                       per_rank=tuple(ranks))


def _evaluated(value: float | None) -> float:
    if value is None:  # rank 0 always evaluates: a None here is a bug, not a result
        raise RuntimeError("rank 0 returned no test-set evaluation")
    return value


def train_rank(config: TrainConfig) -> RankTrainResult:
    """The body of one rank (reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mlfabric
    import mlfabric.torch as mltorch

    from .models import MLP, LeNet5, count_parameters

    env = rank_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
    comm = None
    state = None
    try:
        data = make_dataset(config.data)
        x, y = shard(data.train_x, data.train_y, env.rank, env.world_size)
        if x.shape[0] < config.batch_size:
            raise ValueError(f"rank {env.rank}: its shard has {x.shape[0]} samples, fewer than one "
                             f"batch of {config.batch_size}; raise data.train_samples")
        torch.manual_seed(config.seed)
        if config.model == "lenet5":
            model: torch.nn.Module = LeNet5(image_size=config.data.image_size, classes=config.data.classes)
        else:
            model = MLP(in_features=config.data.features, hidden=config.hidden, depth=config.depth,
                        classes=config.data.classes)
        ddp = DDP(model, bucket_cap_mb=config.bucket_cap_mb)
        if config.algorithm != BASELINE:
            comm = mlfabric.init(transport=config.transport, timeout=config.timeout_s, topology=config.topology)
            state = mltorch.HookState(comm, algorithm=config.algorithm)
            ddp.register_comm_hook(state, mltorch.allreduce_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
        loss_fn = torch.nn.CrossEntropyLoss()
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + env.rank)
        per_epoch = x.shape[0] // config.batch_size
        order = torch.randperm(x.shape[0], generator=gen)
        losses: list[float] = []
        step_times: list[float] = []
        loop_start = time.perf_counter()
        for step in range(config.steps):
            if step % per_epoch == 0 and step > 0:
                order = torch.randperm(x.shape[0], generator=gen)
            index = order[(step % per_epoch) * config.batch_size:][:config.batch_size]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x[index]), y[index])
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - start)
            losses.append(float(loss.item()))
            if env.rank == 0 and ((step + 1) % config.report_every == 0 or step + 1 == config.steps):
                report({"step": step + 1, "loss": losses[-1]})
        loop_s = time.perf_counter() - loop_start
        accuracy = test_loss = None
        if env.rank == 0:  # the replicas are identical (see RankTrainResult.accuracy)
            with torch.no_grad():
                logits = model(data.test_x)
                test_loss = float(loss_fn(logits, data.test_y).item())
                accuracy = float((logits.argmax(dim=1) == data.test_y).float().mean().item())
        return RankTrainResult(
            rank=env.rank, losses=tuple(losses), step_times=tuple(step_times), loop_s=loop_s,
            accuracy=accuracy, test_loss=test_loss, parameters=count_parameters(model),
            buckets_reduced=state.buckets_reduced if state else 0,
            bytes_reduced=state.bytes_reduced if state else 0)
    finally:
        if comm is not None:
            comm.close()
        dist.destroy_process_group()
