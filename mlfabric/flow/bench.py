"""Timing of the max-min solver on MLNET-sized instances, side by side with the naive baseline.

``benchmark_solver()`` builds the 1,024-host k=16 fat-tree with 1:4 oversubscribed ToR
uplinks (MLNET's evaluation network, 10 Gbps links), places 800 workers and 50 servers at
random, and times:

* ``push_40k``: the 40,000 worker->server push flows (ECMP), solved by the vectorized solver
  (best of ``repeats``) and once by the pure-Python :func:`~mlfabric.flow.naive.naive_max_min`;
  the ratio is the speed-up, and both allocations are compared;
* ``push_pull_80k``: push and pull flows together (80,000 flows);
* ``push_pull_500k``: 624 workers x 400 servers, push and pull (499,200 flows);
* ``random_6hop_250k``: 250,000 flows between random hosts in different pods (every path has
  6 links), plus the certificate check of the result;
* ``drain_80k`` / ``drain_500k`` (``include_drain``): one push then pull phase run to
  completion with :class:`~mlfabric.flow.network.FlowNetwork` (equal-size flows, batch
  removal of flows finishing together, incremental re-solves): an indication of what the
  event engine can reach, not the engine itself;
* peak Python-heap memory of the largest solves (tracemalloc) and the process's peak RSS.

Wall and CPU (process) seconds are both reported: on a shared machine CPU time is the steadier
figure. It is wired into ``mlfabric bench sim``; run it directly with::

    .venv/bin/python -m mlfabric.flow.bench
"""

from __future__ import annotations

import platform
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from mlfabric.flow.certificate import check_certificate
from mlfabric.flow.incidence import Incidence
from mlfabric.flow.maxmin import solve_max_min, solve_max_min_with_stats
from mlfabric.flow.naive import naive_max_min
from mlfabric.flow.network import FlowNetwork

__all__ = ["BenchmarkConfig", "benchmark_solver", "format_benchmark"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class BenchmarkConfig:
    topology: str = "fat-tree:k=16,oversub=4"
    link_rate_bps: float = 10e9
    workers: int = 800
    servers: int = 50
    large_workers: int = 624
    large_servers: int = 400
    random_flows: int = 250_000
    seed: int = 0
    repeats: int = 3
    include_naive: bool = True
    include_large: bool = True
    include_drain: bool = True
    #: Size of every flow in the drain runs (bits): equal shards of a model.
    drain_flow_bits: float = 8e6


def _timed(function: Callable[[], T], repeats: int) -> tuple[T, float, float]:
    """(result, best wall seconds, best CPU seconds) over ``repeats`` runs."""
    best_wall = best_cpu = float("inf")
    result: Any = None
    for _ in range(max(1, repeats)):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = function()
        best_wall = min(best_wall, time.perf_counter() - wall0)
        best_cpu = min(best_cpu, time.process_time() - cpu0)
    return result, best_wall, best_cpu


def _peak_traced_bytes(function: Callable[[], object]) -> int:
    """Peak bytes allocated (numpy included) while ``function`` runs."""
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _push_pull_pairs(rng: np.random.Generator, n_hosts: int, workers: int, servers: int) -> tuple[np.ndarray, np.ndarray]:
    """Random disjoint placement; returns (push pairs worker->server, pull pairs server->worker)."""
    if workers + servers > n_hosts:
        raise ValueError(f"{workers} workers + {servers} servers do not fit on {n_hosts} hosts")
    hosts = rng.permutation(n_hosts)
    worker_hosts, server_hosts = hosts[:workers], hosts[workers : workers + servers]
    push = np.stack(np.meshgrid(worker_hosts, server_hosts, indexing="ij"), axis=-1).reshape(-1, 2)
    return push, push[:, ::-1].copy()


def _random_inter_pod_pairs(rng: np.random.Generator, n_flows: int, n_hosts: int, hosts_per_pod: int) -> np.ndarray:
    src = rng.integers(0, n_hosts, n_flows)
    dst = rng.integers(0, n_hosts, n_flows)
    same = src // hosts_per_pod == dst // hosts_per_pod
    while same.any():
        dst[same] = rng.integers(0, n_hosts, int(same.sum()))
        same = src // hosts_per_pod == dst // hosts_per_pod
    return np.stack([src, dst], axis=1)


def _drain(capacity: np.ndarray, phases: list[Incidence], flow_bits: float) -> dict[str, float]:
    """Run phases (e.g. push then pull) to completion on a FlowNetwork; equal-size flows.

    Only flows whose rate may have changed (``FlowNetwork.last_resolved``) get new finish
    times, as an event engine would do.
    """
    network = FlowNetwork(capacity)
    now = 0.0
    updates = 0
    kinds: dict[str, int] = {}
    for incidence in phases:
        ids = network.add_flows(incidence)
        slots = int(ids.max()) + 1
        remaining = np.zeros(slots)
        remaining[ids] = flow_bits
        stamp = np.full(slots, now)
        rate = np.zeros(slots)
        finish = np.full(slots, np.inf)
        while network.n_flows:
            stats = network.update()
            updates += 1
            kinds[stats.kind] = kinds.get(stats.kind, 0) + 1
            changed = network.last_resolved
            if changed.size:
                remaining[changed] -= rate[changed] * (now - stamp[changed])
                stamp[changed] = now
                rate[changed] = network.rates(changed)
                finish[changed] = now + remaining[changed] / rate[changed]
            upcoming = float(finish.min())
            # Flows finishing together (to rounding) are one batch: one re-solve.
            done = np.flatnonzero(finish <= upcoming * (1 + 1e-12))
            now = upcoming
            finish[done] = np.inf
            network.remove_flows(done)
    return {"simulated_seconds": now, "updates": updates, **{f"updates_{kind}": count for kind, count in kinds.items()}}


def benchmark_solver(config: BenchmarkConfig | None = None, *,
                     on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the solver benchmark and return its figures (seconds, ratios, bytes) as a dict.
    ``on_step(label)`` is called before each instance (a progress display)."""
    from mlfabric.topo import parse_topology  # flow/ does not depend on topo/ at import time

    config = config or BenchmarkConfig()
    step = on_step or (lambda label: None)
    if not config.topology.startswith("fat-tree:"):
        raise ValueError(f"benchmark_solver needs a fat-tree topology (its 6-hop instance uses pods), got {config.topology!r}")
    rng = np.random.default_rng(config.seed)
    topology = parse_topology(config.topology, config.link_rate_bps)
    capacity = topology.capacity()
    results: dict[str, Any] = {
        "config": {key: getattr(config, key) for key in config.__dataclass_fields__},
        "machine": {"python": sys.version.split()[0], "numpy": np.__version__, "platform": platform.platform()},
        "topology": topology.summary(),
    }

    step(f"{config.workers} x {config.servers} push flows")
    push, pull = _push_pull_pairs(rng, topology.n_hosts, config.workers, config.servers)
    push_incidence = topology.route_ecmp(push, seed=config.seed)
    (rates, stats), wall, cpu = _timed(lambda: solve_max_min_with_stats(push_incidence, capacity), config.repeats)
    entry: dict[str, Any] = {
        "flows": push_incidence.n_flows,
        "link_entries": push_incidence.nnz,
        "fast_wall_s": wall,
        "fast_cpu_s": cpu,
        "rounds": stats.rounds,
        "events": stats.events,
        "distinct_rates": int(np.unique(rates).size),
    }
    if config.include_naive:
        step("the same push flows, naive solver")
        naive_rates, naive_wall, naive_cpu = _timed(lambda: naive_max_min(push_incidence, capacity), 1)
        entry.update(
            naive_wall_s=naive_wall,
            naive_cpu_s=naive_cpu,
            speedup_wall=naive_wall / wall,
            speedup_cpu=naive_cpu / cpu if cpu > 0 else float("inf"),
            max_relative_difference=float(np.max(np.abs(np.asarray(naive_rates) - rates) / rates)),
        )
    entry["certificate_ok"] = bool(check_certificate(push_incidence, capacity, rates))
    results["push_40k"] = entry

    step("push and pull flows")
    both = Incidence.concat([push_incidence, topology.route_ecmp(pull, seed=config.seed + 1)])
    (rates, stats), wall, cpu = _timed(lambda: solve_max_min_with_stats(both, capacity), config.repeats)
    results["push_pull_80k"] = {
        "flows": both.n_flows,
        "fast_wall_s": wall,
        "fast_cpu_s": cpu,
        "rounds": stats.rounds,
        "events": stats.events,
        "certificate_ok": bool(check_certificate(both, capacity, rates)),
    }
    if config.include_drain:
        step("push and pull flows run to completion")
        phases = [push_incidence, topology.route_ecmp(pull, seed=config.seed + 1)]
        drained, wall, cpu = _timed(lambda: _drain(capacity, phases, config.drain_flow_bits), 1)
        results["drain_80k"] = {"wall_s": wall, "cpu_s": cpu, **drained}

    step(f"{config.random_flows:,} random 6-hop flows")
    k = topology.spec.int_param("k")
    pairs = _random_inter_pod_pairs(rng, config.random_flows, topology.n_hosts, k * k // 4)
    random_incidence, route_wall, _ = _timed(lambda: topology.route_ecmp(pairs, seed=config.seed), 1)
    hops = random_incidence.lengths()
    (rates, stats), wall, cpu = _timed(lambda: solve_max_min_with_stats(random_incidence, capacity), config.repeats)
    report, check_wall, _ = _timed(lambda: check_certificate(random_incidence, capacity, rates), 1)
    results["random_6hop_250k"] = {
        "flows": random_incidence.n_flows,
        "hops_min": int(hops.min()),
        "hops_max": int(hops.max()),
        "route_wall_s": route_wall,
        "fast_wall_s": wall,
        "fast_cpu_s": cpu,
        "rounds": stats.rounds,
        "events": stats.events,
        "certificate_ok": bool(report),
        "certificate_wall_s": check_wall,
        "peak_traced_bytes": _peak_traced_bytes(lambda: solve_max_min(random_incidence, capacity)),
    }

    if config.include_large:
        step(f"{config.large_workers} x {config.large_servers} push and pull flows")
        push, pull = _push_pull_pairs(rng, topology.n_hosts, config.large_workers, config.large_servers)
        large = Incidence.concat([topology.route_ecmp(push, seed=config.seed), topology.route_ecmp(pull, seed=config.seed + 1)])
        (rates, stats), wall, cpu = _timed(lambda: solve_max_min_with_stats(large, capacity), config.repeats)
        results["push_pull_500k"] = {
            "flows": large.n_flows,
            "fast_wall_s": wall,
            "fast_cpu_s": cpu,
            "rounds": stats.rounds,
            "events": stats.events,
            "certificate_ok": bool(check_certificate(large, capacity, rates)),
            "peak_traced_bytes": _peak_traced_bytes(lambda: solve_max_min(large, capacity)),
        }
        if config.include_drain:
            step(f"{config.large_workers} x {config.large_servers} run to completion")
            phases = [topology.route_ecmp(push, seed=config.seed), topology.route_ecmp(pull, seed=config.seed + 1)]
            drained, wall, cpu = _timed(lambda: _drain(capacity, phases, config.drain_flow_bits), 1)
            results["drain_500k"] = {"wall_s": wall, "cpu_s": cpu, **drained}

    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return results


def format_benchmark(results: dict[str, Any]) -> str:
    """A plain-text table of the headline figures."""
    lines = [f"max-min solver benchmark on {results['topology']['spec']} ({results['topology']['hosts']} hosts)"]
    for name in ("push_40k", "push_pull_80k", "random_6hop_250k", "push_pull_500k"):
        entry = results.get(name)
        if not entry:
            continue
        line = f"  {name:<18} {entry['flows']:>8} flows  fast {entry['fast_wall_s']:.3f}s wall / {entry['fast_cpu_s']:.3f}s cpu"
        if "naive_wall_s" in entry:
            line += f"  naive {entry['naive_wall_s']:.2f}s  speed-up x{entry['speedup_wall']:.0f} (cpu x{entry['speedup_cpu']:.0f})"
        line += f"  certificate {'ok' if entry['certificate_ok'] else 'FAILED'}"
        if "peak_traced_bytes" in entry:
            line += f"  peak {entry['peak_traced_bytes'] / 2**20:.0f} MiB"
        lines.append(line)
    for name in ("drain_80k", "drain_500k"):
        entry = results.get(name)
        if entry:
            lines.append(
                f"  {name:<18} push+pull run to completion: {entry['wall_s']:.3f}s wall / {entry['cpu_s']:.3f}s cpu, "
                f"{entry['updates']} updates, {entry['simulated_seconds']:.3f} simulated s"
            )
    lines.append(f"  peak RSS {results['peak_rss_bytes'] / 2**20:.0f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    # The figures as JSON: `mlfabric bench sim --json PATH` (or `--json -` for standard output).
    print(format_benchmark(benchmark_solver()))
