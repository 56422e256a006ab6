"""Timing of the event engine on MLNET-sized parameter-server iterations (``mlfabric bench sim``).

    .venv/bin/python -m mlfabric.sim.bench            # or: mlfabric bench sim [--json PATH|-]

On the 1,024-host k=16 fat-tree with 1:4 oversubscribed ToR uplinks (10 Gbps host links),
workers and servers placed at random, one push+pull iteration (BSP, no compute) of:

* 800 workers x 50 servers (80,000 flows) and 624 workers x 400 servers (499,200 flows);
* with the per-server barrier (server j pulls once all pushes to j arrived: the default) and
  with a global barrier (a push phase, then a pull phase). The per-server barrier staggers
  the pulls, so flows start and finish at many more distinct instants (40,646 for 624 x 400,
  each a re-solve): ~9 s with the compiled kernel and event loop, minutes without;
* against the issue's targets (wall, one core): 800 x 50 <= 1 s, 624 x 400 <= 10 s;
* side by side, a smaller iteration run by the same engine with the vectorized incremental
  ``FlowNetwork`` and with a from-scratch pure-Python solve per event (``solver="naive"``):
  the ratio is the engine's speed-up from the solver.

Wall time includes building the task graph (reported apart too). Every run also reports the
simulated time, flows, events and the solver's update kinds.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlfabric.topo import parse_topology

from .engine import EngineConfig, run_graph
from .workloads import PSConfig, ps_graph

__all__ = ["EngineBenchConfig", "benchmark_engine", "format_engine_benchmark"]


@dataclass(frozen=True, kw_only=True)
class EngineBenchConfig:
    topology: str = "fat-tree:k=16,oversub=4"
    link_rate_bps: float = 10e9
    model_bytes: float = 100e6
    seed: int = 0
    #: (workers, servers) of the timed iterations.
    sizes: tuple[tuple[int, int], ...] = ((800, 50), (624, 400))
    barriers: tuple[str, ...] = ("server", "global")
    #: Wall-time targets (seconds) of iterations by (workers, servers).
    targets: tuple[tuple[int, int, float], ...] = ((800, 50, 1.0), (624, 400, 10.0))
    #: The side-by-side run with the naive solver (0 workers: skip it).
    naive_workers: int = 300
    naive_servers: int = 20
    max_wall_s: float = 900.0


def _run(topology: Any, ps: PSConfig, config: EngineConfig) -> dict[str, Any]:
    wall0 = time.perf_counter()
    graph = ps_graph(topology, ps, seed=config.seed)
    built = time.perf_counter()
    result = run_graph(graph, topology, config)
    done = time.perf_counter()
    return {
        "workers": ps.workers,
        "servers": ps.servers,
        "barrier": ps.barrier,
        "strategy": ps.strategy,
        "solver": config.solver,
        "flows": result.flows,
        "tasks": graph.n_tasks,
        "events": result.events,
        "solver_updates": result.solver_updates,
        "time_s": result.time_s,
        "build_wall_s": built - wall0,
        "run_wall_s": done - built,
        "wall_s": done - wall0,
    }


def benchmark_engine(config: EngineBenchConfig | None = None, *,
                     on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the engine benchmark; returns its figures as a dict (see the module docstring).
    ``on_step(label)`` is called before each run (a progress display)."""
    step = on_step or (lambda label: None)
    config = config or EngineBenchConfig()
    topology = parse_topology(config.topology, config.link_rate_bps)
    engine = EngineConfig(routing="ecmp", seed=config.seed, max_wall_s=config.max_wall_s)
    runs = []
    targets = {(workers, servers): target for workers, servers, target in config.targets}
    for workers, servers in config.sizes:
        for barrier in config.barriers:
            step(f"{workers} x {servers}, {barrier} barrier")
            ps = PSConfig(workers=workers, servers=servers, model_bytes=config.model_bytes, barrier=barrier)
            run = _run(topology, ps, engine)
            if (workers, servers) in targets:
                run["target_wall_s"] = targets[workers, servers]
                run["target_met"] = run["wall_s"] <= run["target_wall_s"]
            runs.append(run)
    results: dict[str, Any] = {
        "config": {key: getattr(config, key) for key in config.__dataclass_fields__},
        "machine": {"python": sys.version.split()[0], "numpy": np.__version__, "platform": platform.platform()},
        "runs": runs,
    }
    if config.naive_workers:
        ps = PSConfig(workers=config.naive_workers, servers=config.naive_servers, model_bytes=config.model_bytes)
        step(f"{config.naive_workers} x {config.naive_servers}, vectorized solver")
        fast = _run(topology, ps, engine)
        step(f"{config.naive_workers} x {config.naive_servers}, naive solver")
        naive = _run(topology, ps, EngineConfig(routing="ecmp", seed=config.seed, solver="naive",
                                                 max_wall_s=config.max_wall_s))
        results["naive_side_by_side"] = {
            "fast": fast,
            "naive": naive,
            "speedup_wall": naive["run_wall_s"] / fast["run_wall_s"],
            "same_time": bool(abs(naive["time_s"] - fast["time_s"]) <= 1e-9 * fast["time_s"]),
        }
    return results


def format_engine_benchmark(results: dict[str, Any]) -> str:
    lines = [f"event engine: one push+pull iteration (BSP, ECMP) on {results['config']['topology']}"]
    for run in results["runs"]:
        head = f"  {run['workers']:>4} x {run['servers']:<4} {run['barrier']:<6} barrier"
        target = (f"  (target <= {run['target_wall_s']:g}s: {'met' if run['target_met'] else 'MISSED'})"
                  if "target_wall_s" in run else "")
        lines.append(
            f"{head}  {run['flows']:>7} flows  {run['wall_s']:7.3f}s wall (graph {run['build_wall_s']:.3f}s)  "
            f"{run['events']:>6} events  simulated {run['time_s']:.4f}s{target}"
        )
    side = results.get("naive_side_by_side")
    if side:
        fast, naive = side["fast"], side["naive"]
        lines.append(
            f"  naive solver, {fast['workers']} x {fast['servers']} ({fast['flows']} flows, {fast['events']} events): "
            f"{naive['run_wall_s']:.2f}s vs {fast['run_wall_s']:.3f}s, speed-up x{side['speedup_wall']:.0f}, "
            f"same simulated time: {'yes' if side['same_time'] else 'NO'}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    # The figures as JSON: `mlfabric bench sim --json PATH` (or `--json -` for standard output).
    print(format_engine_benchmark(benchmark_engine()))
