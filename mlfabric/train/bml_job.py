"""BML §4.3, Fig. 6 on emulated clusters: LeNet-5 job completion time, BML on BCube vs PS on a star.

    sudo mlfabric bench bml-job --iterations 100 --batches 32,128 --rate 500mbit --json out.json

The job is BML's LeNet-5 benchmark scaled to this machine: :class:`~mlfabric.train.models.LeNet5`
(3.27 million parameters, 12.5 MiB of float32 gradients, as BML §4.2 counts it) trained with
DDP + mlfabric's comm hook (:func:`mlfabric.train.ddp.run_training`) for ``iterations``
iterations at each sub-minibatch size (per rank), on synthetic MNIST-shaped images (no
downloads). Two emulated clusters with the same hosts and the same per-NIC rate are built
at once and the runs are interleaved (batch 32 on BML, batch 32 on PS, batch 128 on BML,
...) so that drift on a shared machine hits both networks alike:

* BML: ``allreduce("bcube")`` (BML Algorithm 1) on ``bcube:n=3,k=2``, two NICs per host;
* PS: ``allreduce("ps")`` (the P2P parameter server: every host a worker and a server) on
  ``star:n=9``, one NIC per host: BML §4.2's Fat-Tree, one non-blocking switch.

The job completion time (JCT) of a run is its training loop's wall time on the slowest rank
(process start-up and rendezvous excluded); BML's reduction is ``1 - JCT_BML / JCT_PS``
(BML §4.3 reports 18.7%-56.4% for sub-minibatches 128-1024 on 40 GbE). Each network's
simulated GST for one full gradient (:func:`mlfabric.bench.allreduce.simulated_allreduce_s`)
is reported with it, for scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .data import DataConfig
from .ddp import TrainConfig, TrainResult, run_training

__all__ = ["BmlJobConfig", "BmlJobResult", "BmlJobRun", "Network", "render_job_table", "run_bml_job"]


@dataclass(frozen=True, kw_only=True)
class Network:
    """One emulated network of the comparison and the allreduce its job uses."""

    name: str        # "BML" / "PS"
    topology: str    # spec of the emulated cluster
    algorithm: str   # mlfabric allreduce for the DDP comm hook


@dataclass(frozen=True, kw_only=True)
class BmlJobConfig:
    iterations: int = 100
    batches: tuple[int, ...] = (32, 128)  # sub-minibatch per rank
    rate_bps: float = 500e6
    bcube: str = "bcube:n=3,k=2"
    # Averaged gradients of 9 x 128 samples: at lr 0.01 (momentum 0.9) the loss spikes back to
    # ~2 after 60 iterations; 0.005 trains both sub-minibatches to ~98% test accuracy in 100.
    lr: float = 0.005
    momentum: float = 0.9
    # DDP's default bucket size: the 12.8 MB fc1 weight fills one bucket, the rest another;
    # BML cuts each bucket into k*N pieces (BML §4.1 cuts each layer).
    bucket_cap_mb: float = 25.0
    train_samples: int = 8_192
    test_samples: int = 1_024
    transport: str = "tcp"
    timeout_s: float = 1_800.0
    seed: int = 0

    def __post_init__(self) -> None:
        from mlfabric.topo.spec import TopologySpec

        if self.iterations < 1 or not self.batches or min(self.batches) < 1:
            raise ValueError(f"need iterations >= 1 and positive batch sizes, got {self.iterations}, {self.batches}")
        if len(set(self.batches)) != len(self.batches):
            raise ValueError(f"batch sizes repeat: {self.batches}")
        if TopologySpec.parse(self.bcube).kind != "bcube":
            raise ValueError(f"the BML network must be a BCube, got {self.bcube}")
        if not self.rate_bps >= 8000:
            raise ValueError(f"rate must be at least 8 kbit/s, got {self.rate_bps}")
        if self.timeout_s <= 0 or self.lr <= 0:
            raise ValueError("timeout_s and lr must be positive")

    @property
    def hosts(self) -> int:
        from mlfabric.topo.spec import TopologySpec

        spec = TopologySpec.parse(self.bcube)
        return spec.int_param("n") ** spec.int_param("k")

    @property
    def networks(self) -> tuple[Network, Network]:
        return (Network(name="BML", topology=self.bcube, algorithm="bcube"),
                Network(name="PS", topology=f"star:n={self.hosts}", algorithm="ps"))

    def train_config(self, batch: int, network: Network) -> TrainConfig:
        per_rank = self.train_samples // self.hosts
        if per_rank < batch:
            raise ValueError(f"{self.train_samples} training samples give each of {self.hosts} ranks {per_rank}, "
                             f"fewer than one sub-minibatch of {batch}; raise train_samples")
        return TrainConfig(steps=self.iterations, batch_size=batch, lr=self.lr, momentum=self.momentum,
                           model="lenet5", algorithm=network.algorithm, topology=network.topology,
                           transport=self.transport, bucket_cap_mb=self.bucket_cap_mb, seed=self.seed,
                           timeout_s=self.timeout_s, report_every=1,
                           data=DataConfig(kind="images", train_samples=self.train_samples,
                                           test_samples=self.test_samples, seed=self.seed))


@dataclass(frozen=True, kw_only=True)
class BmlJobRun:
    batch: int
    network: Network
    result: TrainResult

    @property
    def jct_s(self) -> float:
        return self.result.loop_s

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {"batch": self.batch, "network": self.network.name, "topology": self.network.topology,
                "algorithm": self.network.algorithm, "jct_s": self.jct_s,
                "median_iteration_s": statistics.median(r.step_times), "initial_loss": r.initial_loss,
                "final_loss": r.final_loss, "test_accuracy": r.accuracy, "parameters": r.parameters,
                "gradient_bytes": r.parameters * 4, "buckets_per_iteration": r.per_rank[0].buckets_reduced
                / r.config.steps, "bytes_reduced_per_iteration": r.per_rank[0].bytes_reduced / r.config.steps,
                "step_times_s": list(r.step_times)}


@dataclass(frozen=True, kw_only=True)
class BmlJobResult:
    config: BmlJobConfig
    runs: tuple[BmlJobRun, ...]
    simulated_gst_s: dict[str, float]  # network name -> one full-gradient allreduce, simulated
    metadata: dict[str, Any] = field(default_factory=dict)

    def get(self, batch: int, network: str) -> BmlJobRun:
        for run in self.runs:
            if run.batch == batch and run.network.name == network:
                return run
        raise KeyError(f"no run of batch {batch} on {network}")

    def reductions(self) -> list[dict[str, Any]]:
        """Per sub-minibatch: BML's JCT reduction relative to PS, ``1 - JCT_BML / JCT_PS``."""
        out = []
        for batch in self.config.batches:
            bml, ps = self.get(batch, "BML").jct_s, self.get(batch, "PS").jct_s
            out.append({"batch": batch, "jct_bml_s": bml, "jct_ps_s": ps, "reduction": 1.0 - bml / ps,
                        "speedup": ps / bml})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "bml-job",
            "metadata": self.metadata,
            "config": {**dataclasses.asdict(self.config), "batches": list(self.config.batches),
                       "networks": [dataclasses.asdict(n) for n in self.config.networks]},
            "units": {"time": "s", "reduction": "fraction of PS's JCT"},
            "simulated_gst_s": self.simulated_gst_s,
            "runs": [run.to_dict() for run in self.runs],
            "reductions": self.reductions(),
        }


def run_bml_job(config: BmlJobConfig, *, on_step: Callable[[str, int, int], None] | None = None,
                capture_output: bool = False, argv: Sequence[str] | None = None) -> BmlJobResult:
    """Build both clusters, run every (batch, network) once, tear them down (root needed).

    ``on_step(label, step, steps)`` follows rank 0 of the run in progress.
    """
    from mlfabric.bench.allreduce import simulated_allreduce_s
    from mlfabric.emu.launcher import emulated_launch

    from .models import LeNet5, count_parameters

    gradient_bytes = count_parameters(LeNet5()) * 4
    simulated = {n.name: simulated_allreduce_s(n.algorithm, n.topology, config.rate_bps, gradient_bytes) or 0.0
                 for n in config.networks}
    runs: list[BmlJobRun] = []
    with contextlib.ExitStack() as stack:
        launches = {n.name: stack.enter_context(emulated_launch(n.topology, config.rate_bps, timeout_s=config.timeout_s,
                                                                capture_output=capture_output))
                    for n in config.networks}
        for index, batch in enumerate(config.batches):
            for network in config.networks:
                train = config.train_config(batch, network)
                # A fresh port per run in the same cluster: nothing of the previous run is in the way.
                launch = dataclasses.replace(launches[network.name], master_port=29500 + index)
                label = f"{network.name} batch {batch}"

                def step(done: int, loss: float, label: str = label) -> None:
                    if on_step is not None:
                        on_step(label, done, config.iterations)

                runs.append(BmlJobRun(batch=batch, network=network,
                                      result=run_training(train, launch=launch, on_step=step)))
    return BmlJobResult(config=config, runs=tuple(runs), simulated_gst_s=simulated, metadata=_metadata(argv))


def _metadata(argv: Sequence[str] | None) -> dict[str, Any]:
    import datetime
    import os
    import platform
    import shlex
    import socket
    import sys

    import torch

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "command": shlex.join(argv if argv is not None else sys.argv)}


def render_job_table(result: BmlJobResult) -> Any:
    """A rich table in the shape of BML's Fig. 6: JCT per (sub-minibatch, network), reduction."""
    from rich import box
    from rich.table import Table

    config = result.config
    first = result.runs[0].result
    title = (f"LeNet-5 ({first.parameters / 1e6:.2f}M parameters, {first.parameters * 4 / 2**20:.1f} MiB gradients), "
             f"{config.iterations} iterations per sub-minibatch (batch, per rank) on {config.hosts} emulated hosts, "
             f"{config.rate_bps / 1e6:g} Mbit/s NICs; "
             + ", ".join(f"{n.name} = {n.algorithm} on {n.topology} (simulated GST "
                         f"{result.simulated_gst_s[n.name] * 1e3:.0f} ms)" for n in config.networks))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("batch", "network", "JCT s", "s/iter", "loss", "BML reduction"):
        table.add_column(name, justify="left" if name == "network" else "right", no_wrap=True)
    reductions = {entry["batch"]: entry for entry in result.reductions()}
    for batch in config.batches:
        for network in config.networks:
            run = result.get(batch, network.name)
            reduction = ""
            if network.name == "BML":
                value = reductions[batch]["reduction"]
                reduction = f"{value * 100:.1f}%"
            table.add_row(str(batch), network.name,
                          f"{run.jct_s:.1f}", f"{statistics.median(run.result.step_times):.3f}",
                          f"{run.result.final_loss:.3f}", reduction)
        table.add_section()
    return table
