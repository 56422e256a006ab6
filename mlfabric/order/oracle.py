"""The time oracle Time(op) of TicTac §3 and §5: per-op compute times and transfer times.

    .venv/bin/python -m pytest tests/unit/test_order_dag.py -q -k oracle

* :meth:`TimeOracle.general`: eq. 6, compute 0 and transfer 1 (what TIO uses).
* :meth:`TimeOracle.from_costs`: the ``cost`` written on a hand-made DAG's nodes.
* :func:`trace_compute`: runs a :class:`~mlfabric.order.dag.ModelDag`'s fx graph node by node
  in an ``fx.Interpreter`` on the CPU, ``iterations`` times after ``warmup`` runs, and records
  each op's (start, end); :func:`measured_oracle` takes the *minimum* over iterations per op
  (§5: "the minimum of all measured time for a given op is chosen") and adds transfer times.
* :func:`transfer_times`: ``latency + size_bytes / rate`` per recv; the paper's oracle assumes
  a dedicated resource (footnote 3: times add up), so a transfer is its bytes at the
  channel's rate, not a share of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import fx, nn

from mlfabric.order.dag import Dag, Kind, ModelDag
from mlfabric.order.trace import Trace

__all__ = ["ComputeTrace", "TimeOracle", "measured_oracle", "trace_compute", "transfer_times"]


@dataclass(frozen=True)
class TimeOracle:
    """Time(op) in seconds (or abstract units) for every node of one DAG."""

    times: Mapping[str, float]

    def __call__(self, name: str) -> float:
        return self.times[name]

    def covers(self, dag: Dag) -> None:
        missing = [n for n in dag.names if n not in self.times]
        if missing:
            raise KeyError(f"TimeOracle: no time for {len(missing)} node(s), e.g. {missing[:3]}")
        neg = [n for n in dag.names if self.times[n] < 0]
        if neg:
            raise ValueError(f"TimeOracle: negative time for {neg[:3]}")

    @staticmethod
    def general(dag: Dag) -> TimeOracle:
        """Eq. 6: 0 for every compute op, 1 for every recv."""
        return TimeOracle({n.name: (1.0 if n.kind is Kind.RECV else 0.0) for n in dag})

    @staticmethod
    def from_costs(dag: Dag) -> TimeOracle:
        return TimeOracle({n.name: float(n.cost) for n in dag})

    @staticmethod
    def combine(dag: Dag, compute: Mapping[str, float], transfer: Mapping[str, float]) -> TimeOracle:
        times = {n.name: float((transfer if n.kind is Kind.RECV else compute)[n.name]) for n in dag}
        return TimeOracle(times)

    def scaled(self, compute: float = 1.0, transfer: float = 1.0, *, dag: Dag) -> TimeOracle:
        """Compute times x ``compute``, transfer times x ``transfer`` (e.g. to reach a target S)."""
        return TimeOracle({n.name: self.times[n.name] * (transfer if n.kind is Kind.RECV else compute) for n in dag})


def transfer_times(dag: Dag, rate_bytes_per_s: float, latency_s: float = 0.0) -> dict[str, float]:
    """Time of every recv: ``latency_s + size_bytes / rate_bytes_per_s``."""
    if rate_bytes_per_s <= 0:
        raise ValueError(f"transfer_times: rate must be > 0 bytes/s, got {rate_bytes_per_s}")
    return {r: latency_s + dag.node(r).size_bytes / rate_bytes_per_s for r in dag.recvs}


@dataclass(frozen=True)
class ComputeTrace:
    """Per-iteration (op, start, end) of every compute op, in seconds from the iteration start."""

    iterations: tuple[Trace, ...]

    def minimum(self) -> dict[str, float]:
        """§5: per op, the minimum over iterations of its measured time."""
        best: dict[str, float] = {}
        for tr in self.iterations:
            for name, d in tr.durations().items():
                best[name] = min(best.get(name, d), d)
        return best


class _TimingInterpreter(fx.Interpreter):
    """Runs a GraphModule node by node, recording each DAG compute node's wall time."""

    def __init__(self, gm: fx.GraphModule, timed: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.timed = timed
        self.spans: list[tuple[str, float, float]] = []
        self.t0 = 0.0

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.timed:
            return super().run_node(n)
        s = time.perf_counter()
        out = super().run_node(n)
        e = time.perf_counter()
        self.spans.append((n.name, s - self.t0, e - self.t0))
        return out


def trace_compute(md: ModelDag, model: nn.Module, inputs: tuple[torch.Tensor, ...], *, iterations: int = 5,
                  warmup: int = 1) -> ComputeTrace:
    """Time every compute op of ``md`` over ``iterations`` runs (after ``warmup`` untimed runs).

    Runs under ``torch.no_grad``: the training graph already contains its backward ops, and
    the forward graph's timing should not include autograd bookkeeping a PS worker running
    inference would not do either. CPU only: no device synchronisation is needed per op."""
    if iterations < 1:
        raise ValueError("trace_compute: iterations must be >= 1")
    timed = set(md.dag.computes)
    args = md.args(model, inputs)
    traces: list[Trace] = []
    with torch.no_grad():
        for i in range(warmup + iterations):
            interp = _TimingInterpreter(md.graph_module, timed)
            interp.t0 = time.perf_counter()
            interp.run(*args)
            if i >= warmup:
                traces.append(Trace.of(interp.spans, (), iteration=i - warmup))
    return ComputeTrace(tuple(traces))


def measured_oracle(md: ModelDag, model: nn.Module, inputs: tuple[torch.Tensor, ...], *, rate_bytes_per_s: float,
                    latency_s: float = 0.0, iterations: int = 5, warmup: int = 1) -> TimeOracle:
    """The §5 oracle: traced compute minimum per op plus transfer times at ``rate_bytes_per_s``."""
    compute = trace_compute(md, model, inputs, iterations=iterations, warmup=warmup).minimum()
    return TimeOracle.combine(md.dag, compute, transfer_times(md.dag, rate_bytes_per_s, latency_s))
