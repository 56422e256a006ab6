"""The training harness of every ``mlfabric train`` mode: allreduce, eager-SGD, tree-allreduce and the PS modes.

(Named ``train/eager.py`` until issue 35: it began as eager-SGD's runs, §6.2.1 and §6.3 --
synchronous vs solo vs majority on local ranks -- and grew to run every mode.)

    mlfabric train --workload hyperplane --workers 8 --sync allreduce,eager-solo \\
        --inject one-random:200ms --inject one-random:300ms --out runs/hyperplane

One launch of ``workers`` ranks (:mod:`mlfabric.bench.procs`) runs every (injection, mode)
pair in turn, so all of them meet the same machine: for each injection, each mode trains a
fresh model from the same seed on the same shards in the same order. Modes:

* ``allreduce``: synchronous SGD, the gradients averaged with mlfabric's regular
  ``comm.allreduce`` every step (Deep500's / Horovod's synch-SGD);
* ``eager-solo`` / ``eager-majority``: :class:`mlfabric.torch.EagerSGD` with quorum solo or
  majority (the model averaged every ``sync_every_epochs`` epochs and once at the end).

Injections (:mod:`mlfabric.emu.stragglers`): ``one-random:300ms`` delays one worker chosen at
random (seeded: the same choice on every rank) by 300 ms every step, §6.2.1's light load
imbalance; ``random:300ms,2`` two workers; ``skew:50ms,50ms,rotate`` §6.2.3's rotating skew;
``none``. The LSTM workload is imbalanced by itself (its sequence lengths follow UCF101's).

Workloads (:mod:`mlfabric.train.workloads`, all synthetic): ``hyperplane`` (MSE), ``lstm``
(accuracy), ``lenet5`` (BML's LeNet-5 on MNIST-shaped images, accuracy; 12.5 MiB of
gradients a step: the one where the network shows), ``mlp`` (an MLP on a random-teacher
10-class classification, accuracy) and ``lda`` (:mod:`mlfabric.train.lda`: distributed LDA by
collapsed Gibbs sampling, MLfabric §7; a step sweeps a batch of the worker's documents and its
word-topic count delta goes through the mode; metric: held-out log-likelihood per token).
Their default batch, lr, momentum and epochs are in :data:`WORKLOAD_DEFAULTS`.

On the emulator (root; :class:`TrainEmulation`, ``--emulate --rate 1gbit [--churn N1]``)
every rank of a launch runs on its own host of an emulated star (``star:n=<ranks of that
launch>``: the workers for the collective modes, servers + workers for the PS modes; one
cluster per launch, torn down after it) with NICs at the rate, under bandwidth churn as
``mlfabric launch --churn`` applies it (:func:`mlfabric.emu.launcher.start_churn`); the run's
metadata records the rate, churn, topologies and churn traces:

    sudo .venv/bin/mlfabric train --workload lenet5 --workers 4 --servers 1 --sync allreduce,ps-bsp,ps-async \
        --epochs 2 --transport tcp --emulate --rate 1gbit --churn N1 --json /tmp/lenet5-emu.json

Measured per run: the training loop's wall time on the slowest rank (the job's), throughput
(steps / that time; every rank takes the same number of steps), the validation metric of
rank 0's model at every epoch boundary against the wall time (MSE for the hyperplane,
accuracy for the classifications; snapshots are evaluated after the loop, so evaluation costs the
training nothing), the final metric after the last model average, and eager-SGD's
statistics (the fraction of steps whose gradient made its round, the mean number of active
ranks). :func:`write_outputs` writes them as CSV (always), TensorBoard scalars (when
``tensorboard`` is installed: ``pip install 'mlfabric[tensorboard]'``) and a PNG (when
matplotlib is: ``pip install 'mlfabric[plot]'``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from mlfabric.bench.procs import LaunchConfig, check_distinct, rank_env, report, run_ranks
from mlfabric.topo.trace import trace_offset_s

from .ps_modes import PS_MODE_FORMS, is_ps_mode, ps_consistency, session_options
from .lda import LdaSpec, LdaTask
from .workloads import Hyperplane, HyperplaneSpec, LeNet5Spec, LeNet5Task, LstmSpec, MlpSpec, MlpTask, SequenceTask

if TYPE_CHECKING:
    import torch
    from rich.table import Table

    from .failover import Failure

__all__ = [
    "MODES", "MODE_FORMS", "render_ps_table", "SYNCHRONOUS", "WORKLOADS", "CurvePoint", "EagerTrainConfig", "EagerTrainResult", "RunResult",
    "TrainEmulation",
    "parse_injection", "render_table", "run_eager_training", "write_outputs",
]

SYNCHRONOUS = "allreduce"  # with --algorithm ring (the default): MLfabric's RR-Sync
TREE_SYNC = "tree-allreduce"  # synchronous SGD over a binary-tree allreduce: MLfabric's Tr-Sync
MODES = (SYNCHRONOUS, TREE_SYNC, "eager-solo", "eager-majority")
#: Every accepted mode spelling (the PS ones take a staleness: ps-ssp:2).
MODE_FORMS = (*MODES, *PS_MODE_FORMS)
#: "Reaching allreduce's final metric": within 5% of its MSE, within 1 point of its accuracy,
#: within 1% of its held-out log-likelihood (LDA: -7.0 nats per token gives a target of -7.07).
TARGET_TOLERANCE = {"mse": 0.05, "accuracy": 0.01, "log-likelihood": 0.01}


def lower_is_better(metric: str) -> bool:
    """The MSE falls as a model learns; accuracy and log-likelihood rise."""
    return metric == "mse"


def target(run: RunResult) -> float:
    """The metric a run must reach to match ``run``'s final one (see :data:`TARGET_TOLERANCE`)."""
    if run.metric == "mse":
        return run.final_metric * (1 + TARGET_TOLERANCE["mse"])
    if run.metric == "log-likelihood":
        return run.final_metric - TARGET_TOLERANCE["log-likelihood"] * abs(run.final_metric)
    return run.final_metric - TARGET_TOLERANCE["accuracy"]
WORKLOADS = ("hyperplane", "lstm", "lenet5", "mlp", "lda")
TASKS = {"hyperplane": Hyperplane, "lstm": SequenceTask, "lenet5": LeNet5Task, "mlp": MlpTask, "lda": LdaTask}
# Per workload: per-worker batch, lr, momentum, epochs, epochs between model averages.
# Hyperplane: eager-SGD Table 1 (8 workers x 256 = 2,048 per step, 48 epochs). Its 32,768
# samples make 16-step epochs, so a model average every 2 epochs is every 32 steps (see
# docs/eager_sgd.md: with 160 steps between averages the models drift apart on a machine
# whose workers share cores). lr 0.05: 0.1 is at the edge of stability with 256-sample
# shards in 8,192 dimensions. LSTM: Table 1's 128 per step (8 x 16), 16 epochs, average every 10.
# LeNet-5 (sized for 4 workers on a 2-core machine, a minute or two): 32 per worker (128 per
# step), lr 0.02 with momentum 0.9 (0.05 spikes the loss in the first 20 steps), 4 epochs of
# 4,096 images = 128 steps; validation accuracy 86% after epoch 1, 97% after 2, 99.9% after 3
# (allreduce, ps-bsp and ps-async alike; each run 20-40 s on 4 local workers over tcp).
# MLP (teacher task): 64 per worker (256 per step), lr 0.1, momentum 0.9, 8 epochs of 32,768
# samples = 1,024 steps (about 10-20 s on 4 local workers); validation accuracy rises fast to
# ~73% by step 125, then slowly to ~77-78% (the student's plateau with this much data).
# LDA: a batch is documents, by default a worker's whole shard (512 of 4,096 documents for 8
# workers), so a step is an iteration of the paper's (a sweep of the shard); lr 1 and no momentum are the
# only values that add the count deltas exactly (mlfabric.train.lda). 40 iterations: the
# held-out log-likelihood is within 0.05 nats of its plateau after about 35 sweeps.
WORKLOAD_DEFAULTS = {
    "hyperplane": {"batch_size": 256, "lr": 0.05, "momentum": 0.0, "epochs": 48, "sync_every_epochs": 2},
    "lstm": {"batch_size": 16, "lr": 0.1, "momentum": 0.9, "epochs": 16, "sync_every_epochs": 10},
    "lenet5": {"batch_size": 32, "lr": 0.02, "momentum": 0.9, "epochs": 4, "sync_every_epochs": 2},
    "mlp": {"batch_size": 64, "lr": 0.1, "momentum": 0.9, "epochs": 8, "sync_every_epochs": 2},
    "lda": {"batch_size": None, "lr": 1.0, "momentum": 0.0, "epochs": 40, "sync_every_epochs": 2},
}
#: What ``--emulate`` without root says.
EMULATE_NEEDS_ROOT = ("--emulate builds an emulated cluster (network namespaces, veth pairs, tc) and needs root "
                      "(or CAP_NET_ADMIN + CAP_SYS_ADMIN): run it as root, or with sudo and the venv's entry point, "
                      "e.g. sudo .venv/bin/mlfabric train ... --emulate")


@dataclass(frozen=True, kw_only=True)
class TrainEmulation:
    """Where ``--emulate`` runs the ranks: each rank of a launch on its own host of an emulated
    star with every NIC at ``rate_bps``; ``churn`` (``N1``/``N2``/``N3`` or ``RATE:PROB,...``)
    redraws every NIC's rates every ``churn_period_s`` seconds (seeded by the run's seed), as
    ``mlfabric launch --churn`` does. The churn traces (capacity-trace CSVs) go to
    ``trace_dir`` (default: a new directory in the temp dir), one per launch. ``ps_topology``
    (``--topology``): the parameter-server launch's topology instead of the star, e.g.
    ``racks:r=2,h=5,oversub=4`` (rank ``r`` on host ``r``: servers first; its host count must
    be servers + workers; MLNET's rack trees read their racks off it)."""

    rate_bps: float = 1e9
    churn: str | None = None
    churn_period_s: float = 5.0
    trace_dir: str | None = None
    ps_topology: str | None = None

    def __post_init__(self) -> None:
        from mlfabric.emu.churn import churn_model

        if not (math.isfinite(self.rate_bps) and self.rate_bps >= 8_000):
            raise ValueError(f"emulated NIC rate must be at least 8 kbit/s, got {self.rate_bps} bit/s")
        if not (math.isfinite(self.churn_period_s) and self.churn_period_s > 0):
            raise ValueError(f"churn period must be a positive number of seconds, got {self.churn_period_s}")
        if self.churn is not None:
            churn_model(self.churn)  # raises with the accepted spellings
        if self.ps_topology is not None:
            from mlfabric.topo import TopologySpec

            object.__setattr__(self, "ps_topology", str(TopologySpec.parse(self.ps_topology)))  # raises if bad

    @staticmethod
    def topology(ranks: int) -> str:
        """The emulated star of a launch of ``ranks`` ranks."""
        return f"star:n={ranks}"

    def launch_topology(self, ranks: int, ps: bool) -> str:
        """The parameter-server launch's ``ps_topology`` if given, else the star."""
        if not ps or self.ps_topology is None:
            return self.topology(ranks)
        from mlfabric.topo import parse_topology

        hosts = parse_topology(self.ps_topology, self.rate_bps).n_hosts
        if hosts != ranks:
            raise ValueError(f"--topology {self.ps_topology} has {hosts} hosts, but the parameter-server launch has "
                             f"{ranks} ranks (servers + replicas + workers), one per host")
        return self.ps_topology


def parse_injection(text: str) -> Any:
    """``one-random:DELAY`` (one worker per step, eager-SGD §6.2.1), or any spelling of
    :func:`mlfabric.emu.stragglers.imbalance_model` (``random:DELAY[,COUNT]``,
    ``skew:FIRST[,STEP][,rotate]``, ``C1``..., ``none``). None means no injection."""
    from mlfabric.emu.stragglers import RandomDelay, imbalance_model
    from mlfabric.units import parse_duration

    key = text.strip()
    if key.lower().startswith("one-random:"):
        return RandomDelay(delay_s=parse_duration(key.split(":", 1)[1]), count=1)
    return imbalance_model(key)


class StepDelay:
    """One worker's injected delay per step, from an injection spelling (:func:`parse_injection`).

    Absolute models (``one-random:300ms``, ``random:...``, ``skew:...``) give seconds.
    MLfabric's C1-C3 (and ``probability,slowdown``) are slowdowns: a straggling step takes
    ``slowdown`` times its own compute, so its delay is ``(slowdown - 1) x`` the compute time
    the caller measured for that step (without this the presets would add nothing: the
    workloads have no fixed compute time to scale)."""

    def __init__(self, inject: str, worker: int, workers: int, *, seed: int) -> None:
        from mlfabric.emu.stragglers import ImbalanceInjector, StragglerModel

        model = parse_injection(inject)
        self.relative = isinstance(model, StragglerModel)
        self._injector = (ImbalanceInjector(model, worker, workers, seed=seed, compute_s=1.0 if self.relative else 0.0)
                          if model is not None else None)

    def __call__(self, compute_s: float) -> float:
        if self._injector is None:
            return 0.0
        delay = self._injector.delay()
        return delay * compute_s if self.relative else delay


@dataclass(frozen=True, kw_only=True)
class EagerTrainConfig:
    """The runs: every mode under every injection. ``None`` picks the workload's default."""

    workload: str = "hyperplane"
    workers: int = 8
    modes: tuple[str, ...] = (SYNCHRONOUS, "eager-solo")
    injects: tuple[str, ...] = ("none",)
    epochs: int | None = None
    batch_size: int | None = None  # per worker
    lr: float | None = None
    momentum: float | None = None
    sync_every_epochs: int | None = None
    algorithm: str = "ring"
    hyperplane: HyperplaneSpec = field(default_factory=HyperplaneSpec)
    lstm: LstmSpec = field(default_factory=LstmSpec)
    lenet5: LeNet5Spec = field(default_factory=LeNet5Spec)
    mlp: MlpSpec = field(default_factory=MlpSpec)
    lda: LdaSpec = field(default_factory=LdaSpec)
    transport: str = "tcp"
    timeout_s: float = 3_600.0
    seed: int = 0
    #: Parameter-server modes: server and replica processes (ranks of their own, beside the
    #: workers; replica i mirrors server i % servers) and ps-async's delay bound (None: unbounded).
    servers: int = 1
    replicas: int = 0
    delay_bound: int | None = None
    #: How replicas are fed: "chain" (the server forwards each update) or, for mlfabric-a modes,
    #: "network" (MLfabric §5.3, within Div_max ``div_max``: a norm, or "Nu" updates).
    replication: str = "chain"
    div_max: str | None = None
    #: mlfabric-a with replicas: the servers send their model at every batch end so that the
    #: replicas measure their divergence (max_divergence); off for overhead measurements.
    measure_divergence: bool = True
    #: PS modes: each server checkpoints its shard to a local file every N versions (0: never;
    #: MLfabric §7.3's baseline for replication), in a temporary directory removed after the run.
    checkpoint_every: int = 0
    #: ``"server:AT"``: server 0's process is SIGKILLed AT seconds into the (one) PS run and its
    #: replica takes over (:mod:`mlfabric.train.failover`: failover_s, lost_divergence, ...).
    fail: str | None = None
    #: #36: co-located workers per host (local runs: ranks grouped into hosts; emulated: that
    #: many worker ranks per emulated host, servers on hosts of their own). MLfabric-A/-S sum a
    #: host's updates there and pull the model once per host; RR-Sync (allreduce) goes
    #: host-hierarchical (reduce in the host, ring across hosts).
    workers_per_host: int = 1
    #: #36: MLfabric-A/-S aggregate down pipelined multi-level trees and multicast the model
    #: (ScheduledSettings.trees); False: Alg. 3 and §10.3 at one level.
    trees: bool = False
    #: None: local ranks on loopback; otherwise every rank on a host of an emulated star (root).
    emulation: TrainEmulation | None = None
    #: The metric every run's time to target is measured at (MLfabric's Table 2: time to a
    #: target accuracy). None: allreduce's final metric, less the tolerance of TARGET_TOLERANCE.
    target: float | None = None

    def _check_replication(self) -> None:
        from mlfabric.ps.divergence import DivergenceBound
        from mlfabric.ps.policies.scheduled.settings import REPLICATION_MODES

        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {', '.join(REPLICATION_MODES)}, got {self.replication!r}")
        if self.div_max is not None:
            DivergenceBound.parse(self.div_max)  # a clear error for 0, -1, nan, 0u, words
            if self.replication != "network":
                raise ValueError("--div-max bounds network replication: add --replication network")
        if self.replication == "network":
            if self.replicas < 1:
                raise ValueError("--replication network needs --replicas 1 or more")
            if self.div_max is None:
                raise ValueError("--replication network needs --div-max X (a norm such as 0.5, or updates such as 30u)")
            if not any(m.startswith("mlfabric-a:") for m in self.modes):
                raise ValueError("--replication network is scheduled by MLfabric's scheduler: run a mlfabric-a:TAU "
                                 "mode (the other PS modes replicate by chain)")

    def _check_failure(self) -> None:
        if self.fail is None:
            return
        from mlfabric.ps import PSConfig, PSLayout
        from mlfabric.ps.failover import failover_refusal

        failure = self.failure
        assert failure is not None
        ps_runs = [mode for _, mode in self.runs() if is_ps_mode(mode)]
        if len(ps_runs) != 1:
            raise ValueError(f"--fail {self.fail} kills a process for good: run exactly one parameter-server mode with "
                             f"one --inject (got {len(ps_runs)} PS runs); run the unfailed baseline as its own command")
        if failure.role == "aggregator":
            if not ps_runs[0].startswith("mlnet-"):
                raise ValueError(f"--fail {self.fail} kills an interior node of an mlnet tree: run an mlnet mode "
                                 f"(got {ps_runs[0]})")
            return
        if self.replicas < 1:
            raise ValueError(f"--fail {self.fail} needs --replicas 1 or more (a replica takes over the killed server)")
        options = session_options(ps_runs[0], self.delay_bound, replicas=self.replicas, replication=self.replication,
                                  div_max=self.div_max)
        refusal = failover_refusal(PSConfig(**options), PSLayout(servers=self.servers, replicas=self.replicas,
                                                                 workers=self.workers))
        if refusal is not None:
            raise ValueError(f"--fail {self.fail} with {ps_runs[0]}: no failover there ({refusal})")

    def host_placement(self, world: int, ps: bool) -> list[int]:
        """The emulated host of every rank of a launch of ``world`` ranks: the servers' and
        replicas' (PS launch) one each, then ``workers_per_host`` workers to a host."""
        first = self.ps_ranks if ps else 0
        return list(range(first)) + [first + (r - first) // self.workers_per_host for r in range(first, world)]

    @property
    def failure(self) -> "Failure | None":
        """``fail`` parsed (:class:`mlfabric.train.failover.Failure`), None without one."""
        from .failover import Failure

        return None if self.fail is None else Failure.parse(self.fail)

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.collectives import ALLREDUCE_ALGORITHMS

        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.workers < 1:
            raise ValueError(f"need at least one worker, got {self.workers}")
        if self.workers_per_host < 1 or self.workers % self.workers_per_host:
            raise ValueError(f"--workers ({self.workers}) must be a multiple of --workers-per-host "
                             f"({self.workers_per_host}, at least 1)")
        check_distinct(self.modes, "modes")
        for mode in self.modes:
            if is_ps_mode(mode):
                ps_consistency(mode, self.delay_bound)  # raises with the accepted forms
            elif mode not in MODES:
                raise ValueError(f"unknown sync mode {mode!r}; choose from {', '.join(MODE_FORMS)}")
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 versions (0: never), got {self.checkpoint_every}")
        self._check_replication()
        self._check_failure()
        if self.delay_bound is not None and self.delay_bound < 0:
            raise ValueError(f"delay_bound must be >= 0, got {self.delay_bound}")
        check_distinct(self.injects, "injections")
        for inject in self.injects:
            model = parse_injection(inject)
            if model is not None and hasattr(model, "count") and model.count > self.workers:
                raise ValueError(f"injection {inject!r} delays more workers than the {self.workers} there are")
        if self.epochs_ < 1 or self.batch_size_ < 1 or not self.lr_ > 0 or not self.momentum_ >= 0:
            raise ValueError("epochs, batch size and lr must be positive, momentum >= 0")
        if self.workload == "lda":  # its steps add count deltas (mlfabric.train.lda): nothing to tune or average
            if self.lr_ != 1.0 or self.momentum_ != 0.0:
                raise ValueError(f"the lda workload adds the workers' count deltas exactly: lr must be 1 and momentum "
                                 f"0 (got lr {self.lr_}, momentum {self.momentum_}); leave --lr/--momentum out")
            eager = [mode for mode in self.modes if mode.startswith("eager-")]
            if eager:
                raise ValueError(f"the lda workload cannot run {', '.join(eager)}: eager-SGD averages stale or missing "
                                 "gradients, which would scale count deltas; use allreduce, tree-allreduce or a "
                                 "parameter-server mode")
        if self.sync_every_epochs_ < 0:
            raise ValueError(f"sync_every_epochs must be >= 0 (0: only at the end), got {self.sync_every_epochs}")
        if self.algorithm not in ALLREDUCE_ALGORITHMS or self.algorithm in ("bcube", "hierarchical"):
            raise ValueError(f"algorithm must be ring, halving_doubling, tree or ps, got {self.algorithm!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.target is not None and not math.isfinite(self.target):
            raise ValueError(f"target must be a finite metric value, got {self.target}")
        specs = {"hyperplane": (self.hyperplane, HyperplaneSpec), "lstm": (self.lstm, LstmSpec),
                 "lenet5": (self.lenet5, LeNet5Spec), "mlp": (self.mlp, MlpSpec), "lda": (self.lda, LdaSpec)}
        for name, (spec, kind) in specs.items():
            if not isinstance(spec, kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {type(spec).__name__}")
        if self.emulation is not None and not isinstance(self.emulation, TrainEmulation):
            raise ValueError(f"emulation must be a TrainEmulation or None, got {type(self.emulation).__name__}")
        if self.steps_per_epoch < 1:
            raise ValueError(f"{self.train_samples} training samples over {self.workers} workers give less than "
                             f"one batch of {self.batch_size_} per worker; raise the training set")

    # Resolved settings (the workload's defaults where None).
    def _setting(self, name: str) -> Any:
        value = getattr(self, name)
        return value if value is not None else WORKLOAD_DEFAULTS[self.workload][name]

    @property
    def epochs_(self) -> int:
        return int(self._setting("epochs"))

    @property
    def batch_size_(self) -> int:
        batch = self._setting("batch_size")
        # None (lda): the worker's whole shard, so that a step is a sweep of it.
        return int(batch) if batch is not None else max(1, self.train_samples // self.workers)

    @property
    def lr_(self) -> float:
        return float(self._setting("lr"))

    @property
    def momentum_(self) -> float:
        return float(self._setting("momentum"))

    @property
    def sync_every_epochs_(self) -> int:
        return int(self._setting("sync_every_epochs"))

    @property
    def spec(self) -> HyperplaneSpec | LstmSpec | LeNet5Spec | MlpSpec | LdaSpec:
        """The selected workload's task spec."""
        return getattr(self, self.workload)

    @property
    def train_samples(self) -> int:
        return self.spec.train_samples

    @property
    def metric(self) -> str:
        """``"mse"`` (lower is better), ``"accuracy"`` or ``"log-likelihood"`` (lda)."""
        return TASKS[self.workload].metric

    @property
    def ps_ranks(self) -> int:
        """Ranks before the workers in the parameter-server launch: servers, then replicas."""
        return self.servers + self.replicas

    @property
    def steps_per_epoch(self) -> int:
        return (self.train_samples // self.workers) // self.batch_size_

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs_

    def runs(self) -> list[tuple[str, str]]:
        """(injection, mode) in the order they are reported."""
        return [(inject, mode) for inject in self.injects for mode in self.modes]

    def launches(self) -> list[bool]:
        """One launch for the collective modes (the workers only), one for the parameter-server
        modes (servers + workers): False / True, for those present."""
        kinds = {is_ps_mode(mode) for mode in self.modes}
        return [kind for kind in (False, True) if kind in kinds]

    def task(self) -> Hyperplane | SequenceTask | LeNet5Task | MlpTask | LdaTask:
        return TASKS[self.workload](self.spec, self.seed)


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    epoch: int
    step: int
    wall_s: float            # since the start of the run's training loop, the last rank to get there
    train_loss: float        # mean minibatch loss of the epoch, over ranks
    val_loss: float          # of the ranks' average model at this epoch boundary
    val_metric: float        # MSE (hyperplane) or accuracy (the others) of the ranks' average model
    val_metric_rank0: float  # the same for rank 0's own model (eager-SGD's drift from the average)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    inject: str
    mode: str
    metric: str               # "mse" (lower is better), "accuracy" or "log-likelihood"
    steps: int                # per rank
    loop_s: float             # the slowest rank's training loop
    per_rank_loop_s: tuple[float, ...]
    curve: tuple[CurvePoint, ...]
    final_val_loss: float     # after the last model average
    final_metric: float
    mean_active: float | None          # eager only: mean over ranks and steps
    contributed_fraction: float | None
    rounds_skipped: float | None       # mean over ranks
    injected_s: float                  # mean over ranks of the injected delay
    samples_per_step: int              # over all workers
    #: Parameter-server modes only (ps_modes.summarize): max_delay, mean_delay, dropped,
    #: updates_applied, delay_histogram, pull latency, bytes per server NIC, ...
    ps: dict[str, Any] | None = None
    #: Emulated under churn: seconds from the launch's churn start to the run's loop start.
    #: The runs of one launch follow each other under one churn, so each meets its own part of
    #: the launch's capacity trace (``simulate mlfabric --emulated`` replays that part).
    churn_offset_s: float | None = None
    #: A worker step's compute as measured over every worker's steps (forward, backward, the
    #: emulated device time; the injected straggler delay left out): :func:`compute_summary`'s
    #: ``mean``, ``cv``, ``steps`` and ``slowest_mean``. ``simulate mlfabric --emulated``
    #: takes the simulator's compute from it (docs/simulator.md, "Compute spread").
    compute_s: dict[str, float] | None = None
    #: A worker step's exchange (``trainer.step()``): mean ``wall`` seconds and the training
    #: thread's own ``cpu`` seconds in it (the rest it waited: network, peers, scheduler).
    exchange_s: dict[str, float] | None = None

    @property
    def label(self) -> str:
        return f"{self.mode} [{self.inject}]"

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.loop_s

    @property
    def samples_per_s(self) -> float:
        return self.steps_per_s * self.samples_per_step

    def time_to(self, target: float) -> float | None:
        """Wall time of the first epoch boundary whose metric reaches ``target`` (None if never):
        at most ``target`` for the MSE, at least for the accuracy and the log-likelihood."""
        point = self._reaching(target)
        return None if point is None else point.wall_s

    def steps_to(self, target: float) -> int | None:
        """Iterations (per-worker steps) up to the first epoch boundary that reaches ``target``
        (None if never). Asynchronous PS modes end an epoch when the servers have applied
        workers x steps-per-epoch worker updates, so there it is worker updates applied / workers."""
        point = self._reaching(target)
        return None if point is None else point.step

    def _reaching(self, target: float) -> CurvePoint | None:
        lower = lower_is_better(self.metric)
        return next((p for p in self.curve if (p.val_metric <= target if lower else p.val_metric >= target)), None)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(data.pop("ps") or {})
        data.update({"label": self.label, "steps_per_s": self.steps_per_s, "samples_per_s": self.samples_per_s,
                     "curve": [dataclasses.asdict(p) for p in self.curve],
                     "per_rank_loop_s": list(self.per_rank_loop_s)})
        return data


@dataclass(frozen=True, kw_only=True)
class EagerTrainResult:
    config: EagerTrainConfig
    runs: tuple[RunResult, ...]
    startup_s: float
    wall_s: float
    metadata: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def get(self, mode: str, inject: str | None = None) -> RunResult:
        for run in self.runs:
            if run.mode == mode and (inject is None or run.inject == inject):
                return run
        raise KeyError(f"no run of {mode} with injection {inject}")

    def target(self, inject: str) -> float:
        """The metric the runs under ``inject`` are timed to: the configured target, or near
        allreduce's final metric (within :data:`TARGET_TOLERANCE` of it, since one validation
        point is noisy). KeyError when neither is known."""
        if self.config.target is not None:
            return self.config.target
        return target(self.get(SYNCHRONOUS, inject))

    def comparisons(self) -> list[dict[str, Any]]:
        """Per (injection, mode other than allreduce): throughput and metric relative to
        ``allreduce``, the wall time both take to reach :meth:`target`, and ``time_speedup``,
        allreduce's time to it over the mode's (MLfabric's Table 2; None if either never got
        there)."""
        out = []
        for inject in self.config.injects:
            try:
                base = self.get(SYNCHRONOUS, inject)
            except KeyError:
                continue
            goal = self.target(inject)
            for run in self.runs:
                if run.inject != inject or run.mode == SYNCHRONOUS:
                    continue
                reach, sync_reach = run.time_to(goal), base.time_to(goal)
                steps, sync_steps = run.steps_to(goal), base.steps_to(goal)
                out.append({
                    "inject": inject, "mode": run.mode, "speedup": run.steps_per_s / base.steps_per_s,
                    "metric": run.metric, "final_metric": run.final_metric, "sync_final_metric": base.final_metric,
                    "metric_ratio": run.final_metric / base.final_metric if base.final_metric else math.nan,
                    "metric_gap": base.final_metric - run.final_metric,
                    "target": goal, "time_to_target_s": reach, "sync_time_to_target_s": sync_reach,
                    "time_speedup": sync_reach / reach if reach and sync_reach else None,
                    "iterations_to_target": steps, "sync_iterations_to_target": sync_steps,
                    "sync_loop_s": base.loop_s,
                })
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "eager-sgd-train",
            "metadata": self.metadata,
            "config": {**dataclasses.asdict(self.config), "modes": list(self.config.modes),
                       "injects": list(self.config.injects), "epochs": self.config.epochs_,
                       "batch_size": self.config.batch_size_, "lr": self.config.lr_,
                       "momentum": self.config.momentum_, "steps": self.config.steps,
                       "sync_every_epochs": self.config.sync_every_epochs_},
            "units": {"time": "s", "speedup": "steps/s over allreduce's in the same launch",
                      "metric": "mse (hyperplane), accuracy (lstm, lenet5, mlp) or held-out log-likelihood per "
                                "token (lda), on the validation set",
                      "iterations": "per-worker steps (async PS: worker updates applied / workers)"},
            "startup_s": self.startup_s, "wall_s": self.wall_s,
            "runs": [run.to_dict() for run in self.runs],
            "comparisons": self.comparisons(),
            "files": self.files,
        }


# --------------------------------------------------------------------------- inside a rank


class _AllreduceSGD:
    """Synchronous data-parallel SGD: average the flat gradient with ``comm.allreduce``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, comm: Any, algorithm: str) -> None:
        import torch

        self.optimizer, self.comm, self.algorithm = optimizer, comm, algorithm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in self.params))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        self.comm.allreduce(self.flat, algorithm=self.algorithm, op="avg")
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(self.flat[offset:offset + n].view_as(p))
            offset += n
        self.optimizer.step()

    def epoch_end(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass  # every rank applied the same averages: the models are equal already


@dataclass(frozen=True, kw_only=True)
class _RankRun:
    loop_s: float
    injected_s: float
    curve: tuple[CurvePoint, ...]   # rank 0 only
    final: tuple[float, float]      # (val loss, metric), rank 0 only
    stats: dict[str, Any] | None    # EagerSGD statistics
    ps_server: dict[str, Any] | None = None  # a PS server's statistics
    ps_worker: dict[str, Any] | None = None  # a PS worker's statistics
    is_worker: bool = True
    #: Seconds from its launch's churn start (the capacity trace's time 0) to this worker's
    #: loop start; None without churn.
    churn_offset_s: float | None = None
    compute_steps_s: tuple[float, ...] = ()  # this worker's measured compute per step
    exchange_steps_s: tuple[tuple[float, float], ...] = ()  # its exchanges: (wall, thread CPU) seconds
    #: A run whose server is killed (``--fail``): no collective over every rank at its end;
    #: each rank hands its part to the parent, which evaluates (:func:`_evaluate_in_parent`).
    parts: "_RunParts | None" = None


@dataclass(frozen=True, kw_only=True)
class _RunParts:
    snapshots: Any            # epochs x numel, a worker's model at each epoch end (None: a server)
    walls: Any                # float64 per epoch
    train_losses: Any         # float64 per epoch
    final_flat: Any           # this rank's part of the final model (None: none)


def _rank_main(config: EagerTrainConfig, launched_at: float, ps: bool = False,
               fault_dir: str | None = None) -> tuple[float, list[_RankRun]]:
    """One rank of a launch: the collective modes' (``ps=False``: every rank a worker) or the
    parameter-server modes' (``ps=True``: ranks 0..servers-1 serve, the rest are workers).
    ``fault_dir``: server 0 is killed in the PS run (``config.fail``), its record goes there."""
    import torch

    import mlfabric

    env = rank_env()
    torch.set_num_threads(1)
    job = None
    if ps:
        import mlfabric.ps

        job = mlfabric.ps.init(servers=config.servers, replicas=config.replicas, transport=config.transport,
                               timeout=min(config.timeout_s, 120.0), seed=config.seed,
                               # --fail: the killed process is not coming back; BSP goes on 2 s after
                               lost_worker_wait_s=2.0 if fault_dir is not None else None)
        comm = job.comm
    else:
        comm = mlfabric.init(transport=config.transport, timeout=config.timeout_s)
    try:
        task = config.task()
        worker = env.rank - (config.ps_ranks if ps else 0)
        x, y = task.shard(worker, config.workers) if worker >= 0 else (None, None)
        val = task.val() if env.rank == 0 else None
        comm.barrier()
        startup = time.time() - launched_at
        runs = []
        selected = [(i, run) for i, run in enumerate(config.runs()) if is_ps_mode(run[1]) == ps]
        for done, (index, (inject, mode)) in enumerate(selected):
            runs.append(_train_one(config, comm, task, x, y, val, inject, mode, index, env.rank, ps_job=job,
                                   fault_dir=fault_dir))
            if env.rank == 0:
                report({"run": done + 1, "runs": len(selected), "ps": ps})
        if fault_dir is None:  # with a server killed, the ranks end apart
            comm.barrier()
        return startup, runs
    finally:
        comm.close()


def _train_one(config: EagerTrainConfig, comm: Any, task: Any, x: Any, y: Any, val: Any, inject: str,
               mode: str, index: int, rank: int, *, ps_job: Any = None, fault_dir: str | None = None) -> _RankRun:
    import torch

    from mlfabric.torch import EagerSGD, PSOptimizer

    from .ps_modes import serve_run

    torch.manual_seed(config.seed)  # the same initial model on every rank and in every run
    model = task.model()
    numel = sum(p.numel() for p in model.parameters())

    def make_optimizer() -> torch.optim.Optimizer:
        # Workers only, after the servers' branch: a server or replica has no use for one, and
        # the first optimizer a process builds imports torch._dynamo (~1.3 s of CPU idle, several
        # seconds on a loaded 2-core machine), which every server and replica paid for nothing.
        return torch.optim.SGD(model.parameters(), lr=config.lr_, momentum=config.momentum_)

    ps_server: dict[str, Any] | None = None
    final_flat = None  # PS modes: this rank's part of the servers' final model
    if is_ps_mode(mode):
        from mlfabric.runtime.fair_share import nic_rates_from

        rates = nic_rates_from(None, comm.transport.channels)  # MLFABRIC_NIC_RATE (the emulator's)
        checkpoints = None
        if config.checkpoint_every and ps_job.role != "worker":
            import tempfile

            checkpoints = tempfile.mkdtemp(prefix="mlfabric-checkpoints-")
        session = ps_job.session(index + 1, **session_options(mode, config.delay_bound,
                                                              rates.get(comm.transport.channels[0]),
                                                              replicas=config.replicas,
                                                              replication=config.replication,
                                                              div_max=config.div_max,
                                                              measure_divergence=config.measure_divergence,
                                                              workers_per_host=config.workers_per_host,
                                                              trees=config.trees),
                                 **({"checkpoint_every": config.checkpoint_every, "checkpoint_dir": checkpoints}
                                    if checkpoints else {}))
        if session.role != "worker":
            rule = getattr(task, "server_update_rule", None)  # lda: counts add up (mlfabric.train.lda)
            if rule is not None:
                (session.server or session.replica).register_update_callback(rule(config.workers), "model")
            try:
                failure = config.failure
                kill = ((failure.at_s, fault_dir) if fault_dir is not None and failure is not None
                        and failure.role == "server" and rank == 0 else None)  # rank 0: server 0
                # joins the start barrier
                ps_server, final_flat = serve_run(session, numel, torch.float32, kill=kill)
            finally:
                if checkpoints is not None:
                    import shutil

                    shutil.rmtree(checkpoints, ignore_errors=True)
            return _finish_run(config, comm, task, model, val, rank, numel, snapshots=None, walls=None,
                               train_losses=None, loop_s=0.0, injected=0.0, stats=None, ps_server=ps_server,
                               final_flat=final_flat, apart=fault_dir is not None)
        trainer: Any = PSOptimizer(make_optimizer(), model, session.worker,
                                   keep_dropped=getattr(task, "keep_dropped_updates", False))
        final_flat = torch.zeros(numel)
    elif mode in (SYNCHRONOUS, TREE_SYNC):
        algorithm = "tree" if mode == TREE_SYNC else config.algorithm
        if config.workers_per_host > 1 and mode == SYNCHRONOUS:
            # RR-Sync with co-located workers: reduce in each host, the ring across hosts.
            # Local ranks share one machine: the hosts are the harness's grouping of them.
            if config.emulation is None:
                comm.hosts = tuple(r // config.workers_per_host for r in range(comm.world_size))
            algorithm = "host_hierarchical"
        trainer = _AllreduceSGD(make_optimizer(), model, comm, algorithm)
    else:
        # A seed per run gives each run its own persistent collective (nothing carries over).
        trainer = EagerSGD(make_optimizer(), model, comm, quorum=mode.removeprefix("eager-"),
                           sync_every_epochs=config.sync_every_epochs_, algorithm=config.algorithm,
                           seed=config.seed * 1_000 + index)
    worker = rank - (config.ps_ranks if ps_job is not None else 0)
    kill_at = _aggregator_kill_at(config, trainer, worker) if fault_dir is not None else None
    comm.barrier()
    loop = train_steps(config, task, model, trainer, x, y, worker=worker, inject=inject, kill_at=kill_at,
                       fault_dir=fault_dir)
    snapshots, walls, train_losses = loop.snapshots, loop.walls, loop.train_losses
    injected, loop_s, churn_offset = loop.injected, loop.loop_s, loop.churn_offset_s
    compute_steps, exchange_steps = tuple(loop.compute_steps_s), tuple(loop.exchange_steps_s)
    ps_worker = None
    if isinstance(trainer, PSOptimizer):
        ps_worker = {**trainer.stats.as_dict(), "failovers": trainer.worker.failovers}
        trainer.leave()
        ps_worker.update(trainer.worker.routing.worker_report() or {})  # mlnet: its tree node's figures
    else:
        trainer.synchronize()
    stats = trainer.stats.as_dict() if isinstance(trainer, EagerSGD) else None
    return _finish_run(config, comm, task, model, val, rank, numel, snapshots=torch.stack(snapshots), walls=walls,
                       train_losses=train_losses, loop_s=loop_s, injected=injected, stats=stats,
                       ps_worker=ps_worker, final_flat=final_flat, apart=fault_dir is not None,
                       churn_offset_s=churn_offset, compute_steps_s=compute_steps,
                       exchange_steps_s=exchange_steps)


@dataclass(frozen=True, kw_only=True)
class LoopResult:
    """What :func:`train_steps` measured, per epoch it ran (``first_epoch`` on)."""

    first_epoch: int
    steps: int                      # this worker's steps
    walls: list[float]              # since the loop's start, at each epoch end
    snapshots: list[Any]            # the worker's model (flat) at each epoch end
    train_losses: list[float]       # mean minibatch loss of each epoch
    injected: float                 # seconds of injected delay
    loop_s: float
    churn_offset_s: float | None    # where the loop starts in its launch's churn (emulated, churned)
    compute_steps_s: list[float]    # each step's compute (forward, backward, device time; no injection)
    #: each step's exchange (``trainer.step()``: push and pull, or the allreduce): wall seconds
    #: and the training thread's own CPU seconds in it
    exchange_steps_s: list[tuple[float, float]]


def train_steps(config: EagerTrainConfig, task: Any, model: Any, trainer: Any, x: Any, y: Any, *, worker: int,
                inject: str, first_step: int = 0, kill_at: float | None = None,
                fault_dir: str | None = None) -> LoopResult:
    """One worker's training loop, every mode's (``trainer``: allreduce, EagerSGD or
    PSOptimizer): per step a minibatch of its shard in its seeded order, the loss, the
    injected delay and the emulated device time, ``trainer.step()``; per epoch the trainer's
    epoch end and a snapshot of the model. ``first_step`` (a restarted PS worker,
    :mod:`mlfabric.train.ps_rejoin`): go on from that global step -- its epoch and batch
    order as a worker that never stopped would have them; under async, from the epoch the
    servers' version is in. ``kill_at`` (``--fail aggregator:AT``): this worker crashes that
    many seconds into the loop, recorded in ``fault_dir``."""
    import torch

    from mlfabric.torch import PSOptimizer

    injector = StepDelay(inject, worker, config.workers, seed=config.seed)
    order = torch.Generator().manual_seed(config.seed * 1_000_003 + worker)  # same batches in every run
    n = y.shape[0]
    batch = config.batch_size_
    per_epoch = config.steps_per_epoch
    snapshots: list[torch.Tensor] = []
    walls: list[float] = []
    train_losses: list[float] = []
    injected = 0.0
    # ps-async: an epoch ends when the servers have applied as many worker gradients as
    # synchronous SGD computes in one (workers x steps per epoch), not after a fixed number of
    # this worker's steps: a fast worker takes more steps than a slow one, as in any
    # asynchronous PS, and the model is not left to the slowest worker's shard alone at the end.
    budget = None
    if isinstance(trainer, PSOptimizer) and trainer.worker.config.consistency.kind == "async":
        budget = per_epoch * config.workers
    # The batch order of a worker that has taken first_step steps: one permutation per pass.
    perm = torch.randperm(n, generator=order)
    for _ in range(first_step // per_epoch):
        perm = torch.randperm(n, generator=order)
    cursor = first_step % per_epoch
    if budget is not None:
        first_epoch = min(config.epochs_, trainer.worker.versions[trainer.name][0] // budget) if first_step else 0
        skip = 0
    else:
        first_epoch, skip = divmod(first_step, per_epoch)
    steps = 0
    compute_steps: list[float] = []
    exchange_steps: list[tuple[float, float]] = []
    start = time.perf_counter()
    churn_offset = trace_offset_s()  # where this run starts in its launch's churn (emulated, churned)
    for epoch in range(first_epoch, config.epochs_):
        losses = []
        i = skip if epoch == first_epoch else 0
        while (i < per_epoch if budget is None
               else trainer.worker.versions[trainer.name][0] < (epoch + 1) * budget):
            if cursor == per_epoch:  # a pass over this worker's shard is done
                perm, cursor = torch.randperm(n, generator=order), 0
            picked = perm[cursor * batch:(cursor + 1) * batch]
            cursor += 1
            i += 1
            if kill_at is not None and time.perf_counter() - start >= kill_at:
                from .failover import kill_worker

                kill_worker(str(fault_dir), worker)  # --fail aggregator:AT: this interior tree node dies
            computed = time.perf_counter()
            xb = task.batch(x, picked)
            trainer.zero_grad()
            loss = task.loss(model, xb, y[picked])
            loss.backward()
            device = task.device_time(xb)
            delay = injector(time.perf_counter() - computed + device)
            pause = delay + device
            if pause > 0:
                time.sleep(pause)
            compute_steps.append(time.perf_counter() - computed - delay)
            injected += delay
            exchange_wall, exchange_cpu = time.perf_counter(), time.thread_time()
            trainer.step()
            exchange_steps.append((time.perf_counter() - exchange_wall, time.thread_time() - exchange_cpu))
            steps += 1
            losses.append(float(loss.detach()))
        trainer.epoch_end()
        walls.append(time.perf_counter() - start)
        snapshots.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
        train_losses.append(statistics.fmean(losses) if losses else math.nan)
    return LoopResult(first_epoch=first_epoch, steps=steps, walls=walls, snapshots=snapshots,
                      train_losses=train_losses, injected=injected, loop_s=time.perf_counter() - start,
                      churn_offset_s=churn_offset, compute_steps_s=compute_steps, exchange_steps_s=exchange_steps)


def _aggregator_kill_at(config: EagerTrainConfig, trainer: Any, worker: int) -> float | None:
    """``--fail aggregator:AT``: AT if this worker is the interior tree node to kill, else None."""
    from mlfabric.torch import PSOptimizer

    from .failover import aggregator_victim

    failure = config.failure
    if failure is None or failure.role != "aggregator" or not isinstance(trainer, PSOptimizer):
        return None
    layout = trainer.worker.layout
    parents = trainer.worker.routing.tree_parents(layout.workers, layout.servers, list(layout.worker_ranks))
    if parents is None:  # a policy without trees has no interior node to kill
        return None
    return failure.at_s if aggregator_victim(parents) == worker else None


def compute_summary(per_worker: Sequence[Sequence[float]]) -> dict[str, float] | None:
    """Measured step computes of every worker (one sequence each, in step order):
    ``{"mean": seconds, "cv": standard deviation / mean, "steps": n, "slowest_mean": the mean
    over step indices of the slowest worker's}`` -- what a synchronous iteration waits for
    (in the asynchronous modes the same index is not the same moment). None without steps."""
    steps = [t for worker in per_worker for t in worker]
    if not steps:
        return None
    mean = statistics.fmean(steps)
    cv = statistics.pstdev(steps) / mean if mean > 0 else 0.0
    common = min(len(worker) for worker in per_worker)
    slowest = statistics.fmean(max(worker[i] for worker in per_worker) for i in range(common)) if common else mean
    return {"mean": mean, "cv": cv, "steps": len(steps), "slowest_mean": slowest}


def exchange_summary(steps: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """``{"wall": mean seconds, "cpu": mean thread CPU seconds}`` of measured exchanges."""
    if not steps:
        return None
    return {"wall": statistics.fmean(w for w, _ in steps), "cpu": statistics.fmean(c for _, c in steps)}


def _finish_run(config: EagerTrainConfig, comm: Any, task: Any, model: Any, val: Any, rank: int, numel: int, *,
                snapshots: Any, walls: list[float] | None, train_losses: list[float] | None, loop_s: float,
                injected: float, stats: dict[str, Any] | None, ps_server: dict[str, Any] | None = None,
                ps_worker: dict[str, Any] | None = None, final_flat: Any = None, apart: bool = False,
                churn_offset_s: float | None = None, compute_steps_s: tuple[float, ...] = (),
                exchange_steps_s: tuple[tuple[float, float], ...] = ()) -> _RankRun:
    """The curve: at every epoch boundary, the average of the workers' models (what a model
    synchronization there would give; the same as each rank's for allreduce) and rank 0's own.
    Every rank of the launch takes part; servers contribute zeros (and their shard of the
    final model, which in the PS modes is what is evaluated). ``apart`` (a server was killed):
    no collective; the rank's parts go to the parent, which does the same sums."""
    import torch

    epochs = config.epochs_
    is_worker = snapshots is not None
    local = snapshots if is_worker else torch.zeros(epochs, numel)
    walls_t = torch.tensor(walls if walls is not None else [0.0] * epochs, dtype=torch.float64)
    losses_t = torch.tensor(train_losses if train_losses is not None else [0.0] * epochs, dtype=torch.float64)
    if apart:
        return _RankRun(loop_s=loop_s, injected_s=injected, curve=(), final=(math.nan, math.nan), stats=stats,
                        ps_server=ps_server, ps_worker=ps_worker, is_worker=is_worker, churn_offset_s=churn_offset_s,
                        compute_steps_s=compute_steps_s, exchange_steps_s=exchange_steps_s,
                        parts=_RunParts(snapshots=snapshots, walls=walls_t, train_losses=losses_t,
                                        final_flat=final_flat))
    averaged = comm.allreduce(local.clone(), algorithm=config.algorithm, op="sum") / config.workers
    at = comm.allreduce(walls_t, algorithm=config.algorithm, op="max")
    mean_loss = comm.allreduce(losses_t, algorithm=config.algorithm, op="sum") / config.workers
    if final_flat is not None:
        final_flat = comm.allreduce(final_flat.clone(), algorithm=config.algorithm, op="sum")
    curve: tuple[CurvePoint, ...] = ()
    final = (math.nan, math.nan)
    if rank == 0:  # rank 0 is a server in the PS modes: no model of its own
        curve, final = _evaluate(config, task, model, val, averaged, local if is_worker else averaged, at,
                                 mean_loss, final_flat)
    comm.barrier()
    return _RankRun(loop_s=loop_s, injected_s=injected, curve=curve, final=final, stats=stats,
                    ps_server=ps_server, ps_worker=ps_worker, is_worker=is_worker, churn_offset_s=churn_offset_s,
                    compute_steps_s=compute_steps_s, exchange_steps_s=exchange_steps_s)


def _evaluate(config: EagerTrainConfig, task: Any, model: Any, val: Any, averaged: Any, own: Any, at: Any,
              mean_loss: Any, final_flat: Any) -> tuple[tuple[CurvePoint, ...], tuple[float, float]]:
    """The curve (per epoch: the averaged model's and rank 0's own model's metric) and the final
    model's (val loss, metric)."""
    import torch

    if final_flat is not None:
        torch.nn.utils.vector_to_parameters(final_flat, model.parameters())
    final = task.evaluate(model, *val)
    curve = []
    for epoch in range(config.epochs_):
        torch.nn.utils.vector_to_parameters(averaged[epoch], model.parameters())
        val_loss, metric = task.evaluate(model, *val)
        torch.nn.utils.vector_to_parameters(own[epoch], model.parameters())
        _, metric_rank0 = task.evaluate(model, *val)
        curve.append(CurvePoint(epoch=epoch + 1, step=(epoch + 1) * config.steps_per_epoch,
                                wall_s=float(at[epoch]), train_loss=float(mean_loss[epoch]),
                                val_loss=val_loss, val_metric=metric, val_metric_rank0=metric_rank0))
    return tuple(curve), final


def _evaluate_in_parent(config: EagerTrainConfig, runs: list[_RankRun]) -> _RankRun:
    """A run whose server was killed: the sums :func:`_finish_run` does by collectives, over the
    ranks that are left, then the evaluation; returns the run as rank 0 would have."""
    import torch

    task = config.task()
    torch.manual_seed(config.seed)
    model = task.model()
    parts = [r.parts for r in runs if r.parts is not None]
    workers = sum(p.snapshots is not None for p in parts)  # the workers left (a killed one is not)
    averaged = sum(p.snapshots for p in parts if p.snapshots is not None) / workers
    at = torch.stack([p.walls for p in parts]).max(dim=0).values
    mean_loss = sum(p.train_losses for p in parts) / workers
    finals = [p.final_flat for p in parts if p.final_flat is not None]
    curve, final = _evaluate(config, task, model, task.val(), averaged, averaged, at, mean_loss,
                             sum(finals) if finals else None)
    return dataclasses.replace(runs[0], curve=curve, final=final)


# --------------------------------------------------------------------------- in the parent


def run_eager_training(config: EagerTrainConfig, *, argv: Sequence[str] | None = None,
                       on_run: Callable[[int, int], None] | None = None,
                       capture_output: bool = False) -> EagerTrainResult:
    """Train every (injection, mode) on ``config.workers`` local ranks: the collective modes in
    one launch, the parameter-server modes in another (with ``config.servers`` more ranks)."""
    import platform
    import shlex
    import socket
    import sys

    import torch

    from mlfabric.ps.layout import REPLICAS_ENV, SERVERS_ENV

    from .ps_modes import summarize

    total = len(config.runs())
    finished = {False: 0, True: 0}

    def on_report(rank: int, payload: Any) -> None:
        if on_run is not None and rank == 0 and isinstance(payload, dict):
            finished[bool(payload.get("ps"))] = int(payload["run"])
            on_run(sum(finished.values()), total)

    emulation = config.emulation
    trace_dir: str | None = None
    if emulation is not None:
        import tempfile

        from mlfabric.emu.cmd import EmuUnavailableError, have_root

        if not have_root():
            raise EmuUnavailableError(EMULATE_NEEDS_ROOT)
        if emulation.churn is not None:
            trace_dir = emulation.trace_dir or tempfile.mkdtemp(prefix="mlfabric-train-")
    launched = time.time()
    per_run: dict[int, list[_RankRun]] = {}
    startup = 0.0
    emulated: list[dict[str, Any]] = []
    failover: dict[str, Any] = {}
    for ps in config.launches():
        world = config.workers + (config.ps_ranks if ps else 0)
        started = launched if not per_run else time.time()
        fault_dir = _fault_dir(config) if ps and config.fail is not None else None
        try:
            with _launch_config(config, world, ps=ps,
                                env={SERVERS_ENV: str(config.servers), REPLICAS_ENV: str(config.replicas)} if ps else {},
                                capture_output=capture_output, trace_dir=trace_dir, records=emulated) as launch:
                per_rank: list[Any] = run_ranks(_rank_main, config=launch, args=(config, started, ps, fault_dir),
                                                on_report=on_report, expect_failures=_may_die(config, world, fault_dir))
            if fault_dir is not None:
                per_rank, failover = _after_failure(config, per_rank, fault_dir)
        finally:
            if fault_dir is not None:
                import shutil

                shutil.rmtree(fault_dir, ignore_errors=True)
        startup = max(startup, max(r[0] for r in per_rank))
        indices = [i for i, (_, mode) in enumerate(config.runs()) if is_ps_mode(mode) == ps]
        for k, index in enumerate(indices):
            per_run[index] = [r[1][k] for r in per_rank]
    wall = time.time() - launched
    task_metric = config.metric
    runs = []
    for index, (inject, mode) in enumerate(config.runs()):
        ranks = per_run[index]
        workers = [r for r in ranks if r.is_worker]
        stats = [r.stats for r in workers if r.stats is not None]
        ps_figures = (summarize([r.ps_server for r in ranks if r.ps_server], [r.ps_worker for r in workers],
                                run_s=max(r.loop_s for r in workers),
                                nic_rate_bps=config.emulation.rate_bps if config.emulation is not None else None)
                      if is_ps_mode(mode) else None)
        if ps_figures is not None and failover:
            ps_figures.update(failover)
        runs.append(RunResult(
            inject=inject, mode=mode, metric=task_metric, steps=config.steps,
            loop_s=max(r.loop_s for r in workers), per_rank_loop_s=tuple(r.loop_s for r in workers),
            curve=ranks[0].curve, final_val_loss=ranks[0].final[0], final_metric=ranks[0].final[1],
            mean_active=statistics.fmean(s["mean_active"] for s in stats) if stats else None,
            contributed_fraction=statistics.fmean(s["contributed_fraction"] for s in stats) if stats else None,
            rounds_skipped=statistics.fmean(s["rounds_skipped"] for s in stats) if stats else None,
            injected_s=statistics.fmean(r.injected_s for r in workers),
            samples_per_step=config.batch_size_ * config.workers, ps=ps_figures,
            churn_offset_s=min((r.churn_offset_s for r in workers if r.churn_offset_s is not None), default=None),
            compute_s=compute_summary([r.compute_steps_s for r in workers if r.compute_steps_s]),
            exchange_s=exchange_summary([e for r in workers for e in r.exchange_steps_s])))
    metadata = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": socket.gethostname(),
        "platform": platform.platform(), "cpu_count": __import__("os").cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "command": shlex.join(argv if argv is not None else sys.argv),
        # None: local ranks on loopback. Otherwise the emulated network: NIC rate, churn, and
        # per launch its star, cluster prefix, churn trace and redraws (reduced_fraction: the
        # mean share of NIC directions below the full rate over the redraws).
        "emulation": None if emulation is None else {
            "rate_bps": emulation.rate_bps, "churn": emulation.churn,
            "churn_period_s": emulation.churn_period_s if emulation.churn is not None else None,
            "churn_seed": config.seed if emulation.churn is not None else None,
            "placement": (f"{config.workers_per_host} worker ranks per host of a star (PS: servers and replicas "
                          "one per host, hosts 0..S-1; rank_hosts per launch)" if config.workers_per_host > 1 else
                          "one rank per host of a star of each launch's ranks (PS: servers on hosts 0..S-1)"
                          if emulation.ps_topology is None else
                          f"one rank per host; the PS launch on {emulation.ps_topology} (servers on hosts "
                          "0..S-1), the collective launch on a star"),
            "launches": emulated},
    }
    return EagerTrainResult(config=config, runs=tuple(runs), startup_s=startup, wall_s=wall, metadata=metadata)


def _fault_dir(config: EagerTrainConfig) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="mlfabric-fail-")


def _may_die(config: EagerTrainConfig, world: int, fault_dir: str | None) -> set[int]:
    """The ranks a ``--fail`` run lets die: server 0, or (aggregator: which one the ranks
    work out from the tree) any worker -- :func:`_after_failure` checks it was just the one."""
    failure = config.failure
    if fault_dir is None or failure is None:
        return set()
    return {0} if failure.role == "server" else set(range(config.ps_ranks, world))


def _after_failure(config: EagerTrainConfig, per_rank: list[Any], fault_dir: str) -> tuple[list[Any], dict[str, Any]]:
    """The PS launch whose server 0 (or tree node) was killed: its run evaluated over the ranks
    left, and the failover figures (:mod:`mlfabric.train.failover`)."""
    from mlfabric.bench.procs import RankFailure

    from .failover import FailoverError, failover_figures, repair_figures

    failure = config.failure
    assert failure is not None
    failed = [r for r in per_rank if isinstance(r, RankFailure)]
    survivors = [r for r in per_rank if not isinstance(r, RankFailure)]
    if not failed:
        raise FailoverError(f"--fail {config.fail}: the {failure.role} was still alive at the end of the run (the run "
                            "was shorter than the failure time): give an earlier time")
    if len(failed) > 1:
        raise FailoverError(f"--fail {config.fail}: besides the one killed, ranks failed: " + "; ".join(
            f"rank {f.rank}: {f.exc_type}: {f.message}" for f in failed))
    (run,) = zip(*[r[1] for r in survivors])  # one PS run (EagerTrainConfig checks it)
    evaluated = _evaluate_in_parent(config, list(run))
    if failure.role == "server":
        promoted = next((r.ps_server for r in run if r.ps_server and "took_over" in r.ps_server), None)
        figures = failover_figures(fault_dir, promoted)
    else:
        figures = repair_figures(fault_dir, [r.ps_worker["mlnet"] for r in run
                                             if r.ps_worker and r.ps_worker.get("mlnet")])
    startup = max(r[0] for r in survivors)
    return [(startup, [evaluated])] + [(startup, [r]) for r in run[1:]], figures


@contextlib.contextmanager
def _launch_config(config: EagerTrainConfig, world: int, *, ps: bool, env: dict[str, str], capture_output: bool,
                   trace_dir: str | None, records: list[dict[str, Any]]) -> Iterator[LaunchConfig]:
    """Local ranks on loopback, or (``config.emulation``) one rank per host of an emulated star
    of ``world`` hosts under the emulation's rate and churn, torn down after the block; the
    launch's record (topology, cluster, churn trace and redraws) is appended to ``records``."""
    emulation = config.emulation
    if emulation is None:
        yield LaunchConfig(world_size=world, timeout_s=config.timeout_s, capture_output=capture_output, env=env)
        return
    from mlfabric.emu.launcher import emulated_launch

    name = "parameter-server" if ps else "collective"
    # #36: workers_per_host worker ranks share a host (servers and replicas one each)
    placed = config.host_placement(world, ps)
    hosts = max(placed) + 1
    record: dict[str, Any] = {"launch": name, "topology": emulation.launch_topology(hosts, ps), "hosts": hosts}
    if config.workers_per_host > 1:
        record["rank_hosts"] = placed
    reduced: list[float] = []  # per redraw: the share of NIC directions below the full rate
    if emulation.churn is not None and trace_dir is not None:
        record["churn_trace"] = str(Path(trace_dir) / f"churn-{name}.csv")

    def on_churn(t: float, rows: list[Any]) -> None:
        reduced.append(sum(r.rate_bps < emulation.rate_bps * (1 - 1e-9) for r in rows) / len(rows))

    with emulated_launch(record["topology"], emulation.rate_bps,
                         on_built=lambda plan: record.update(cluster=plan.prefix), churn=emulation.churn,
                         churn_period_s=emulation.churn_period_s, churn_seed=config.seed,
                         trace_path=record.get("churn_trace"), on_churn=on_churn,
                         timeout_s=config.timeout_s, capture_output=capture_output,
                         **({"hosts": placed} if config.workers_per_host > 1 else {})) as launch:
        records.append(record)
        yield dataclasses.replace(launch, env={**launch.env, **env})
    if emulation.churn is not None:
        record["churn_redraws"] = len(reduced)
        record["churn_reduced_fraction"] = statistics.fmean(reduced) if reduced else None


# --------------------------------------------------------------------------- outputs


CSV_COLUMNS = ("workload", "inject", "mode", "epoch", "step", "wall_s", "train_loss", "val_loss", "val_metric",
               "val_metric_rank0", "metric")


def write_outputs(result: EagerTrainResult, out_dir: Path, *, plot: bool = True,
                  tensorboard: bool = True) -> dict[str, str]:
    """``curves.csv`` (always), ``tensorboard/<run>/`` (if tensorboard is installed) and
    ``curves.png`` (if matplotlib is). Returns {"csv"|"tensorboard"|"png": path} of what it
    wrote, plus {"png_skipped"|"tensorboard_skipped": reason} for what it could not."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    csv_path = out_dir / "curves.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for run in result.runs:
            for p in run.curve:
                writer.writerow([result.config.workload, run.inject, run.mode, p.epoch, p.step, f"{p.wall_s:.6f}",
                                 f"{p.train_loss:.6g}", f"{p.val_loss:.6g}", f"{p.val_metric:.6g}",
                                 f"{p.val_metric_rank0:.6g}", run.metric])
    files["csv"] = str(csv_path)
    if tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            files["tensorboard_skipped"] = "tensorboard is not installed: pip install 'mlfabric[tensorboard]'"
        else:
            root = out_dir / "tensorboard"
            for run in result.runs:
                name = f"{run.mode}_{run.inject}".replace(":", "-").replace(",", "_").replace("/", "_")
                with SummaryWriter(log_dir=str(root / name)) as writer:
                    for p in run.curve:
                        writer.add_scalar(f"val/{run.metric}", p.val_metric, p.step, walltime=p.wall_s)
                        writer.add_scalar(f"val/{run.metric}_rank0", p.val_metric_rank0, p.step, walltime=p.wall_s)
                        writer.add_scalar("val/loss", p.val_loss, p.step, walltime=p.wall_s)
                        writer.add_scalar("train/loss", p.train_loss, p.step, walltime=p.wall_s)
                        writer.add_scalar(f"val_vs_time_ms/{run.metric}", p.val_metric, int(p.wall_s * 1e3))
            files["tensorboard"] = str(root)
    if plot:
        try:
            files["png"] = str(plot_curves(result, out_dir / "curves.png"))
        except RuntimeError as exc:  # matplotlib missing
            files["png_skipped"] = str(exc)
    return files


def plot_curves(result: EagerTrainResult, path: Path) -> Path:
    """Validation metric vs wall time (one line per run) and throughput per run (eager-SGD Fig. 10)."""
    from mlfabric.sim.report import require_matplotlib

    plt = require_matplotlib()
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.get_cmap("tab10")
    modes = list(result.config.modes)  # one color per mode of the run (PS modes included)
    injects = list(result.config.injects)
    styles = ("-", "--", ":", "-.")
    for run in result.runs:
        color = colors(modes.index(run.mode) % 10)
        style = styles[injects.index(run.inject) % len(styles)]
        curves.plot([p.wall_s for p in run.curve], [p.val_metric for p in run.curve], style, color=color,
                    marker=".", label=run.label)
        curves.plot([run.loop_s], [run.final_metric], "*", color=color, markersize=10)
    metric = result.runs[0].metric
    if metric == "mse":
        curves.set_yscale("log")
    curves.set_xlabel("wall time (s)")
    curves.set_ylabel(f"validation {metric} (average model; *: final)")
    curves.set_title(f"{result.config.workload}: {result.config.workers} workers")
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize=8)
    labels = [run.label for run in result.runs]
    values = [run.steps_per_s for run in result.runs]
    bars.barh(range(len(values)), values, color=[colors(modes.index(r.mode) % 10) for r in result.runs])
    bars.set_yticks(range(len(values)), labels, fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("throughput (steps/s)")
    for i, run in enumerate(result.runs):
        bars.text(values[i], i, f" {values[i]:.2f}", va="center", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render_table(result: EagerTrainResult) -> Table:
    """One row per run: throughput, speedup over allreduce, final metric and eager statistics."""
    from rich import box
    from rich.table import Table

    config = result.config
    metric = result.runs[0].metric
    where = ""
    if config.emulation is not None:
        emu = config.emulation
        where = (f", emulated {emu.ps_topology or 'star'} at {emu.rate_bps / 1e6:g} Mbit/s per NIC"
                 + (f", churn {emu.churn} every {emu.churn_period_s:g}s" if emu.churn is not None else ""))
    table = Table(title=f"{config.workload}: {config.workers} workers, {config.epochs_} epochs x "
                        f"{config.steps_per_epoch} steps, batch {config.batch_size_} per worker, "
                        f"{config.transport} transport{where}", title_justify="left", box=box.SIMPLE_HEAD)
    shown = "LL" if metric == "log-likelihood" else metric  # the header stays narrow
    for name in ("injection", "mode", "loop s", "steps/s", "speedup", shown, f"{shown} vs sync", "to target s/it",
                 "active", "fresh"):
        table.add_column(name, justify="left" if name in ("injection", "mode") else "right", no_wrap=True)
    comparisons = {(c["inject"], c["mode"]): c for c in result.comparisons()}
    last = None
    for run in result.runs:
        if last is not None and run.inject != last:
            table.add_section()
        c = comparisons.get((run.inject, run.mode))
        speed = "" if c is None else f"{c['speedup']:.2f}x"
        if metric == "mse":
            delta = "" if c is None else f"{(c['metric_ratio'] - 1) * 100:+.1f}%"
            value = f"{run.final_metric:.3f}"
        elif metric == "log-likelihood":  # nats per held-out token
            delta = "" if c is None else f"{-c['metric_gap']:+.3f}"
            value = f"{run.final_metric:.3f}"
        else:
            delta = "" if c is None else f"{-c['metric_gap'] * 100:+.1f} pt"
            value = f"{run.final_metric:.1%}"
        try:
            goal = result.target(run.inject)
            reach, steps = run.time_to(goal), run.steps_to(goal)
        except KeyError:
            reach = steps = None
        table.add_row(run.inject if run.inject != last else "", run.mode, f"{run.loop_s:.1f}",
                      f"{run.steps_per_s:.2f}", speed, value, delta,
                      "never" if reach is None else f"{reach:.1f}/{steps}",
                      "" if run.mean_active is None else f"{run.mean_active:.1f}",
                      "" if run.contributed_fraction is None else f"{run.contributed_fraction:.0%}")
        last = run.inject
    tolerance = {"mse": "5%", "log-likelihood": "1%"}.get(metric, "1 point")
    table.caption = (f"start-up {result.startup_s:.1f} s, whole launch {result.wall_s:.1f} s; speedup = steps/s over "
                     f"allreduce's; {metric} of the final (averaged) model"
                     + (" (LL: held-out log-likelihood, nats per token)" if metric == "log-likelihood" else "")
                     + "; to target = wall time (s) and iterations "
                     "(it: steps per worker; async PS: worker updates applied / workers) until the average "
                     + (f"model's {metric} reaches {config.target:g}; " if config.target is not None else
                        f"model's {metric} is within {tolerance} of allreduce's final one; ")
                     + "active = ranks with fresh gradients per round; fresh = steps whose gradient made its round")
    table.caption_justify = "left"
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render_ps_table(result: EagerTrainResult) -> Table:
    """One row per parameter-server run: updates applied and dropped, delays, pull latency,
    traffic through the servers' NICs."""
    from rich import box
    from rich.table import Table

    replicas = f", {result.config.replicas} replica(s)" if result.config.replicas else ""
    table = Table(title=f"parameter server: {result.config.servers} server(s){replicas}, "
                        f"{result.config.workers} workers",
                  title_justify="left", box=box.SIMPLE_HEAD)
    measured = any(run.ps is not None and run.ps.get("max_divergence") is not None for run in result.runs)
    divergence = ("divergence (est.)",) if measured else ()  # replicas measured at batch ends (mlfabric-a)
    for name in ("injection", "mode", "applied", "dropped", "max delay", "mean delay", "pull ms", "server MB in/out",
                 *divergence):
        table.add_column(name, justify="left" if name in ("injection", "mode") else "right", no_wrap=True)
    for run in result.runs:
        if run.ps is None:
            continue
        ps = run.ps
        traffic = "/".join(f"{i / 1e6:.0f}" for i in ps["server_bytes_in"]) + " / " + \
            "/".join(f"{o / 1e6:.0f}" for o in ps["server_bytes_out"])
        table.add_row(run.inject, run.mode, str(ps["worker_updates_applied"]), str(ps["dropped"]),
                      "" if ps["max_delay"] is None else str(ps["max_delay"]),
                      "" if ps["mean_delay"] is None else f"{ps['mean_delay']:.2f}",
                      "" if ps["pull_latency_ms"] is None else f"{ps['pull_latency_ms']:.1f}", traffic,
                      *(("" if ps.get("max_divergence") is None else
                         f"{ps['max_divergence']:.3g} ({ps['max_divergence_estimate']:.3g})",) if measured else ()))
    failed = [run.ps for run in result.runs if run.ps is not None and "failover_s" in run.ps]
    table.caption = ("applied = worker gradients applied; delay = server version when applied - version it was "
                     "computed from (BSP rounds apply at their own version: 0)"
                     + ("; divergence = largest ||w_server - w_replica|| at a batch end (eq. (11) estimate)"
                        if measured else "")
                     + "".join(f"; server 0 killed, its replica took over: failover {_seconds(f['failover_s'])} "
                               f"(kill to its first update), model lost {f['lost_divergence']:.3g} "
                               f"({f['lost_updates']} updates)" for f in failed))
    table.caption_justify = "left"
    return table
