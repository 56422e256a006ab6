"""Flow-level simulator: the schedules mlfabric runs, executed on a topology with max-min sharing.

* :mod:`mlfabric.sim.graph` -- the task graph and :func:`compile_schedules` (schedule IR ->
  graph);
* :mod:`mlfabric.sim.engine` -- the discrete-event engine (flows on a
  :class:`~mlfabric.flow.FlowNetwork`, priority classes, watchdog);
* :mod:`mlfabric.sim.compute` -- compute models: per-worker speeds, stragglers (C1-C3);
* :mod:`mlfabric.sim.workloads` -- collectives, parameter servers (BSP/SSP), MLNET
  aggregation/multicast trees, concurrent jobs;
* :mod:`mlfabric.sim.bench` -- the engine benchmark behind ``mlfabric bench sim``;
* :mod:`mlfabric.sim.bml` -- BML Fig. 5 and GST checks behind ``mlfabric simulate bml``.
* :mod:`mlfabric.sim.mlnet` -- MLNET §4 (trees vs BASELINE, flow priorities) behind
  ``mlfabric simulate mlnet``.

See ``docs/simulator.md``. Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py -q
    mlfabric simulate collective --topology star:n=8 --link 10Gbps --algorithm ring --size 100MB
"""

from .compute import STRAGGLER_PRESETS, ComputeModel, StragglerModel, straggler_preset
from .engine import ROUTINGS, Engine, EngineConfig, SimResult, SimStatus, SimulationStalled, run_graph
from .graph import DELAY, TRANSFER, GraphBuilder, TaskGraph, compile_schedules, merge_graphs
from .workloads import (
    PLACEMENTS,
    PS_STRATEGIES,
    PSConfig,
    collective_graph,
    collective_kind,
    concurrent_ps_graph,
    iteration_times,
    ps_graph,
    ps_placement,
    rack_of,
    ring_closed_form_s,
    simulate_collective,
    simulate_ps,
    tree_parents,
)

__all__ = [
    "DELAY", "PLACEMENTS", "PS_STRATEGIES", "ROUTINGS", "STRAGGLER_PRESETS", "TRANSFER",
    "ComputeModel", "Engine", "EngineConfig", "GraphBuilder", "PSConfig", "SimResult",
    "SimStatus", "SimulationStalled", "StragglerModel", "TaskGraph", "collective_graph", "collective_kind",
    "compile_schedules", "concurrent_ps_graph", "iteration_times", "merge_graphs", "ps_graph",
    "ps_placement", "rack_of", "ring_closed_form_s", "run_graph", "simulate_collective",
    "simulate_ps", "straggler_preset", "tree_parents",
]
