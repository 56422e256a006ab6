"""The one call a training script needs: a model's transfer priorities, by parameter name.

    .venv/bin/python -m pytest tests/unit/test_order_dag.py -q -k parameter_priorities

``parameter_priorities(model, example_inputs)`` traces the forward (:func:`forward_dag`),
adds eager PyTorch's program order (:meth:`~mlfabric.order.dag.Dag.in_program_order`; docs/
tictac.md decision 17) unless asked for the paper's dataflow executor, runs TIO (the DAG
alone) or TAO (with the §5 time oracle: this CPU's traced compute, transfers at
``rate_bytes_per_s``), and returns ``{parameter name: priority}``, what
``PSWorker.init_model(..., priorities=...)`` takes. Every worker must register the same.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mlfabric.order.dag import EXECUTORS, forward_dag
from mlfabric.order.heuristics import tao, tio
from mlfabric.order.oracle import measured_oracle

__all__ = ["HEURISTICS", "parameter_priorities"]

HEURISTICS = ("tio", "tao")


def parameter_priorities(model: nn.Module, example_inputs: tuple[Any, ...], *, heuristic: str = "tio",
                         executor: str = "eager", rate_bytes_per_s: float | None = None,
                         iterations: int = 5) -> dict[str, int]:
    """``{parameter name: priority}`` (lower goes first; ties share a number) for ``model``
    run on ``example_inputs`` (module docstring). TAO needs ``rate_bytes_per_s``, the rate a
    worker receives at (its share of the server's NIC); ``iterations`` times its compute."""
    if heuristic not in HEURISTICS:
        raise ValueError(f"unknown heuristic {heuristic!r}; choose one of {', '.join(HEURISTICS)}")
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    if heuristic == "tao" and not (rate_bytes_per_s and rate_bytes_per_s > 0):
        raise ValueError("TAO needs rate_bytes_per_s > 0: the rate each worker receives its parameters at "
                         f"(got {rate_bytes_per_s!r}); TIO needs no rate")
    md = forward_dag(model, tuple(example_inputs))
    dag = md.dag.as_run_by(executor)
    if heuristic == "tio":
        return tio(dag).by_parameter(dag)
    oracle = measured_oracle(md, model, tuple(example_inputs), rate_bytes_per_s=float(rate_bytes_per_s or 0),
                             iterations=iterations)
    return tao(dag, oracle).by_parameter(dag)
