"""TicTac (Hashemi et al., SysML 2019), the pure core: a torch model's DAG -> recv priorities.

    .venv/bin/python -m pytest tests/unit/test_order*.py -q

Modules, one concern each: :mod:`~mlfabric.order.dag` (the worker's DAG from torch.fx),
:mod:`~mlfabric.order.oracle` (Time(op): traced compute, transfer from bytes and rate,
the general oracle), :mod:`~mlfabric.order.heuristics` (Alg. 1 properties, TAO, TIO),
:mod:`~mlfabric.order.metrics` (bounds, E, S, the iteration simulator, exhaustive best and
worst), :mod:`~mlfabric.order.trace` (timelines, Chrome/Perfetto export) and
:mod:`~mlfabric.order.models` (Par-32, Seq-32, Inception-, VGG-, AlexNet-like CNNs);
:mod:`~mlfabric.order.priorities` is the one call a training script needs.
No networking here: enforcing the priorities at the PS sender is the runtime's job
(docs/tictac.md says what is left).
"""

from mlfabric.order.dag import Dag, Kind, ModelDag, Node, dag_from_edges, forward_dag, recv_name, training_dag
from mlfabric.order.heuristics import (Priorities, Properties, before, johnson_before, priorities_from_order, tao,
                                       tio, update_properties)
from mlfabric.order.metrics import (Bounds, Evaluation, bounds, efficiency, evaluate, exhaustive, makespan, simulate,
                                    speedup, trace_bounds, trace_efficiency)
from mlfabric.order.oracle import ComputeTrace, TimeOracle, measured_oracle, trace_compute, transfer_times
from mlfabric.order.priorities import parameter_priorities
from mlfabric.order.trace import Trace, to_chrome, write_chrome

__all__ = [
    "Bounds", "ComputeTrace", "Dag", "Evaluation", "Kind", "ModelDag", "Node", "Priorities", "Properties", "TimeOracle",
    "Trace", "before", "bounds", "dag_from_edges", "efficiency", "evaluate", "exhaustive", "forward_dag",
    "johnson_before", "makespan", "measured_oracle", "parameter_priorities", "priorities_from_order", "recv_name",
    "simulate", "speedup", "tao", "tio", "to_chrome", "trace_bounds", "trace_compute", "trace_efficiency", "training_dag", "transfer_times",
    "update_properties", "write_chrome",
]
