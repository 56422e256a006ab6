"""TicTac on the parameter server: step time, ordering efficiency and stragglers per transfer ordering.

    mlfabric bench tictac --model inception --width 4 --workers 4 --ordering none,random,tio,tao \\
        --emulate --rate 1gbit --forward-only --iterations 220 --json out.json          # root

One PS job (1 server, ``workers`` workers, BSP, direct routing, the plain TCP transport),
either on local processes or, with ``--emulate``, on an emulated star of ``1 + workers`` hosts
whose NICs are shaped to ``rate`` (TicTac §6's setup: one PS and four workers on 1 GbE). Each
ordering runs as its own PS session on the same ranks, ``iterations`` iterations of: pull,
forward (``--forward-only``) or forward + backward + push, clock (sent with the next pull,
``PSWorker.pull_in_order(clock=True)``).

Orderings (:mod:`mlfabric.ps.policies.ordered`):

* ``none``: the runtime's default pull, one flat reply; the forward starts when the whole
  model is in (no enforced order, no overlap).
* ``random``: per-tensor replies in a fresh random order per pull and worker, forward
  pre-hooks overlapping (:class:`mlfabric.ps.overlap.ParameterGate`): TicTac's baseline,
  the arbitrary order of a sender that enforces none.
* ``tio`` / ``tao``: per-tensor replies in TIO's / TAO's priority order
  (:mod:`mlfabric.order.heuristics`), computed once from the model's forward DAG (``--dag
  eager``, the default: with the program-order edges of the eager PyTorch that runs it;
  ``dataflow``: the paper's executor, docs/tictac.md decision 17); TAO's
  oracle is the emulated device times below plus transfer times at the worker's share of
  the rate (``rate / workers x 1448/1514``, the TCP payload of an Ethernet frame).

**The emulated device.** The paper's compute runs on an accelerator; this machine's CPU is
shared by every rank. By default (``--device emulated``) each leaf module's forward runs for
real (on the small ``--batch``) and on an emulated accelerator
(:class:`mlfabric.ps.overlap.ParameterGate`: a stream the host launches ops into) for its
*device time*: the op's traced CPU minimum (:func:`mlfabric.order.oracle.trace_compute`, in
this process before the launch) times one factor, chosen so that the forward's device time
equals the transfer time of the model at the worker's share of the rate (training: forward +
backward, the backward a single pad of ``backward_factor`` x the forward). That makes S (eq.
4) about 1, as the paper picks batch sizes for S > 0.9. ``--device cpu`` runs the real
compute only. ``--pace`` (auto: emulated forward passes): on an emulated star, the server paces
each worker's ordered answer at its share of its NIC (:func:`mlfabric.ps.policies.ordered.pace_fairly`);
``none``'s flat answers are never paced.

**Figures** (per ordering; timestamps on CLOCK_MONOTONIC, which local and emulated ranks
share): the *step* of iteration k is from the first worker's pull request to the last
worker's end of iteration (forward, or push); ``steps_per_s`` = timed iterations / their
span; ``p50_step_s`` / ``p95_step_s`` over the timed steps; ``median_E``: E (eq. 3) of each
worker's measured trace (:func:`mlfabric.order.metrics.trace_efficiency`: compute spans from
the hooks, transfers from arrivals; for ``none`` the one flat transfer from request to
arrival); ``straggler_effect`` (§6.3): per iteration, the longest time a worker waited for
the slowest one (last end - its end) over the step, averaged. ``simulated_makespan_s``: the
same ordering simulated (:func:`mlfabric.order.metrics.simulate`, on the eager DAG) under
the oracle traced in this run (per-op minimum of the hooks' spans): per iteration, each
worker with the order it received at its measured rate in that iteration, the slowest;
median over iterations (``sim_over_emulated``: over ``makespan_s``, the slowest worker's
first byte to end of forward, median). ``simulated_even_share_s``: every worker at the
median measured rate instead (for ``random``, the mean over draws of the slowest of
``workers`` random orders): the prediction before the run knows how the NIC was shared.
``r2_E_vs_step``
(Fig. 7): how well E predicts the normalised step time (a worker's makespan over its trace's
eq. 1 upper bound), the R^2 of a linear fit over every timed (worker, iteration) of the
per-tensor orderings pooled (``r2_by_ordering``: each alone; ``r2_E_vs_makespan``: the raw
makespan in seconds); the samples are in the JSON.

Exercise it with ``.venv/bin/python -m pytest tests/local/test_bench_tictac.py -q``.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mlfabric.bench.procs import LaunchConfig, check_choices, report, run_ranks

__all__ = ["DEVICES", "ORDERINGS", "TicTacBenchConfig", "TicTacBenchError", "TicTacBenchResult", "TicTacPlan",
           "plan", "render_table", "run_on_star", "run_tictac_bench"]

ORDERINGS = ("none", "random", "tio", "tao")
DEVICES = ("emulated", "cpu")
#: Whether the server paces ordered answers at equal shares of its NIC
#: (``PSConfig.pace_ordered_pulls``): ``auto`` paces forward passes and not training, on the
#: emulator (docs/tictac.md decision 16 has the figures both ways).
PACING = ("auto", "on", "off")
MODEL = "model"
LR = 0.01
#: The synthetic batch per model when none is given: the largest power of two (up to 8) whose
#: forward takes at most ~2 ms of this CPU, so that four workers' hosts keep up with their
#: emulated devices on two cores (inception at 8: 11.5 ms, and 330 late launches in 110
#: iterations), while each op's traced time is its compute more than its dispatch: at batch 1
#: the VGG-like model's ops cost 6-73 us and its classifier, which follows the last transfer,
#: 11% of the forward (6% at batch 8), which capped its E near 0.9 (docs/tictac.md decision 14).
DEFAULT_BATCH = {"vgg": 8, "alexnet": 8}
#: Worker 0 reports progress at most this often: each report wakes the launcher, one more
#: process on the shared cores while the ranks are timed.
PROGRESS_EVERY_S = 0.5
#: A TCP payload's share of an Ethernet frame (1448 of 1514 bytes): what a shaped NIC carries.
TCP_PAYLOAD_SHARE = 1448 / 1514
#: Random orders simulated per draw of the slowest of ``workers`` (the ``random`` prediction).
RANDOM_DRAWS = 200


class TicTacBenchError(RuntimeError):
    """The benchmark could not run, or a worker's model or trace was inconsistent."""


@dataclass(frozen=True, kw_only=True)
class TicTacBenchConfig:
    """See the module docstring. ``iterations`` per ordering, the first ``warmup`` not counted."""

    model: str = "inception"
    width: int = 1
    batch: int | None = None  # None: the model's DEFAULT_BATCH
    workers: int = 4
    orderings: tuple[str, ...] = ORDERINGS
    forward_only: bool = False
    iterations: int = 50
    warmup: int = 5
    emulate: bool = False
    rate_bps: float = 1e9
    device: str = "emulated"
    dag: str = "eager"
    pace: str = "auto"
    backward_factor: float = 2.0
    transport: str = "tcp"
    seed: int = 0
    timeout_s: float = 1800.0
    ps_timeout_s: float = 120.0
    chrome_dir: str | None = None
    #: Iterations per worker kept whole for the Chrome traces (the last timed ones).
    chrome_iterations: int = 3

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS
        from mlfabric.order.dag import EXECUTORS  # dag: the DAG TIO and TAO are computed on, as that executor runs it
        from mlfabric.order.models import MODELS

        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(sorted(MODELS))}")
        check_choices(list(self.orderings), ORDERINGS, "orderings", "ordering")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.dag not in EXECUTORS:
            raise ValueError(f"unknown dag {self.dag!r}; choose one of {', '.join(EXECUTORS)}")
        if self.pace not in PACING:
            raise ValueError(f"unknown pace {self.pace!r}; choose one of {', '.join(PACING)}")
        if self.pace == "on" and not self.emulate:
            raise ValueError("pace on needs --emulate: pacing needs the NIC rate that the emulator gives the ranks "
                             "(local processes share loopback)")
        if self.batch is None:
            object.__setattr__(self, "batch", DEFAULT_BATCH.get(self.model, 1))
        if self.workers < 1 or self.width < 1 or self.batch < 1:
            raise ValueError(f"workers, width and batch must be >= 1, got {self.workers}, {self.width}, {self.batch}")
        if self.iterations < 2 or not 0 <= self.warmup < self.iterations - 1:
            raise ValueError(f"need iterations >= 2 and 0 <= warmup < iterations - 1, got {self.iterations}, "
                             f"{self.warmup}")
        if not self.rate_bps >= 8000 or self.backward_factor < 0:
            raise ValueError(f"rate must be >= 8 kbit/s and backward_factor >= 0, got {self.rate_bps}, "
                             f"{self.backward_factor}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if not (self.timeout_s > 0 and self.ps_timeout_s > 0):
            raise ValueError("timeout_s and ps_timeout_s must be positive")

    @property
    def paced(self) -> bool:
        """Whether the server paces the ordered answers (``pace``; auto: emulated forward
        passes, the only runs whose ranks know their NIC's rate)."""
        return self.forward_only and self.emulate if self.pace == "auto" else self.pace == "on"

    @property
    def share_bytes_per_s(self) -> float:
        """The payload rate one worker gets when all pull at once through the server's NIC."""
        return self.rate_bps / 8 * TCP_PAYLOAD_SHARE / self.workers


# --------------------------------------------------------------------------- the plan (parent)


@dataclass(frozen=True, kw_only=True)
class TicTacPlan:
    """What the parent computes before the launch and every rank receives."""

    node_names: dict[str, list[str]]          # module -> DAG node names of its calls
    device_time: dict[str, float]             # DAG node -> padded forward time (empty: --device cpu)
    cpu_time: dict[str, float]                # DAG node -> traced CPU minimum
    backward_time: float                      # the backward's pad (training)
    transfer_time: dict[str, float]           # recv -> bytes at the worker's share of the rate
    priorities: dict[str, dict[str, int]]     # "tio"/"tao" -> parameter -> priority
    model_bytes: int
    speedup_S: float                          # eq. 4 under the planning oracle


def plan(config: TicTacBenchConfig) -> TicTacPlan:
    """Trace the model's forward DAG, size the device times (module docstring), compute TIO and TAO."""
    from mlfabric.order import TimeOracle, bounds, forward_dag, speedup, tao, tio, trace_compute, transfer_times
    from mlfabric.order.models import build, param_bytes
    from mlfabric.ps.overlap import call_names

    model, x = build(config.model, seed=config.seed, batch=config.batch, width=config.width)
    md = forward_dag(model, x)
    dag = md.dag
    cpu = trace_compute(md, model, x, iterations=10, warmup=2).minimum()
    names = call_names(md.graph_module)
    module_nodes = {n for calls in names.values() for n in calls}
    transfer = transfer_times(dag, config.share_bytes_per_s)
    total_transfer = math.fsum(transfer.values())
    device: dict[str, float] = {}
    backward = 0.0
    if config.device == "emulated":
        forward_target = total_transfer / (1.0 if config.forward_only else 1.0 + config.backward_factor)
        device = emulated_device_times(cpu, module_nodes, forward_target)
        backward = 0.0 if config.forward_only else config.backward_factor * forward_target
    compute = {n: device.get(n, cpu[n]) for n in dag.computes}
    dag = dag.as_run_by(config.dag)
    oracle = TimeOracle.combine(dag, compute, transfer)
    b = bounds(dag, oracle)
    by_param = {"tio": tio(dag), "tao": tao(dag, oracle)}
    priorities = {k: pr.by_parameter(dag) for k, pr in by_param.items()}
    return TicTacPlan(node_names=names, device_time=device, cpu_time=cpu, backward_time=backward,
                      transfer_time=transfer, priorities=priorities, model_bytes=param_bytes(model),
                      speedup_S=speedup(b))


def emulated_device_times(cpu: dict[str, float], module_nodes: set[str], forward_s: float) -> dict[str, float]:
    """Device time per module call: its traced CPU minimum times one factor, so that the
    forward (the calls outside modules at their CPU time) lasts ``forward_s``."""
    others = math.fsum(t for n, t in cpu.items() if n not in module_nodes)
    padded = math.fsum(cpu[n] for n in module_nodes)
    factor = max(forward_s - others, 0.0) / padded
    return {n: cpu[n] * factor for n in module_nodes}


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _Iteration:
    requested: float
    first_byte: float | None    # the server's header arrived (per-tensor pulls)
    forward_end: float
    end: float                  # forward (forward only) or push done
    efficiency: float | None
    makespan: float             # the worker's trace: first byte (or request) to end of forward
    upper: float | None         # eq. 1's bound of that trace (compute + transfers, serialised)
    channel_s: float            # first byte to last arrival (per-tensor pulls)
    order: tuple[str, ...]      # the recvs in the order they arrived (per-tensor pulls)
    waited_s: float             # pre-hook waits
    reordered: int
    host_late: int
    checksum: float             # sum of the model's parameters as pulled (the same on every worker)


@dataclass(frozen=True, kw_only=True)
class _WorkerRecord:
    worker: int
    iterations: list[_Iteration]
    op_minimum: dict[str, float]            # per DAG node, min over timed iterations of its span
    initial_checksum: float
    traces: list[Any]                        # the last few timed iterations' Trace


def _rank_main(config: TicTacBenchConfig, the_plan: TicTacPlan) -> Any:
    import mlfabric.ps

    job = mlfabric.ps.init(servers=1, consistency="bsp", transport=config.transport, timeout=config.ps_timeout_s,
                           seed=config.seed, pace_ordered_pulls=config.paced)
    try:
        out = []
        for i, ordering in enumerate(config.orderings):
            session = job.session(i + 1)
            if session.role == "server":
                out.append(session.serve().as_dict())
            else:
                out.append(_work(session.worker, config, the_plan, ordering))
                session.leave()
        return out
    finally:
        job.close()


def _work(worker: Any, config: TicTacBenchConfig, the_plan: TicTacPlan, ordering: str) -> _WorkerRecord:
    """The iterations of one ordering. The loop only pulls, computes, pushes and clocks (every
    step in it delays the next pull, hence every worker under BSP); traces and E are made
    from what it kept afterwards."""
    import torch
    from torch.nn.utils import vector_to_parameters

    from mlfabric.ps.overlap import ParameterGate, pad_to

    torch.set_num_threads(1)
    model, (x,) = build_model(config)
    params = list(model.parameters())
    initial = _checksum(params)
    worker.init_model(MODEL, model, lr=LR, priorities=the_plan.priorities.get(ordering))
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    reported = 0.0
    gate = ParameterGate(model, node_names=the_plan.node_names, device_time=the_plan.device_time)
    kept: list[tuple[float, float, float, Any, list[Any], list[Any], float, int]] = []
    for k in range(config.iterations):
        requested = time.monotonic()
        # The previous iteration's clock goes with this pull (PSWorker.pull_in_order says why).
        if ordering == "none":
            worker.pull_flat(MODEL, out=flat, clock=k > 0)
            with torch.no_grad():
                vector_to_parameters(flat, params)
            pulled: Any = time.monotonic()
            gate.attach(None)
        else:
            pulled = worker.pull_in_order(MODEL, model, order="random" if ordering == "random" else "priority",
                                          clock=k > 0)
            gate.attach(pulled)
        if config.forward_only:
            with torch.no_grad():
                model(x)
            forward_end = time.monotonic()
        else:
            out = model(x)
            forward_end = time.monotonic()
            out.square().mean().backward()
            pad_to(forward_end, the_plan.backward_time)
        checksum = _checksum(params)
        if not config.forward_only:
            worker.push(MODEL, model)
            model.zero_grad(set_to_none=False)
        end = time.monotonic()
        kept.append((requested, forward_end, end, pulled, gate.spans, gate.waits, checksum, gate.host_late))
        if worker.index == 0 and (end - reported > PROGRESS_EVERY_S or k + 1 == config.iterations):
            report((ordering, k + 1))
            reported = end
    worker.clock()
    gate.remove()
    return _record(worker.index, config, ordering, kept, initial)


def _checksum(params: list[Any]) -> float:
    """The parameters' sum, per tensor in float32 (the same values give the same sum): the
    correctness check, taken inside each timed iteration, so kept cheap (flattening the model
    to one float64 vector cost 0.4 ms at the median and 1.4 ms at p95 of the VGG-like model's)."""
    import torch

    with torch.no_grad():
        return sum(float(p.sum()) for p in params)


def build_model(config: TicTacBenchConfig) -> tuple[Any, tuple[Any, ...]]:
    from mlfabric.order.models import build

    return build(config.model, seed=config.seed, batch=config.batch, width=config.width)


def _record(index: int, config: TicTacBenchConfig, ordering: str, kept: list[Any],
            initial_checksum: float) -> _WorkerRecord:
    from mlfabric.order.metrics import trace_bounds, trace_efficiency
    from mlfabric.order.trace import Trace

    iterations: list[_Iteration] = []
    minimum: dict[str, float] = {}
    traces = []
    for k, (requested, forward_end, end, pulled, spans, waits, checksum, host_late) in enumerate(kept):
        if isinstance(pulled, float):  # a flat pull: one transfer, from the request to the whole model
            transfers, first, channel, reordered = [("recv:model", requested, pulled)], None, 0.0, 0
            order: tuple[str, ...] = ()
        else:
            pulled.join()
            transfers, first, reordered = pulled.transfer_spans(), pulled.begins.get(0), pulled.reordered
            channel = max(a.at for a in pulled.arrivals) - first
            order = tuple(dict.fromkeys(name for name, _, _ in transfers))
        trace = Trace.of(spans, transfers, worker=index, iteration=k, ordering=ordering)
        forward = forward_part(trace, forward_end)
        try:
            efficiency: float | None = trace_efficiency(forward)
        except ValueError:
            efficiency = None
        upper = trace_bounds(forward).upper
        iterations.append(_Iteration(
            requested=requested, first_byte=first, forward_end=forward_end, end=end, efficiency=efficiency,
            makespan=forward.makespan, upper=upper, channel_s=channel, order=order,
            waited_s=sum(e - s for _, s, e in waits),
            reordered=reordered, host_late=host_late, checksum=checksum))
        if k >= config.warmup:
            for name, s, e in trace.compute:
                minimum[name] = min(minimum.get(name, math.inf), e - s)
            if k >= config.iterations - config.chrome_iterations:
                traces.append(trace)
    return _WorkerRecord(worker=index, iterations=iterations, op_minimum=minimum, traces=traces,
                         initial_checksum=initial_checksum)


def forward_part(trace: Any, forward_end: float) -> Any:
    """The forward's part of an iteration's trace (its compute spans end by ``forward_end``)."""
    from mlfabric.order.trace import Trace

    return Trace.of([s for s in trace.compute if s[2] <= forward_end + 1e-9], trace.transfers, **trace.meta)


# --------------------------------------------------------------------------- results (parent)


@dataclass(frozen=True, kw_only=True)
class OrderingResult:
    ordering: str
    steps_per_s: float
    p50_step_s: float
    p95_step_s: float
    median_E: float | None
    straggler_effect: float
    makespan_s: float
    simulated_makespan_s: float | None
    simulated_even_share_s: float | None
    waited_s: float
    reordered: int
    host_late: int
    correct: bool
    steps_s: list[float] = field(repr=False)
    #: (E, makespan s, eq. 1 upper bound s) per timed (worker, iteration)
    samples: list[tuple[float, float, float]] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("steps_s", "samples")}
        out["p95_over_p50"] = self.p95_step_s / self.p50_step_s
        for key, value in (("sim_over_emulated", self.simulated_makespan_s),
                           ("even_share_sim_over_emulated", self.simulated_even_share_s)):
            out[key] = None if value is None else value / self.makespan_s
        return out


@dataclass(frozen=True, kw_only=True)
class TicTacBenchResult:
    config: TicTacBenchConfig
    plan: TicTacPlan
    results: tuple[OrderingResult, ...]
    #: Fig. 7: R^2 of the linear fit of normalised step time (makespan / eq. 1's upper bound)
    #: on E, over the per-tensor orderings' samples pooled, and per ordering; and of the raw
    #: makespan on E.
    r2_E_vs_step: float | None
    r2_by_ordering: dict[str, float | None]
    r2_E_vs_makespan: float | None
    metadata: dict[str, Any]

    def by(self, ordering: str) -> OrderingResult:
        return next(r for r in self.results if r.ordering == ordering)

    def speedups(self) -> dict[str, dict[str, float]]:
        """steps/s of each ordering over none's and random's (where they ran)."""
        out: dict[str, dict[str, float]] = {}
        for base in ("none", "random"):
            if base in self.config.orderings:
                ref = self.by(base).steps_per_s
                out[f"vs_{base}"] = {r.ordering: r.steps_per_s / ref for r in self.results}
        return out

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "benchmark": "tictac", "command": self.metadata.get("command"), "date": self.metadata.get("date"),
            "machine": self.metadata.get("machine"), "metadata": self.metadata,
            "config": asdict(self.config),
            "plan": {"model_bytes": p.model_bytes, "S": p.speedup_S, "transfer_s": math.fsum(p.transfer_time.values()),
                     "forward_device_s": math.fsum(p.device_time.values()) or None,
                     "forward_cpu_s": math.fsum(p.cpu_time.values()), "backward_device_s": p.backward_time,
                     "tio_order": sorted(p.priorities["tio"], key=p.priorities["tio"].get),
                     "tao_order": sorted(p.priorities["tao"], key=p.priorities["tao"].get)},
            "results": [r.to_dict() for r in self.results],
            "speedup": self.speedups(),
            "r2_E_vs_step": self.r2_E_vs_step, "r2_by_ordering": self.r2_by_ordering,
            "r2_E_vs_makespan": self.r2_E_vs_makespan,
            "steps_s": {r.ordering: r.steps_s for r in self.results},
            "samples": {r.ordering: {"E": [round(e, 6) for e, _, _ in r.samples],
                                     "makespan_s": [round(t, 6) for _, t, _ in r.samples],
                                     "upper_s": [round(u, 6) for _, _, u in r.samples]} for r in self.results},
        }


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def r_squared(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """R^2 of the least-squares line y = a + b x (None with fewer than 3 points or no spread)."""
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy * sxy / (sxx * syy)


def _simulated(config: TicTacBenchConfig, the_plan: TicTacPlan, ordering: str, records: list[_WorkerRecord],
               timed: range) -> tuple[float | None, float | None]:
    """The ordering's makespan simulated on the eager DAG (the workers run it eagerly, whatever
    DAG the orders were computed on) with the per-op minimum traced in this run, two ways:
    every worker's iteration at that worker's measured rate in that iteration, with the order
    it received, the slowest per iteration, median over iterations (what the run is compared
    with: the shares of the server's NIC differ per worker when unpaced); and every worker at
    the median measured rate (one even share), with the order the ordering gives (random:
    the mean over draws of the slowest of ``workers`` random orders)."""
    from mlfabric.order import TimeOracle, forward_dag, simulate

    if ordering == "none":
        return None, None
    model, x = build_model(config)
    dag = forward_dag(model, x).dag.in_program_order()
    compute = {n: min((r.op_minimum[n] for r in records if n in r.op_minimum), default=the_plan.cpu_time[n])
               for n in dag.computes}

    def makespan(order: Sequence[str], rate: float) -> float:
        oracle = TimeOracle.combine(dag, compute, {r: dag.node(r).size_bytes / rate for r in dag.recvs})
        return simulate(dag, oracle, order).makespan

    slowest = []
    for k in timed:
        its = [r.iterations[k] for r in records if r.iterations[k].channel_s > 0]
        if its:
            slowest.append(max(makespan(i.order, the_plan.model_bytes / i.channel_s) for i in its))
    rates = [the_plan.model_bytes / r.iterations[k].channel_s for r in records for k in timed
             if r.iterations[k].channel_s > 0]
    if not rates:
        return None, None
    even = statistics.median(rates)
    if ordering in ("tio", "tao"):
        prio = the_plan.priorities[ordering]
        idx = {r: i for i, r in enumerate(dag.recvs)}
        even_share = makespan(sorted(dag.recvs, key=lambda r: (prio[dag.node(r).param], idx[r])), even)
    else:
        rng = random.Random(config.seed)
        draws = []
        for _ in range(RANDOM_DRAWS):
            spans = []
            for _w in range(config.workers):
                order = list(dag.recvs)
                rng.shuffle(order)
                spans.append(makespan(order, even))
            draws.append(max(spans))
        even_share = statistics.fmean(draws)
    return statistics.median(slowest), even_share


def summarize(config: TicTacBenchConfig, the_plan: TicTacPlan, ordering: str,
              records: list[_WorkerRecord]) -> OrderingResult:
    timed = range(config.warmup, config.iterations)
    steps, stragglers = [], []
    for k in timed:
        its = [r.iterations[k] for r in records]
        last = max(i.end for i in its)
        step = last - min(i.requested for i in its)
        steps.append(step)
        stragglers.append(max(last - i.end for i in its) / step)
    first = min(r.iterations[config.warmup].requested for r in records)
    span = max(r.iterations[-1].end for r in records) - first
    samples = [(r.iterations[k].efficiency, r.iterations[k].makespan, r.iterations[k].upper) for r in records
               for k in timed if r.iterations[k].efficiency is not None]
    makespans = [max(r.iterations[k].makespan for r in records) for k in timed]
    simulated, even_share = _simulated(config, the_plan, ordering, records, timed)
    return OrderingResult(
        ordering=ordering, steps_per_s=len(timed) / span, p50_step_s=statistics.median(steps),
        p95_step_s=_percentile(steps, 0.95),
        median_E=statistics.median(s[0] for s in samples) if samples else None,
        straggler_effect=statistics.fmean(stragglers), makespan_s=statistics.median(makespans),
        simulated_makespan_s=simulated, simulated_even_share_s=even_share,
        waited_s=statistics.fmean(r.iterations[k].waited_s for r in records for k in timed),
        reordered=sum(i.reordered for r in records for i in r.iterations),
        host_late=sum(r.iterations[-1].host_late for r in records), correct=_consistent(config, records),
        steps_s=steps, samples=samples)


def _consistent(config: TicTacBenchConfig, records: list[_WorkerRecord]) -> bool:
    """BSP hands every worker the same model each iteration; forward only, the initial one."""
    for k in range(config.iterations):
        sums = {r.iterations[k].checksum for r in records}
        if len(sums) != 1 or (config.forward_only and sums != {records[0].initial_checksum}):
            return False
    return True


def collect_metadata(config: Any, argv: Sequence[str] | None, *, hosts: int | None = None) -> dict[str, Any]:
    """Date, command, machine of a run of ``config`` (a benchmark's: ``workers``, ``emulate``,
    ``rate_bps``) on ``hosts`` hosts (default: ``workers`` + the server)."""
    import torch

    cores = os.cpu_count()
    where = (f"emulated star:n={config.workers + 1 if hosts is None else hosts} at {config.rate_bps / 1e6:g} Mbit/s per NIC (netns + veth + htb)"
             if config.emulate else "local processes on loopback (no shaping)")
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(argv if argv is not None else sys.argv),
            "machine": f"{cores}-core {platform.machine()} Linux VM, {where}",
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "loadavg_at_start": list(os.getloadavg())}


def run_on_star(fn: Callable[..., Any], args: tuple[Any, ...], *, hosts: int, emulate: bool, rate_bps: float,
                timeout_s: float, command: str, on_progress: Callable[..., None] | None = None,
                capture_output: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``hosts`` ranks: local processes, or with ``emulate`` one per host
    of an emulated star at ``rate_bps`` (root; ``command`` names the benchmark in the
    error). Each rank's ``report(payload)`` reaches ``on_progress(*payload)``."""
    def on_report(rank: int, payload: Any) -> None:
        if on_progress is not None:
            on_progress(*payload)

    if emulate:
        from mlfabric.emu.cmd import EmuUnavailableError, have_root
        from mlfabric.emu.launcher import emulated_launch

        if not have_root():
            raise EmuUnavailableError(f"{command} --emulate needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN): run it "
                                      "under sudo, or drop --emulate")
        with emulated_launch(f"star:n={hosts}", rate_bps, timeout_s=timeout_s,
                             capture_output=capture_output) as launch:
            return run_ranks(fn, config=launch, args=args, on_report=on_report)
    launch = LaunchConfig(world_size=hosts, timeout_s=timeout_s, capture_output=capture_output)
    return run_ranks(fn, config=launch, args=args, on_report=on_report)


def run_tictac_bench(config: TicTacBenchConfig, *, argv: Sequence[str] | None = None,
                     on_progress: Callable[[str, int], None] | None = None,
                     capture_output: bool = False) -> TicTacBenchResult:
    """Plan, launch (locally or on the emulator: root), summarize; Chrome traces to ``chrome_dir``."""
    metadata = collect_metadata(config, argv)
    the_plan = plan(config)
    world = 1 + config.workers
    records = run_on_star(_rank_main, (config, the_plan), hosts=world, emulate=config.emulate,
                          rate_bps=config.rate_bps, timeout_s=config.timeout_s, command="mlfabric bench tictac",
                          on_progress=on_progress, capture_output=capture_output)
    metadata["loadavg_at_end"] = list(os.getloadavg())
    results = []
    for i, ordering in enumerate(config.orderings):
        workers: list[_WorkerRecord] = [records[rank][i] for rank in range(1, world)]
        results.append(summarize(config, the_plan, ordering, workers))
        if config.chrome_dir:
            write_traces(Path(config.chrome_dir) / f"tictac-{config.model}-{ordering}.json", workers)
    pooled = [s for r in results if r.ordering != "none" for s in r.samples]
    return TicTacBenchResult(config=config, plan=the_plan, results=tuple(results), r2_E_vs_step=_fig7(pooled),
                             r2_by_ordering={r.ordering: _fig7(r.samples) for r in results},
                             r2_E_vs_makespan=r_squared([e for e, _, _ in pooled], [t for _, t, _ in pooled]),
                             metadata=metadata)


def _fig7(samples: Sequence[tuple[float, float, float]]) -> float | None:
    """R^2 of normalised step time (makespan / upper bound) on E (TicTac Fig. 7)."""
    return r_squared([e for e, _, _ in samples], [t / u for _, t, u in samples])


def write_traces(path: Path, records: list[_WorkerRecord]) -> Path:
    """The kept iterations of every worker as one Chrome/Perfetto file (a process per worker)."""
    import json

    from mlfabric.order.trace import to_chrome

    path.parent.mkdir(parents=True, exist_ok=True)
    origin = min((t.start for r in records for t in r.traces), default=0.0)
    events: list[dict[str, Any]] = []
    for r in records:
        for t in r.traces:
            events += to_chrome(t, process=f"worker {r.worker}", pid=r.worker, origin=origin)["traceEvents"]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


# --------------------------------------------------------------------------- presentation


def render_table(result: TicTacBenchResult) -> Any:
    from rich import box
    from rich.table import Table

    c = result.config
    where = f"emulated at {c.rate_bps / 1e6:g} Mbit/s" if c.emulate else "local"
    tab = Table(title=f"tictac: {c.model} (width {c.width}, batch {c.batch}), {c.workers} workers + 1 server, "
                      f"{'forward' if c.forward_only else 'training'}, {where}, device {c.device}, "
                      f"S = {result.plan.speedup_S:.2f}",
                caption=f"{len(range(c.warmup, c.iterations))} timed iterations per ordering; straggler = max "
                        "wait / step (mean); sim: simulated makespan / measured",
                title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)
    for name in ("ordering", "steps/s", "x none", "x random", "p50 ms", "p95/p50", "E", "straggler", "sim"):
        tab.add_column(name, justify="right" if name != "ordering" else "left", no_wrap=True)
    speed = result.speedups()
    for r in result.results:
        d = r.to_dict()
        tab.add_row(r.ordering, f"{r.steps_per_s:.2f}", _opt(speed.get("vs_none", {}).get(r.ordering)),
                    _opt(speed.get("vs_random", {}).get(r.ordering)), f"{r.p50_step_s * 1e3:.1f}",
                    f"{d['p95_over_p50']:.3f}", _opt(r.median_E), f"{r.straggler_effect:.3f}",
                    _opt(d["sim_over_emulated"]))
    return tab


def _opt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"

