"""The engine's reference answers: named simulator cases, recorded once, compared after every change.

A change to the event engine (``mlfabric.sim.engine``) or the solver (``mlfabric.flow``)
must give the same simulated times as before (issue #37: 1e-9 relative). This module names
the cases (collectives of every algorithm on fat-trees, BCube, oversubscribed racks, with
ECMP collisions, spraying, latency, stragglers, host links; parameter servers with trees,
barriers, SSP and priority classes; the issue's large rings), records what an engine
answers for them (makespan, per-job times, every task's finish time for the small ones) in
a JSON file, and compares a run against such a file.

``docs/bench/sim-reference.json`` holds the answers of the engine as it was before the
compiled task loop (commit c4794b1); ``tests/unit/test_sim_reference.py`` replays the small
cases against it on every test run, and the large ones with ``--large``::

    .venv/bin/python -m mlfabric.sim.reference --check docs/bench/sim-reference.json [--large]
    .venv/bin/python -m mlfabric.sim.reference --record out.json [--large]   # what an engine answers now

``--speed`` runs cases side by side with the engine as it was before #37
(``EngineConfig(compiled_tasks=False)``: every event that starts a flow runs in Python) and
as it is, in one process, alternating, and prints events and flows per second of each and
their ratio (the issue's check 2; figures in docs/results.md)::

    .venv/bin/python -m mlfabric.sim.reference --speed --only ring-ft8-100MB,ring-ft12-64MB [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from mlfabric.topo import Topology, parse_topology

from .compute import ComputeModel, straggler_preset
from .engine import EngineConfig, SimResult, run_graph
from .graph import TaskGraph
from mlfabric.collectives.bcube import shape_options

from .workloads import PSConfig, collective_graph, concurrent_ps_graph, ps_graph

__all__ = ["SMALL", "LARGE", "CASES", "build_case", "run_case", "answers", "compare"]

# Up to this many tasks a case's every finish time is recorded (else a checksum of them).
_FULL_TASKS = 20_000
# The issue's bound on the relative difference of two engines' times.
RTOL = 1e-9

Case = Callable[[], tuple[TaskGraph, Topology, EngineConfig]]


def _collective(kind: str, spec: str, size: float, *, rate: float = 10e9, seed: int = 0, placement: str = "sequential",
                compute: ComputeModel | None = None, routing: str = "ecmp", latency_s: float = 0.0,
                host_rate: float | None = None, ranks_per_host: int = 1, **options: Any) -> Case:
    def make() -> tuple[TaskGraph, Topology, EngineConfig]:
        topo = parse_topology(spec, rate)
        if host_rate is not None:
            topo = topo.with_host_links(host_rate)
        world = topo.n_hosts * ranks_per_host
        if placement == "random":
            rng = np.random.default_rng(seed + 12345)
            hosts = rng.permutation(topo.n_hosts)
        else:
            hosts = np.arange(topo.n_hosts)
        hosts = np.repeat(hosts, ranks_per_host)
        name = kind if ":" in kind or kind in ("broadcast", "reduce", "allgather", "reduce_scatter") else f"allreduce:{kind}"
        opts = dict(options)
        if name.startswith("allreduce:"):
            algorithm = name.split(":", 1)[1]
            if not (algorithm == "bcube" and {"n", "k"} <= opts.keys()) and "radices" not in opts:
                opts = {**shape_options(algorithm, topo.spec), **opts}
        graph = collective_graph(name, world, int(size) // 4, placement=hosts, compute=compute, seed=seed, **opts)
        return graph, topo, EngineConfig(seed=seed, routing=routing, latency_s=latency_s)
    return make


def _ps(spec: str, workers: int, servers: int, *, rate: float = 10e9, jobs: int = 1, priorities: tuple[int, ...] | None = None,
        seed: int = 0, **fields: Any) -> Case:
    def make() -> tuple[TaskGraph, Topology, EngineConfig]:
        topo = parse_topology(spec, rate)
        ps = PSConfig(workers=workers, servers=servers, model_bytes=fields.pop("model_bytes", 100e6), **fields)
        if jobs == 1 and priorities is None:
            graph = ps_graph(topo, ps, seed=seed)
        else:
            configs = [replace(ps, name=f"ps{i}") for i in range(jobs)]
            graph = concurrent_ps_graph(topo, configs, seed=seed, priorities=priorities)
        return graph, topo, EngineConfig(seed=seed)
    return make


_STRAGGLE = ComputeModel(compute_s=0.01, speed_range=(1.0, 2.0), straggler=straggler_preset("C1"))

#: Cases that run in seconds together (the unit test replays these).
SMALL: dict[str, Case] = {
    "ring-ft4-100MB": _collective("ring", "fat-tree:k=4", 100e6),
    "ring-ft4-odd": _collective("ring", "fat-tree:k=4", 99_999_999),
    "ring-ft4-spray": _collective("ring", "fat-tree:k=4", 99_999_999, routing="spray"),
    "hd-ft4-odd": _collective("halving_doubling", "fat-tree:k=4", 99_999_999),
    "tree-ft4": _collective("tree", "fat-tree:k=4", 100e6),
    "ring-ft4-oversub-random": _collective("ring", "fat-tree:k=4,oversub=4", 99_999_999, placement="random", seed=3),
    "hd-racks-random": _collective("halving_doubling", "racks:r=4,h=6,oversub=3", 50e6, placement="random", seed=1),
    "ring-racks-random": _collective("ring", "racks:r=4,h=6,oversub=3", 50e6, placement="random", seed=2),
    "ring-star8-latency": _collective("ring", "star:n=8", 10e6, latency_s=5e-6),
    "ring-ft4-straggler": _collective("ring", "fat-tree:k=4", 99_999_999, compute=_STRAGGLE, seed=4),
    "hd-ft4-straggler": _collective("halving_doubling", "fat-tree:k=4", 99_999_999, compute=_STRAGGLE, seed=5),
    "ring-star4-hostlinks": _collective("ring", "star:n=4", 40e6, host_rate=32e9, ranks_per_host=2),
    "bcube-4-2": _collective("bcube", "bcube:n=4,k=2", 64e6),
    "bcube-4-2-spray": _collective("bcube", "bcube:n=4,k=2", 64e6, routing="spray"),
    "hier-ft4-spray": _collective("hierarchical", "fat-tree:k=4", 100e6, routing="spray"),
    "ring-bcube-4-1": _collective("ring", "bcube:n=4,k=1", 64e6),
    "allgather-ft4": _collective("allgather", "fat-tree:k=4", 16e6),
    "broadcast-ft4": _collective("broadcast", "fat-tree:k=4", 16e6),
    "ps-ft4-baseline": _ps("fat-tree:k=4,oversub=4", 8, 4, strategy="baseline", iterations=2),
    "ps-ft4-binary-global": _ps("fat-tree:k=4,oversub=4", 8, 4, strategy="binary", barrier="global"),
    "ps-ft4-rack-ssp": _ps("fat-tree:k=4,oversub=4", 10, 3, strategy="rack", iterations=3, staleness=1,
                           compute=ComputeModel(compute_s=0.02, speed_range=(1.0, 2.0))),
    "ps-ft4-priorities": _ps("fat-tree:k=4,oversub=2", 6, 2, jobs=2, priorities=(0, 1), iterations=2),
}

#: The issue's cases that finish today (minutes together; ``--large``).
LARGE: dict[str, Case] = {
    "ring-ft8-100MB": _collective("ring", "fat-tree:k=8", 100e6),
    "ring-ft8-straggler": _collective("ring", "fat-tree:k=8", 100e6, compute=_STRAGGLE, seed=7),
    "hd-ft16-100MB": _collective("halving_doubling", "fat-tree:k=16", 100e6),
    "tree-ft16-100MB": _collective("tree", "fat-tree:k=16", 100e6),
    "ps-ft16-800x50": _ps("fat-tree:k=16,oversub=4", 800, 50),
    "ps-ft16-624x400": _ps("fat-tree:k=16,oversub=4", 624, 400),
    "ring-ft12-64MB": _collective("ring", "fat-tree:k=12", 64e6),
}

CASES: dict[str, Case] = {**SMALL, **LARGE}


def build_case(name: str) -> tuple[TaskGraph, Topology, EngineConfig]:
    """The graph, topology and engine configuration of case ``name``."""
    return CASES[name]()


def run_case(name: str, **config: Any) -> SimResult:
    """Run case ``name``; ``config`` overrides :class:`EngineConfig` fields (e.g. ``compiled_tasks=False``)."""
    graph, topo, cfg = build_case(name)
    return run_graph(graph, topo, replace(cfg, **config) if config else cfg)


def answers(result: SimResult) -> dict[str, Any]:
    """The figures of a run that a reference holds."""
    finish = np.nan_to_num(result.task_finish_s, nan=0.0)
    out: dict[str, Any] = {"time_s": result.time_s, "job_time_s": result.job_time_s.tolist(),
                           "finish_sum_s": float(finish.sum()), "tasks": result.graph.n_tasks,
                           "flows": result.flows, "events": result.events, "wall_s": result.wall_s}
    if result.graph.n_tasks <= _FULL_TASKS:
        out["task_finish_s"] = finish.tolist()
    return out


def compare(reference: dict[str, Any], result: SimResult, rtol: float = RTOL) -> list[str]:
    """What differs by more than ``rtol`` (relative to the makespan) between a reference entry and a run."""
    got = answers(result)
    scale = max(abs(reference["time_s"]), 1e-300)
    problems = []
    if abs(got["time_s"] - reference["time_s"]) > rtol * scale:
        problems.append(f"time_s {got['time_s']!r} != {reference['time_s']!r}")
    jobs = np.abs(np.asarray(got["job_time_s"]) - np.asarray(reference["job_time_s"]))
    if jobs.size and jobs.max() > rtol * scale:
        problems.append(f"job times differ by up to {jobs.max():.3g} s")
    if "task_finish_s" in reference:
        diff = np.abs(np.asarray(got["task_finish_s"]) - np.asarray(reference["task_finish_s"]))
        if diff.max(initial=0.0) > rtol * scale:
            problems.append(f"task {int(diff.argmax())}'s finish differs by {diff.max():.3g} s")
    elif abs(got["finish_sum_s"] - reference["finish_sum_s"]) > rtol * abs(reference["finish_sum_s"]):
        problems.append(f"sum of finish times {got['finish_sum_s']!r} != {reference['finish_sum_s']!r}")
    return problems


def speed(name: str, *, repeat: int = 1) -> dict[str, Any]:
    """Case ``name`` run by the pre-#37 path and the current one, alternating ``repeat`` times
    (same graph, built once): the best wall time of each, events and flows per second, and
    the largest relative difference of their task finish times."""
    graph, topo, cfg = build_case(name)
    best: dict[str, SimResult] = {}
    cpu: dict[str, float] = {}
    for _ in range(repeat):
        for label, config in (("before", replace(cfg, compiled_tasks=False)), ("now", cfg)):
            cpu0 = time.process_time()
            result = run_graph(graph, topo, config)
            # CPU time too: on the shared VM other work stretches wall times, not CPU time.
            cpu[label] = min(cpu.get(label, math.inf), time.process_time() - cpu0)
            if label not in best or result.wall_s < best[label].wall_s:
                best[label] = result
    old, new = best["before"], best["now"]
    scale = max(abs(old.time_s), 1e-300)
    diff = np.abs(np.nan_to_num(new.task_finish_s) - np.nan_to_num(old.task_finish_s)).max(initial=0.0) / scale
    row = {"case": name, "tasks": graph.n_tasks, "flows": new.flows, "events_before": old.events, "events_now": new.events,
           "wall_before_s": old.wall_s, "wall_now_s": new.wall_s,
           "events_per_s_before": old.events / old.wall_s, "events_per_s_now": new.events / new.wall_s,
           "flows_per_s_before": old.flows / old.wall_s, "flows_per_s_now": new.flows / new.wall_s,
           "speedup": old.wall_s / new.wall_s, "cpu_before_s": cpu["before"], "cpu_now_s": cpu["now"],
           "cpu_speedup": cpu["before"] / cpu["now"], "max_rel_diff": float(diff), "time_s": new.time_s}
    print(f"{name}: {old.events:,} events, {new.flows:,} flows; before {old.wall_s:.3f} s "
          f"({row['events_per_s_before']:,.0f} events/s), now {new.wall_s:.3f} s ({row['events_per_s_now']:,.0f} "
          f"events/s): x{row['speedup']:.1f} (CPU {cpu['before']:.3f} s vs {cpu['now']:.3f} s: x{row['cpu_speedup']:.1f}); finish times differ by <= {diff:.2g} (relative)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="PATH", help="run the cases and write their answers here")
    mode.add_argument("--check", metavar="PATH", help="run the cases and compare with the answers here")
    parser.add_argument("--large", action="store_true", help="also the large cases (minutes)")
    parser.add_argument("--only", help="comma-separated case names")
    mode.add_argument("--speed", action="store_true", help="time the pre-#37 path and the current one side by side")
    parser.add_argument("--old", action="store_true", help="run with the pre-#37 engine path (compiled_tasks=False)")
    parser.add_argument("--repeat", type=int, default=1, help="with --speed: runs of each path")
    parser.add_argument("--json", metavar="PATH", help="with --speed: write the figures here")
    args = parser.parse_args(argv)
    names = list(SMALL) + (list(LARGE) if args.large else [])
    if args.only:
        names = [n for n in args.only.split(",") if n]
    overrides = {"compiled_tasks": False} if args.old else {}
    if args.speed:
        rows = [speed(name, repeat=args.repeat) for name in names]
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"benchmark": "sim-engine-speed", "command": " ".join(sys.argv), "cases": rows}, handle, indent=1)
        return 0
    if args.record:
        out = {}
        for name in names:
            t0 = time.perf_counter()
            out[name] = answers(run_case(name, **overrides))
            print(f"{name}: {out[name]['time_s']!r} s simulated, {time.perf_counter() - t0:.2f} s wall", flush=True)
        with open(args.record, "w") as handle:
            json.dump({"rtol": RTOL, "cases": out}, handle)
        return 0
    with open(args.check) as handle:
        reference = json.load(handle)["cases"]
    failed = 0
    for name in names:
        if name not in reference:
            print(f"{name}: not in {args.check}")
            continue
        result = run_case(name, **overrides)
        problems = compare(reference[name], result)
        failed += bool(problems)
        print(f"{name}: {'; '.join(problems) if problems else 'same'} ({result.wall_s:.2f} s wall, "
              f"reference {reference[name]['wall_s']:.2f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
