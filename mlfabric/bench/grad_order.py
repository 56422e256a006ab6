"""TicTac's priorities on allreduce training: step time per gradient order (ByteScheduler-style).

    mlfabric bench grad-order --model vgg --width 2 --workers 4 --ordering ddp,fifo,tio,tao \\
        --emulate --rate 1gbit --iterations 60 --json out.json                      # root

``workers`` ranks train one model with data-parallel SGD (ring allreduce, average), each on
its own synthetic batch, through :class:`mlfabric.torch.OrderedAllreduce`, either as local
processes or, with ``--emulate``, on an emulated star whose NICs are shaped to ``rate``.
Each ordering trains its own copy of the same initial model for ``iterations`` iterations;
with ``rounds`` > 1 the orderings take turns, ``iterations / rounds`` at a time, so that a
slow drift of the shared machine falls on all of them:

* ``ddp``: what DistributedDataParallel + ``optimizer.step()`` do: the gradients are reduced
  first come, first served (overlapping the backward) and the next forward starts once every
  update is applied;
* ``fifo``: the same order, but each module's forward starts once its own parameters are
  updated (the per-layer overlap alone: the first layer is still reduced last);
* ``bytescheduler``: the priority order (:mod:`mlfabric.order.gradients`) with
  ByteScheduler's priorities, each parameter's index in ``model.parameters()`` (the order
  the model declares them), and the per-layer overlap: the peer;
* ``tio`` / ``tao``: the same with TIO's / TAO's priorities from the forward DAG (the eager
  DAG: TIO is the order in which the forward first uses the parameters, which is the
  declaration order unless a model declares its layers in another order than it runs them).

**The emulated device** (``--device emulated``, as in ``mlfabric bench tictac``): each leaf
module's forward runs for real and on an emulated accelerator for its device time
(:class:`mlfabric.ps.overlap.ParameterGate`), scaled so that forward + backward (the backward
``backward_factor`` x each module's forward, run last module first) equals
``compute_ratio`` x the ring allreduce time of the model at ``rate`` (1: S = 1; below 1, the
network is the bottleneck, the regime where the order matters most). The
gradient of a module's parameters counts as ready when the emulated backward has passed it
(``OrderedAllreduce(grad_ready_at=...)``); the host waits for the emulated backward's end.

**Figures** per ordering, over the timed iterations (not the warm-up, nor the first of a
later round): ``steps_per_s`` (timed iterations over their spans, each round's the slowest
rank's, its last updates included), ``p50_step_s`` / ``p95_step_s`` (per
iteration, the slowest rank's start-to-start time, the last of a round to its updates), ``comm_wait_s`` (per iteration, the time the host
waited for updates: ``ddp``'s synchronize, the others' forward gates; median),
``correct`` (every rank, and every ordering, ends with the same parameters: the order
changes when the arithmetic happens, not what it is). ``predicted_step_s``: the step
:func:`mlfabric.order.gradients.predicted_step` gives from rank 0's calibration (when its
gradients were ready, how long each partition held the link) and the order it ran;
``ideal_link_step_s``: the same on a link with no cost per collective (each partition its
bytes at the allreduce's rate) and the order the ordering would pick there: what the
ordering is worth where a collective costs little (NCCL, RDMA), not on this transport.

Exercise it with ``.venv/bin/python -m pytest tests/local/test_bench_grad_order.py -q``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from mlfabric.bench.procs import check_choices, report
from mlfabric.bench.tictac import (DEVICES, TCP_PAYLOAD_SHARE, _percentile, collect_metadata, emulated_device_times,
                                   run_on_star)

__all__ = ["GradOrderBenchConfig", "GradOrderBenchResult", "GradOrderPlan", "ORDERINGS", "plan", "render_table",
           "run_grad_order_bench"]

ORDERINGS = ("ddp", "fifo", "bytescheduler", "tio", "tao")
LR = 0.01


@dataclass(frozen=True, kw_only=True)
class GradOrderBenchConfig:
    """See the module docstring. ``iterations`` per ordering, the first ``warmup`` not counted
    (they include OrderedAllreduce's calibration)."""

    model: str = "vgg"
    width: int = 1
    batch: int = 1
    workers: int = 4
    orderings: tuple[str, ...] = ORDERINGS
    iterations: int = 40
    warmup: int = 5
    #: The orderings take turns: ``iterations / rounds`` iterations each per round (the
    #: warm-up in the first; each later round's first iteration is not timed either).
    rounds: int = 1
    emulate: bool = False
    rate_bps: float = 1e9
    device: str = "emulated"
    backward_factor: float = 2.0
    #: Emulated forward + backward over the model's allreduce time (1: S = 1; below 1 the
    #: network is the bottleneck).
    compute_ratio: float = 1.0
    partition_bytes: int = 512 * 1024
    credit: int = 2
    transport: str = "tcp"
    seed: int = 0
    timeout_s: float = 1800.0
    comm_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.order.models import MODELS

        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(sorted(MODELS))}")
        check_choices(list(self.orderings), ORDERINGS, "orderings", "ordering")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.workers < 2 or self.width < 1 or self.batch < 1:
            raise ValueError(f"need workers >= 2, width and batch >= 1, got {self.workers}, {self.width}, "
                             f"{self.batch}")
        from mlfabric.torch.ordered_allreduce import CALIBRATION_ITERATIONS

        if self.rounds < 1 or self.iterations % self.rounds:
            raise ValueError(f"rounds must be >= 1 and divide iterations, got {self.rounds} and {self.iterations}")
        if not CALIBRATION_ITERATIONS <= self.warmup < self.per_round - 1:
            raise ValueError(f"need {CALIBRATION_ITERATIONS} <= warmup < iterations / rounds - 1 (the first "
                             f"iterations calibrate), got {self.warmup}, {self.per_round}")
        if not self.rate_bps >= 8000 or self.backward_factor < 0 or self.partition_bytes < 1 or self.credit < 1 \
                or not self.compute_ratio > 0:
            raise ValueError("rate must be >= 8 kbit/s, backward_factor >= 0, compute_ratio > 0, partition_bytes "
                             "and credit >= 1")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")

    @property
    def per_round(self) -> int:
        return self.iterations // self.rounds

    def timed_rounds(self) -> list[range]:
        """The timed iterations of each round: the first round after the warm-up, the others
        after their first iteration (it follows the other orderings' turns: cold again)."""
        n = self.per_round
        return [range(self.warmup if r == 0 else r * n + 1, (r + 1) * n) for r in range(self.rounds)]

    def timed(self) -> list[int]:
        return [k for rnd in self.timed_rounds() for k in rnd]

    @property
    def allreduce_bytes_per_s(self) -> float:
        """Gradient bytes a ring allreduce averages per second: each rank sends 2(n-1)/n of them."""
        n = self.workers
        return self.rate_bps / 8 * TCP_PAYLOAD_SHARE * n / (2 * (n - 1))


@dataclass(frozen=True, kw_only=True)
class GradOrderPlan:
    """What the parent computes before the launch and every rank receives."""

    node_names: dict[str, list[str]]          # module -> DAG node names of its calls
    device_time: dict[str, float]             # DAG node -> padded forward time (empty: --device cpu)
    backward_time: float                      # the emulated backward, all modules
    ready_offset: dict[str, float]            # parameter -> its gradient's readiness after the backward starts
    priorities: dict[str, dict[str, int]]     # "bytescheduler"/"tio"/"tao" -> parameter -> priority
    model_bytes: int
    allreduce_s: float                        # the model's ring allreduce at the rate
    param_sizes: list[tuple[str, int, int, str]]      # (name, numel, element size, dtype), the model's order
    forward_ops: list[tuple[float, tuple[str, ...]]]  # per leaf-module call: (seconds, its own parameters)


def plan(config: GradOrderBenchConfig) -> GradOrderPlan:
    """Trace the forward DAG, size the emulated device (module docstring), compute TIO and TAO
    with allreduce times as the transfers."""
    from mlfabric.order import TimeOracle, forward_dag, tao, tio, trace_compute, transfer_times
    from mlfabric.order.models import build, param_bytes
    from mlfabric.ps.overlap import call_names

    model, x = build(config.model, seed=config.seed, batch=config.batch, width=config.width)
    md = forward_dag(model, x)
    cpu = trace_compute(md, model, x, iterations=10, warmup=2).minimum()
    names = call_names(md.graph_module)
    module_nodes = {n for calls in names.values() for n in calls}
    transfer = transfer_times(md.dag, config.allreduce_bytes_per_s)
    allreduce_s = math.fsum(transfer.values())
    device: dict[str, float] = {}
    if config.device == "emulated":
        device = emulated_device_times(cpu, module_nodes,
                                       config.compute_ratio * allreduce_s / (1.0 + config.backward_factor))
    # The emulated backward runs the modules last first, each backward_factor x its forward.
    backward_of = {m: config.backward_factor * math.fsum(device.get(n, 0.0) for n in calls)
                   for m, calls in names.items()}
    ready_module, passed = {}, 0.0
    for m in reversed(list(names)):
        passed += backward_of[m]
        ready_module[m] = passed
    ready_offset = {k: ready_module.get(k.rpartition(".")[0], passed) for k, _ in model.named_parameters()}
    own = {m: tuple(f"{m}.{k}" for k, _ in sub.named_parameters(recurse=False)) for m, sub in model.named_modules()}
    forward_ops = [(device.get(n.name, cpu[n.name]), own.get(str(n.target), ()))
                   for n in md.graph_module.graph.nodes if n.op == "call_module"]
    compute = {n: device.get(n, cpu[n]) for n in md.dag.computes}
    dag = md.dag.as_run_by("eager")
    oracle = TimeOracle.combine(dag, compute, transfer)
    priorities = {"bytescheduler": {k: i for i, (k, _) in enumerate(model.named_parameters())},
                  "tio": tio(dag).by_parameter(dag), "tao": tao(dag, oracle).by_parameter(dag)}
    return GradOrderPlan(node_names=names, device_time=device, backward_time=passed, ready_offset=ready_offset,
                         priorities=priorities, model_bytes=param_bytes(model), allreduce_s=allreduce_s,
                         param_sizes=[(k, p.numel(), p.element_size(), str(p.dtype)) for k, p in model.named_parameters()],
                         forward_ops=forward_ops)


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _RankRecord:
    spans: list[tuple[float, float]]  # per iteration: its start, the next one's (or its round's end)
    rounds: list[range]               # the iterations of each round
    comm_wait: list[float]            # per iteration: host time waiting for updates
    checksum: float
    order: list[str]                  # the calibrated order, partition names
    ready_s: dict[str, float]         # OrderedAllreduce's calibration: gradient ready offsets
    service_s: dict[str, float]       # and each partition's hold on the link, by name


def _rank_main(config: GradOrderBenchConfig, the_plan: GradOrderPlan) -> list[_RankRecord]:
    """Every ordering trains its own copy of the model; they take turns, ``per_round``
    iterations each per round, so that a slow drift of the shared machine falls on all."""
    import mlfabric

    comm = mlfabric.init(config.transport, timeout=config.comm_timeout_s)
    try:
        trainers = [_Trainer(comm, config, the_plan, ordering) for ordering in config.orderings]
        try:
            for _ in range(config.rounds):
                for trainer in trainers:
                    trainer.run_round(config.per_round)
            return [trainer.record() for trainer in trainers]
        finally:
            for trainer in trainers:
                trainer.close()
    finally:
        comm.close()


class _Trainer:
    """One ordering's model, OrderedAllreduce and emulated device on this rank."""

    def __init__(self, comm: Any, config: GradOrderBenchConfig, the_plan: GradOrderPlan, ordering: str) -> None:
        import torch

        from mlfabric.order.models import build
        from mlfabric.ps.overlap import ParameterGate
        from mlfabric.torch import OrderedAllreduce

        torch.set_num_threads(1)
        self.comm, self.plan, self.ordering = comm, the_plan, ordering
        self.model, (x,) = build(config.model, seed=config.seed, batch=config.batch, width=config.width)
        self.x = torch.randn(x.shape, generator=torch.Generator().manual_seed(config.seed + 100 + comm.rank))
        self.backward_start = 0.0
        ready_at = (lambda k: self.backward_start + the_plan.ready_offset[k]) if the_plan.device_time else None
        self.opt = OrderedAllreduce(self.model, comm, torch.optim.SGD, lr=LR,
                                    priorities=the_plan.priorities.get(ordering),
                                    partition_bytes=config.partition_bytes, credit=config.credit, gate=False,
                                    grad_ready_at=ready_at)
        self.gate = ParameterGate(self.model, node_names=the_plan.node_names, device_time=the_plan.device_time,
                                  timeout_s=config.comm_timeout_s)
        self.spans: list[tuple[float, float]] = []
        self.rounds: list[range] = []
        self.comm_wait: list[float] = []

    def run_round(self, iterations: int) -> None:
        """``iterations`` iterations, then every update applied (the round's end)."""
        from mlfabric.ps.overlap import pad_to

        first = len(self.spans)
        starts = []
        for _ in range(iterations):
            start = time.monotonic()
            starts.append(start)
            if self.ordering == "ddp":  # the step waits for every update
                self.opt.synchronize()
                self.gate.attach(None)
            else:
                self.gate.attach(self.opt)
            waited = time.monotonic() - start
            out = self.model(self.x)
            self.backward_start = forward_end = time.monotonic()
            out.square().mean().backward()
            pad_to(forward_end, self.plan.backward_time)  # the host waits for the emulated backward
            self.comm_wait.append(waited + sum(e - s for _, s, e in self.gate.waits))
            if self.comm.rank == 0:
                report((self.ordering, first + len(starts)))
        self.opt.synchronize()
        starts.append(time.monotonic())
        self.spans += list(zip(starts, starts[1:]))
        self.rounds.append(range(first, len(self.spans)))

    def record(self) -> _RankRecord:
        checksum = math.fsum(float(p.detach().double().sum()) for p in self.model.parameters())
        return _RankRecord(spans=self.spans, rounds=self.rounds, comm_wait=self.comm_wait, checksum=checksum,
                           order=[p.name for p in self.opt.order], ready_s=dict(self.opt.ready_s),
                           service_s={p.name: t for p, t in self.opt.service_s.items()})

    def close(self) -> None:
        self.gate.remove()
        self.opt.close()


# --------------------------------------------------------------------------- results (parent)


@dataclass(frozen=True, kw_only=True)
class OrderingResult:
    ordering: str
    steps_per_s: float
    p50_step_s: float
    p95_step_s: float
    comm_wait_s: float
    correct: bool
    #: The step :func:`mlfabric.order.gradients.predicted_step` gives with rank 0's
    #: calibration (its measured gradient times and partition holds) and the order it ran.
    predicted_step_s: float
    #: The same with a link that costs nothing per collective (each partition: its bytes at
    #: the ring allreduce's rate) and the order the ordering picks for it.
    ideal_link_step_s: float
    steps_s: list[float] = field(repr=False)
    order: list[str] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("steps_s", "order")}


@dataclass(frozen=True, kw_only=True)
class GradOrderBenchResult:
    config: GradOrderBenchConfig
    plan: GradOrderPlan
    results: tuple[OrderingResult, ...]
    metadata: dict[str, Any]

    def speedups(self) -> dict[str, float]:
        """steps/s of each ordering over ddp's (when ddp ran)."""
        base = next((r.steps_per_s for r in self.results if r.ordering == "ddp"), None)
        return {} if base is None else {r.ordering: r.steps_per_s / base for r in self.results}

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "benchmark": "grad-order", "command": self.metadata.get("command"), "date": self.metadata.get("date"),
            "machine": self.metadata.get("machine"), "metadata": self.metadata, "config": asdict(self.config),
            "plan": {"model_bytes": p.model_bytes, "allreduce_s": p.allreduce_s,
                     "forward_device_s": math.fsum(p.device_time.values()) or None, "backward_device_s": p.backward_time,
                     "tio_order": sorted(p.priorities["tio"], key=p.priorities["tio"].get)},
            "results": [r.to_dict() for r in self.results], "speedup_vs_ddp": self.speedups(),
            "steps_s": {r.ordering: r.steps_s for r in self.results},
            "orders": {r.ordering: r.order for r in self.results},
        }


def predictions(config: GradOrderBenchConfig, the_plan: GradOrderPlan, ordering: str,
                record: _RankRecord) -> tuple[float, float]:
    """(predicted step with ``record``'s calibration and order, the step on an ideal link)."""
    from mlfabric.order.gradients import fifo_order, partition_params, predicted_step, priority_order

    parts = partition_params(the_plan.param_sizes, config.partition_bytes)
    by_name = {p.name: p for p in parts}
    forward = [(c, params) for c, params in the_plan.forward_ops]
    overlap = ordering != "ddp"
    ran = [by_name[name] for name in record.order]
    measured = predicted_step(ran, record.ready_s, lambda p: record.service_s[p.name], forward,
                              the_plan.backward_time, overlap=overlap)

    def line_rate(p: Any) -> float:
        return p.nbytes / config.allreduce_bytes_per_s

    ready = the_plan.ready_offset
    ideal_order = (fifo_order(parts, ready) if ordering in ("ddp", "fifo") else
                   priority_order(parts, ready, the_plan.priorities[ordering], line_rate))
    ideal = predicted_step(ideal_order, ready, line_rate, forward, the_plan.backward_time, overlap=overlap)
    return measured, ideal


def summarize(config: GradOrderBenchConfig, the_plan: GradOrderPlan, ordering: str, records: Sequence[_RankRecord],
              reference: float | None) -> OrderingResult:
    timed = config.timed()
    steps = [max(r.spans[k][1] - r.spans[k][0] for r in records) for k in timed]
    span = math.fsum(max(r.spans[rnd[-1]][1] - r.spans[rnd[0]][0] for r in records) for rnd in config.timed_rounds())
    checksums = [r.checksum for r in records]
    agree = all(math.isclose(c, checksums[0], rel_tol=1e-9, abs_tol=1e-9) for c in checksums)
    same_as_reference = reference is None or math.isclose(checksums[0], reference, rel_tol=1e-6, abs_tol=1e-6)
    predicted, ideal = predictions(config, the_plan, ordering, records[0])
    return OrderingResult(
        ordering=ordering, steps_per_s=len(timed) / span, predicted_step_s=predicted, ideal_link_step_s=ideal, p50_step_s=statistics.median(steps),
        p95_step_s=_percentile(steps, 0.95),
        comm_wait_s=statistics.median(max(r.comm_wait[k] for r in records) for k in timed),
        correct=agree and same_as_reference, steps_s=steps, order=records[0].order)


def run_grad_order_bench(config: GradOrderBenchConfig, *, argv: Sequence[str] | None = None,
                         on_progress: Callable[[str, int], None] | None = None,
                         capture_output: bool = False) -> GradOrderBenchResult:
    """Plan, launch (locally or on the emulator: root), summarize."""
    metadata = collect_metadata(config, argv, hosts=config.workers)
    the_plan = plan(config)
    records = run_on_star(_rank_main, (config, the_plan), hosts=config.workers, emulate=config.emulate,
                          rate_bps=config.rate_bps, timeout_s=config.timeout_s, command="mlfabric bench grad-order",
                          on_progress=on_progress, capture_output=capture_output)
    metadata["loadavg_at_end"] = list(os.getloadavg())
    results: list[OrderingResult] = []
    for i, ordering in enumerate(config.orderings):
        reference = records[0][0].checksum if i else None  # the first ordering's parameters
        results.append(summarize(config, the_plan, ordering, [records[r][i] for r in range(config.workers)],
                                 reference))
    return GradOrderBenchResult(config=config, plan=the_plan, results=tuple(results), metadata=metadata)


# --------------------------------------------------------------------------- presentation


def render_table(result: GradOrderBenchResult) -> Any:
    from rich import box
    from rich.table import Table

    c = result.config
    where = f"emulated at {c.rate_bps / 1e6:g} Mbit/s" if c.emulate else "local"
    tab = Table(title=f"grad-order: {c.model} (width {c.width}, batch {c.batch}), {c.workers} ranks, ring "
                      f"allreduce, {where}, device {c.device}, partitions {c.partition_bytes} B, credit {c.credit}",
                caption=f"{len(c.timed())} timed iterations per ordering; times in ms; wait: the host's wait for "
                        "updates per iteration (median); pred: the step predicted from the calibration; ideal: on "
                        "a link without a per-collective cost; ok: every rank and ordering end with one model",
                title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)
    for name in ("ordering", "step/s", "x ddp", "p50", "p95", "wait", "pred", "ideal", "ok"):
        tab.add_column(name, justify="right" if name != "ordering" else "left", no_wrap=True)
    speed = result.speedups()
    for r in result.results:
        tab.add_row(r.ordering, f"{r.steps_per_s:.2f}", "" if r.ordering not in speed else f"{speed[r.ordering]:.3f}",
                    f"{r.p50_step_s * 1e3:.1f}", f"{r.p95_step_s * 1e3:.1f}", f"{r.comm_wait_s * 1e3:.1f}",
                    f"{r.predicted_step_s * 1e3:.1f}", f"{r.ideal_link_step_s * 1e3:.1f}", "yes" if r.correct else "NO")
    return tab
