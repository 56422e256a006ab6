"""MLNET §4 in the simulator: aggregation/multicast trees (Fig. 1) and flow priorities (Fig. 3).

    mlfabric simulate mlnet --servers 50,100,200,300,400 --oversub 1,4 --seeds 0 --json docs/bench/mlnet.json
    mlfabric simulate mlnet --quick                  # the same experiments scaled down (~1 min)
    .venv/bin/python -m pytest tests/unit/test_mlnet.py -q

What it reproduces (papers/mlnet.txt §4), on the 1,024-host k=16 fat-tree with 10 Gbps links,
per-flow ECMP and max-min (TCP-like) sharing:

* **Strategy sweep** (Fig. 1a/1b, :func:`run_sweep`): 800 workers, 50-400 parameter servers,
  non-oversubscribed and 1:4 (ToR uplinks at a quarter of the host rate); one synchronous
  push+pull iteration of BASELINE (every worker <-> every server), BINARY (per-server trees
  of in-degree 2) and RACK (one aggregator per rack: 8 hosts per ToR on k=16, in-degree 7).
  The figure is each strategy's makespan relative to BASELINE with the same placement and
  ECMP seed. The trees are :func:`~mlfabric.sim.workloads.tree_parents`'s; the iteration is
  :func:`~mlfabric.sim.workloads.ps_graph`'s with the per-server barrier (server ``j`` starts
  its multicast once its own tree has aggregated: each server's tree runs independently).
* **Prioritization** (Fig. 3, :func:`run_jobs`): 20 concurrent jobs of 200 workers and 50
  servers, each placed independently (hosts are shared between jobs), all started at once;
  job makespans with fair sharing and with a random strict priority per job, for BASELINE
  and for traffic reduction (RACK). Reported: median, 95th percentile and maximum.

Workload. Workers and servers are placed at random on the 1,024 hosts ("randomly deployed").
800 workers + 300 or 400 servers do not fit on distinct hosts, so :func:`mlnet_placement`
puts servers on the 224 hosts left free first and the rest on (random) worker hosts, where a
worker and a server share the NIC. The update: the paper's model has 65 billion parameters;
the default ``update_bytes`` is the dense float32 gradient, 4 x 65e9 = 260 GB per worker per
iteration, split evenly over the servers (the paper does not state the size of a push; sparse
logistic regression may push less, which only makes the compute share larger, see below).
Compute: workers "communicate with the parameter servers every 30 s", so every worker
computes ``compute_s = 30`` s before it pushes. The paper's 100-200 MB/s processing rates set
how much data a worker consumes in those 30 s, not when it pushes, so compute is uniform.

Why the ratios barely depend on these choices: in a fluid model without latency, times
scale with bytes, so the *communication-only* ratio (``comm_ratio``, makespan minus compute)
does not depend on the byte count at all. With a uniform compute phase ``C`` every flow
starts at ``C`` and the run is the communication-only run shifted by ``C``, so the
makespan ratio is ``(C + T_x) / (C + T_baseline)``. With 260 GB updates the baseline moves
hundreds to thousands of seconds of traffic per iteration, so 30 s of compute moves the
ratio by a few percent at most (the most at 400 servers). One iteration suffices: under
synchronous push/pull every iteration is the same, so the makespan of the whole training
(the paper's ~59 iterations: 176 GB per worker at >= 100 MB/s, 3 GB per 30 s) is a multiple
of it and the ratios are unchanged.

The paper's numbers (:data:`PAPER_FIG1`, :data:`PAPER_FIG3`) are the ones its text states;
Fig. 1's other points are only described qualitatively (:func:`paper_expectation`).

Cost (2-core VM): the paper-scale sweep takes ~10-12 min of CPU per seed (30 runs, the 1:4
runs with 400 servers up to ~2 min each), the 20-job experiment ~11 min per seed (four runs
of 400k flows; strict priorities make 20 flow classes). Event batching ``batch_rtol=1e-3``
keeps that affordable (see :class:`SweepConfig`).

Everything returned is plain dicts and lists (JSON-serialisable). Seeds: ``seed`` drives the
placement (:func:`mlnet_placement`), the ECMP hashes and the priority draw.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from mlfabric.topo import Topology, parse_topology

from .compute import ComputeModel
from .engine import EngineConfig, ROUTINGS, SimResult
from .workloads import PSConfig, ps_placement, simulate_ps

__all__ = [
    "JobsConfig",
    "MODEL_PARAMS",
    "PAPER_FIG1",
    "PAPER_FIG3",
    "STRATEGIES",
    "SweepConfig",
    "UPDATE_BYTES",
    "job_priorities",
    "mlnet_placement",
    "paper_expectation",
    "quick_configs",
    "run_jobs",
    "run_mlnet",
    "run_sweep",
    "server_nic_bytes",
    "sweep_topology",
]

#: The paper's model: sparse logistic regression with 65 billion parameters (MLNET §4).
MODEL_PARAMS = 65e9
#: Default update per worker and iteration: the dense float32 gradient of that model.
UPDATE_BYTES = 4 * MODEL_PARAMS
#: "communicate with the parameter servers every 30 s".
COMPUTE_S = 30.0
#: Default event batching of these experiments (see :class:`SweepConfig`).
BATCH_RTOL = 1e-3
STRATEGIES = ("baseline", "binary", "rack")
#: Stream of the seeded priority permutation (as ``mlfabric simulate ps --priorities random``).
_PRIORITY_STREAM = 4

#: Fig. 1, the points MLNET's text gives: (oversub, servers) -> strategy -> makespan / BASELINE's.
PAPER_FIG1: dict[tuple[float, int], dict[str, float]] = {
    (1.0, 50): {"binary": 0.22, "rack": 0.42},  # "taking only 22% and 42% of the time used by BASELINE"
    (4.0, 50): {"binary": 1 - 0.66, "rack": 1 - 0.73},  # "RACK reduces the makespan ... by 73% (resp. 66% for BINARY)"
    (4.0, 400): {"binary": 1 - 0.40, "rack": 1 - 0.71},  # "with 400 ... reduced by 71% (resp. 40% for BINARY)"
}
#: Fig. 3: relative changes of job makespans (negative = shorter).
PAPER_FIG3: dict[str, float] = {
    "priorities_vs_fair_median": -0.25,  # "reduces the median make span by 25%"
    "priorities_vs_fair_tail": 0.02,  # "while only increasing the tail by 2%"
    "rack_priorities_vs_baseline_median": -0.60,  # "reducing the median by 60%"
    "rack_priorities_vs_baseline_p95": -0.54,  # "(resp. 54% for the 95th-percentile)"
    "rack_priorities_vs_rack_median": -0.139,  # "reducing the median by 13.9% compared to ... traffic reduction only"
}


def _check_rate(value: float, name: str) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def _check_common(k: int, routing: str, barrier: str, seeds: Sequence[int], update_bytes: float,
                  compute_s: float, batch_rtol: float) -> None:
    if k < 2 or k % 2:
        raise ValueError(f"the fat-tree radix k must be even and >= 2, got {k}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if barrier not in ("server", "global"):
        raise ValueError(f"barrier must be 'server' or 'global', got {barrier!r}")
    if not seeds:
        raise ValueError("give at least one seed")
    if any(int(s) < 0 for s in seeds):
        raise ValueError(f"seeds must be >= 0, got {list(seeds)}")
    if not update_bytes > 0 or not math.isfinite(update_bytes):
        raise ValueError(f"update_bytes must be finite and > 0, got {update_bytes}")
    _check_rate(compute_s, "compute_s")
    if not 0 <= batch_rtol <= 1e-2:
        raise ValueError(f"batch_rtol must be in [0, 1e-2], got {batch_rtol}")


@dataclass(frozen=True, kw_only=True)
class _ExperimentConfig:
    """What both experiments share: the fat-tree, the workload and the engine settings."""

    #: Radix of the fat-tree (k=16: 1,024 hosts, 320 switches of 16 ports, 8 hosts per ToR).
    k: int = 16
    link_rate: str | float = "10Gbps"
    seeds: tuple[int, ...] = (0,)
    update_bytes: float = UPDATE_BYTES
    compute_s: float = COMPUTE_S
    barrier: str = "server"
    routing: str = "ecmp"
    #: Flows finishing within this relative time of an event finish with it (the engine's
    #: ``batch_rtol``). 1e-3 (not the engine's exact 1e-9) makes the 800-worker tree runs
    #: 5-25x faster; it moves makespans by < 0.5% (measured, see docs/results.md).
    batch_rtol: float = BATCH_RTOL
    #: Engine watchdog per run (None: no limit).
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        _check_common(self.k, self.routing, self.barrier, self.seeds, self.update_bytes, self.compute_s,
                      self.batch_rtol)


@dataclass(frozen=True, kw_only=True)
class SweepConfig(_ExperimentConfig):
    """The strategy sweep of MLNET Fig. 1 (defaults: the paper's setup)."""

    workers: int = 800
    servers: tuple[int, ...] = (50, 100, 200, 300, 400)
    #: Oversubscription of the ToR uplinks (1 = full bisection; 4 = the paper's 1:4).
    oversub: tuple[float, ...] = (1.0, 4.0)
    strategies: tuple[str, ...] = STRATEGIES

    def __post_init__(self) -> None:
        for name in ("servers", "strategies"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "oversub", tuple(float(o) for o in self.oversub))
        super().__post_init__()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        hosts = self.k**3 // 4
        if self.workers > hosts:
            raise ValueError(f"{self.workers} workers do not fit on the {hosts} hosts of fat-tree:k={self.k}")
        if not self.servers or any(s < 1 or s > hosts for s in self.servers):
            raise ValueError(f"server counts must be in [1, {hosts}] (hosts of fat-tree:k={self.k}), "
                             f"got {list(self.servers)}")
        if not self.oversub or any(not (o >= 1 and math.isfinite(o)) for o in self.oversub):
            raise ValueError(f"oversubscription ratios must be finite and >= 1 (1 = full bisection, 4 = 1:4), "
                             f"got {list(self.oversub)}")
        if "baseline" not in self.strategies:
            raise ValueError("the strategies must include 'baseline' (the others are reported relative to it)")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")


@dataclass(frozen=True, kw_only=True)
class JobsConfig(_ExperimentConfig):
    """The prioritization experiment of MLNET Fig. 3 (defaults: the paper's setup)."""

    oversub: float = 1.0
    jobs: int = 20
    workers: int = 200
    servers: int = 50
    #: Run fair sharing and random priorities for each: baseline = "TCP", rack = traffic reduction.
    strategies: tuple[str, ...] = ("baseline", "rack")

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", tuple(self.strategies))
        super().__post_init__()
        if self.jobs < 2:
            raise ValueError(f"the prioritization experiment needs >= 2 jobs, got {self.jobs}")
        hosts = self.k**3 // 4
        if self.workers < 1 or self.servers < 1 or self.workers + self.servers > hosts:
            raise ValueError(f"a job needs >= 1 worker and >= 1 server on distinct hosts: {self.workers} + "
                             f"{self.servers} on the {hosts} hosts of fat-tree:k={self.k}")
        if not (self.oversub >= 1 and math.isfinite(self.oversub)):
            raise ValueError(f"oversub must be finite and >= 1, got {self.oversub}")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if not self.strategies or bad:
            raise ValueError(f"strategies must be a non-empty subset of {', '.join(STRATEGIES)}, got "
                             f"{list(self.strategies)}")


def quick_configs() -> tuple[SweepConfig, JobsConfig]:
    """Both experiments scaled down by ~8 for a run of about a minute: k=8 fat-tree (128 hosts, 4 per
    ToR, so RACK is in-degree 3), 100 workers and 6-50 servers; 20 jobs of 25 workers and 6
    servers. Not the paper's setup: its figures do not apply."""
    return (SweepConfig(k=8, workers=100, servers=(6, 12, 25, 38, 50)),
            JobsConfig(k=8, workers=25, servers=6))


def sweep_topology(k: int, oversub: float, link_rate: str | float) -> Topology:
    """``fat-tree:k=..,oversub=..`` (oversubscription at the ToR uplinks) at ``link_rate``."""
    value = int(oversub) if float(oversub).is_integer() else oversub
    return parse_topology(f"fat-tree:k={k},oversub={value}", link_rate)


def mlnet_placement(topology: Topology, workers: int, servers: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(worker hosts, server hosts) at random on the topology's hosts, disjoint where they fit.

    :func:`~mlfabric.sim.workloads.ps_placement`'s random placement (the same draw) when
    ``workers + servers <= hosts``. Otherwise the servers take every host the workers left
    free and the remaining ones go to worker hosts (the first of the random worker list), so a
    host runs at most one worker and one server.
    """
    n = topology.n_hosts
    if workers > n or servers > n:
        raise ValueError(f"{workers} workers and {servers} servers: at most {n} of each on {topology.spec}")
    free = min(servers, n - workers)
    if free == 0:  # every host has a worker: ps_placement still needs one server
        head, last = ps_placement(topology, PSConfig(workers=workers - 1, servers=1, model_bytes=0), seed)
        worker_hosts = np.concatenate([head, last])
        return worker_hosts, worker_hosts[:servers].copy()
    worker_hosts, server_hosts = ps_placement(topology, PSConfig(workers=workers, servers=free, model_bytes=0), seed)
    if servers > free:
        server_hosts = np.concatenate([server_hosts, worker_hosts[: servers - free]])
    return worker_hosts, server_hosts


def server_nic_bytes(result: SimResult, server_hosts: np.ndarray) -> float:
    """Bytes through the NICs (both directions) of the hosts that run a server."""
    nics = result.topology.nic_links[np.unique(server_hosts)].reshape(-1)
    return float(result.link_bytes[nics[nics >= 0]].sum())


def _compute(compute_s: float) -> ComputeModel | None:
    return ComputeModel(compute_s=compute_s) if compute_s > 0 else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _sweep_run(topology: Topology, config: SweepConfig, servers: int, strategy: str, seed: int,
               hosts: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    worker_hosts, server_hosts = hosts
    ps = PSConfig(workers=config.workers, servers=servers, model_bytes=config.update_bytes, strategy=strategy,
                  barrier=config.barrier, worker_hosts=tuple(worker_hosts.tolist()),
                  server_hosts=tuple(server_hosts.tolist()), compute=_compute(config.compute_s), name=strategy)
    engine = EngineConfig(routing=config.routing, seed=seed, batch_rtol=config.batch_rtol,
                          max_wall_s=config.max_wall_s)
    wall0 = time.perf_counter()
    result = simulate_ps(topology, ps=ps, config=engine)
    wall = time.perf_counter() - wall0
    summary = result.link_summary()
    return {
        "servers": servers, "strategy": strategy, "seed": seed,
        "makespan_s": result.time_s, "comm_s": result.time_s - config.compute_s,
        "server_nic_bytes": server_nic_bytes(result, server_hosts),
        "total_link_bytes": summary["total_bytes"], "max_link_bytes": summary["max_bytes"],
        "colocated_servers": int(np.isin(server_hosts, worker_hosts).sum()),
        "flows": result.flows, "events": result.events, "wall_s": wall,
    }


def paper_expectation(oversub: float, servers: int, strategy: str) -> str:
    """What MLNET §4 says about a point of Fig. 1: its number, or the qualitative claim."""
    if strategy == "baseline":
        return "1"
    stated = PAPER_FIG1.get((float(oversub), servers), {}).get(strategy)
    if stated is not None:
        return f"{stated:.2f}"
    if oversub > 1:
        return "< 1"  # "RACK and BINARY outperform BASELINE in all configurations"
    if servers >= 300:
        return "> 1"  # "when the number of parameter servers is very high (>= 300) ... worse than BASELINE"
    return "<1, less"  # "with a large number of parameter servers ... less effective"


def run_sweep(config: SweepConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """MLNET Fig. 1: every (oversub, servers, seed, strategy) run and the ratios to BASELINE.

    Returns ``{"config", "runs", "summary"}``. ``runs``: one dict per simulation
    (``makespan_s``, ``comm_s``, ``server_nic_bytes``, link totals, ``flows``, ``events``,
    ``wall_s``). ``summary``: one dict per (oversub, servers, strategy): the makespan ratio
    to BASELINE (``ratio``, mean over seeds, with ``ratio_min``/``ratio_max``),
    ``comm_ratio`` (communication only, independent of the update size), the server-NIC
    bytes ratio, and the paper's figure (``paper``: a number or a qualitative claim).
    ``on_run(label)`` is called before each simulation.
    """
    runs: list[dict[str, Any]] = []
    for oversub in config.oversub:
        topology = sweep_topology(config.k, oversub, config.link_rate)
        for servers in config.servers:
            for seed in config.seeds:
                hosts = mlnet_placement(topology, config.workers, servers, seed)
                for strategy in config.strategies:
                    if on_run is not None:
                        on_run(f"oversub {oversub:g}, {config.workers} x {servers}, seed {seed}: {strategy}")
                    run = _sweep_run(topology, config, servers, strategy, seed, hosts)
                    runs.append({"oversub": oversub, **run})
    return {"config": _config_dict(config), "runs": runs, "summary": summarize_sweep(runs)}


def summarize_sweep(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ratios to BASELINE per (oversub, servers, strategy), averaged over seeds (see :func:`run_sweep`)."""
    base = {(r["oversub"], r["servers"], r["seed"]): r for r in runs if r["strategy"] == "baseline"}
    groups: dict[tuple[float, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["oversub"], run["servers"], run["strategy"]), []).append(run)
    rows = []
    for (oversub, servers, strategy), members in groups.items():
        pairs = [(m, base[(oversub, servers, m["seed"])]) for m in members if (oversub, servers, m["seed"]) in base]
        ratios = [_ratio(m["makespan_s"], b["makespan_s"]) for m, b in pairs]
        comm = [_ratio(m["comm_s"], b["comm_s"]) for m, b in pairs]
        nic = [_ratio(m["server_nic_bytes"], b["server_nic_bytes"]) for m, b in pairs]
        ratios = [r for r in ratios if r is not None]
        comm = [r for r in comm if r is not None]
        nic = [r for r in nic if r is not None]
        rows.append({
            "oversub": oversub, "servers": servers, "strategy": strategy, "seeds": [m["seed"] for m in members],
            "makespan_s": float(np.mean([m["makespan_s"] for m in members])),
            "ratio": float(np.mean(ratios)) if ratios else None,
            "ratio_min": float(min(ratios)) if ratios else None,
            "ratio_max": float(max(ratios)) if ratios else None,
            "comm_ratio": float(np.mean(comm)) if comm else None,
            "server_nic_bytes_ratio": float(np.mean(nic)) if nic else None,
            "paper": paper_expectation(oversub, servers, strategy),
        })
    return rows


def job_priorities(jobs: int, seed: int) -> list[int]:
    """A random strict priority per job (0 first): the seeded permutation
    ``mlfabric simulate ps --priorities random`` draws."""
    return np.random.default_rng(np.random.SeedSequence([seed, _PRIORITY_STREAM])).permutation(jobs).tolist()


def _stats(times: Sequence[float]) -> dict[str, float]:
    values = np.asarray(times, dtype=np.float64)
    return {"median_s": float(np.median(values)), "p95_s": float(np.percentile(values, 95)),
            "max_s": float(values.max()), "mean_s": float(values.mean())}


def _change(new: float, old: float) -> float | None:
    return new / old - 1.0 if old > 0 else None


def run_jobs(config: JobsConfig, *, on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """MLNET Fig. 3: job makespans of ``config.jobs`` concurrent jobs, fair vs prioritized.

    For every seed and strategy: one run with every job in one class (fair max-min sharing)
    and one with the seeded random priorities of :func:`job_priorities` (strict classes), on
    the same placement and ECMP hashes. Returns ``{"config", "runs", "summary"}``: ``runs``
    hold each job's makespan (``job_makespan_s``, job order) and the priorities;
    ``summary`` has per (strategy, priorities) the median / p95 / max / mean of the job
    makespans (pooled over seeds) and ``changes``: the relative changes the paper reports,
    beside :data:`PAPER_FIG3`.
    """
    topology = sweep_topology(config.k, config.oversub, config.link_rate)
    ps = PSConfig(workers=config.workers, servers=config.servers, model_bytes=config.update_bytes,
                  barrier=config.barrier, compute=_compute(config.compute_s), name="job")
    runs: list[dict[str, Any]] = []
    for seed in config.seeds:
        prios = job_priorities(config.jobs, seed)
        for strategy in config.strategies:
            for prioritized in (False, True):
                if on_run is not None:
                    on_run(f"{config.jobs} jobs, seed {seed}: {strategy}, " + ("priorities" if prioritized else "fair"))
                engine = EngineConfig(routing=config.routing, seed=seed, batch_rtol=config.batch_rtol,
                                      max_wall_s=config.max_wall_s)
                wall0 = time.perf_counter()
                result = simulate_ps(topology, ps=replace(ps, strategy=strategy), config=engine, jobs=config.jobs,
                                     priorities=prios if prioritized else [0] * config.jobs)
                runs.append({
                    "seed": seed, "strategy": strategy, "priorities": prioritized,
                    "job_priority": prios if prioritized else [0] * config.jobs,
                    "job_makespan_s": [float(t) for t in result.job_time_s],
                    "makespan_s": result.time_s, "flows": result.flows, "events": result.events,
                    "wall_s": time.perf_counter() - wall0,
                })
    return {"config": _config_dict(config), "runs": runs, "summary": summarize_jobs(runs)}


def summarize_jobs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Statistics of the job makespans per condition and the paper's relative changes."""
    conditions: dict[str, dict[str, Any]] = {}
    for run in runs:
        key = f"{run['strategy']}{'+priorities' if run['priorities'] else ''}"
        conditions.setdefault(key, {"strategy": run["strategy"], "priorities": run["priorities"], "times": []})
        conditions[key]["times"].extend(run["job_makespan_s"])
    stats = {key: {"strategy": c["strategy"], "priorities": c["priorities"], "jobs": len(c["times"]),
                   **_stats(c["times"])} for key, c in conditions.items()}
    changes: list[dict[str, Any]] = []

    def add(name: str, what: str, new: str, old: str, stat: str) -> None:
        if new in stats and old in stats:
            changes.append({"name": name, "what": what, "ours": _change(stats[new][stat], stats[old][stat]),
                            "paper": PAPER_FIG3.get(name)})

    for strategy in ("baseline", "binary", "rack"):
        label = "" if strategy == "baseline" else f" ({strategy})"
        prefix = "priorities_vs_fair" if strategy == "baseline" else f"{strategy}_priorities_vs_{strategy}"
        add(f"{prefix}_median", f"priorities vs fair{label}, median", f"{strategy}+priorities", strategy, "median_s")
        add(f"{prefix}_p95", f"priorities vs fair{label}, p95", f"{strategy}+priorities", strategy, "p95_s")
        add(f"{prefix}_tail", f"priorities vs fair{label}, max (tail)", f"{strategy}+priorities", strategy, "max_s")
    for strategy in ("rack", "binary"):
        add(f"{strategy}_vs_baseline_median", f"{strategy} (fair) vs baseline, median", strategy, "baseline",
            "median_s")
        add(f"{strategy}_priorities_vs_baseline_median", f"{strategy}+priorities vs baseline, median",
            f"{strategy}+priorities", "baseline", "median_s")
        add(f"{strategy}_priorities_vs_baseline_p95", f"{strategy}+priorities vs baseline, p95",
            f"{strategy}+priorities", "baseline", "p95_s")
    return {"conditions": stats, "changes": changes}


def _config_dict(config: SweepConfig | JobsConfig) -> dict[str, Any]:
    return {key: (list(value) if isinstance(value, tuple) else value) for key, value in asdict(config).items()}


def run_mlnet(sweep: SweepConfig | None, jobs: JobsConfig | None, *, argv: Sequence[str] | None = None,
              on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Both experiments (either may be None) with run metadata: ``{"command", "machine",
    "wall_s", "sweep", "jobs"}``."""
    wall0 = time.perf_counter()
    out: dict[str, Any] = {
        "command": " ".join(argv) if argv else None,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "paper_fig1": [{"oversub": o, "servers": s, **v} for (o, s), v in PAPER_FIG1.items()],
        "paper_fig3": dict(PAPER_FIG3),
    }
    out["sweep"] = run_sweep(sweep, on_run=on_run) if sweep is not None else None
    out["jobs"] = run_jobs(jobs, on_run=on_run) if jobs is not None else None
    out["wall_s"] = time.perf_counter() - wall0
    return out


# --------------------------------------------------------------------------- the runtime's tree nodes, simulated


class _SimTreePort:
    """The simulator's :class:`~mlfabric.ps.policies.mlnet.TreePort`: a worker of ``layout``
    (no failover: a simulated server is never lost)."""

    def __init__(self, layout: Any, index: int, staleness: float) -> None:
        self.layout, self.index, self.pull_staleness = layout, index, float(staleness)
        self.rank = layout.worker_rank(index)
        self.who = f"simulated {layout.describe(self.rank)}"

    def server_rank(self, server: int) -> int:
        return self.layout.server_rank(server)

    def fail_over(self, peer: int) -> bool:
        return False


class SimTreeDriver:
    """The simulator's driver of one worker's tree node: the runtime's own
    :class:`~mlfabric.ps.policies.mlnet.TreeCore`, handed typed inputs (no wire format) at
    simulated times, in the order the runtime's :class:`~mlfabric.ps.policies.mlnet.TreeNode`
    hands them in one pass (the worker's events, the children's messages, the answers from
    above, the peers gone, then what is ready goes up). ``record`` keeps every action."""

    def __init__(self, layout: Any, index: int, parents: np.ndarray, staleness: float = 0.0) -> None:
        from mlfabric.ps.policies.mlnet import TreeCore

        self.core = TreeCore(_SimTreePort(layout, index, staleness), parents)
        self.lost: dict[int, str] = {}
        self.departed: set[int] = set()
        self.core.lost = self.lost
        self.record: list[Any] = []

    def turn(self, now: float, *, events: Sequence[tuple[Any, ...]] = (),
             messages: Sequence[tuple[int, dict[str, Any], Any]] = (),
             replies: Sequence[tuple[int, dict[str, Any], bytes, Any]] = (), wall: float | None = None) -> list[Any]:
        """One pass at ``now``: ``events`` (the worker's: ``("push", j, model, clock, tensor,
        header)``, ``("clock", c)``, ``("pull", j, header)``, ``("leave",)``), ``messages`` from
        children ``(src rank, header, tensor or None)``, ``replies`` from above ``(request id,
        header, meta, payload)``; returns the actions, in order."""
        core = self.core
        gone = {rank: f"lost: {why}" for rank, why in self.lost.items()}
        for rank in self.departed:
            gone.setdefault(rank, "it closed its transport without leaving the tree")
        for event in events:
            core.event(*event)
        for src, header, part in messages:
            core.from_child(src, header, part)
        for request_id, header, meta, payload in replies:
            if header["op"] == "attached":
                core.attached(request_id, int(header["through"]), now if wall is None else wall)
            else:
                core.copy_arrived(request_id, header, meta, payload)
        core.watch(gone, now)
        core.forward()
        actions = core.take_actions()
        self.record += actions
        return actions


def simulate_tree_ps(tree: str, *, workers: int, update_bytes: float, rate_bps: float, compute_s: float,
                     iterations: int) -> dict[str, Any]:
    """BSP training with one server under MLNET's trees, the tree nodes being the runtime's own
    :class:`~mlfabric.ps.policies.mlnet.TreeCore` (one :class:`SimTreeDriver` per worker): each
    iteration a worker computes ``compute_s``, pushes its update and its clock to its node,
    and pulls the model of the round; every message crosses the sender's and the receiver's
    NICs one after another at ``rate_bps`` (store and forward, FIFO per NIC direction; headers
    free). The server closes a round once every worker's clock is in and answers the pulls
    waiting for it. Returns the time of the last iteration, the iterations' mean and the
    server NIC's bytes in and out. ``tree``: ``binary``, ``rack`` or ``tree:D``; ``direct``: every
    worker pushes and pulls to the server (MLNET's BASELINE), for comparison."""
    import heapq
    import itertools

    import torch

    from mlfabric.ps import protocol
    from mlfabric.ps.layout import PSLayout
    from mlfabric.ps.policies.mlnet import Deliver, MLNetSettings

    if workers < 1 or iterations < 1 or not (update_bytes > 0 and rate_bps > 0) or compute_s < 0:
        raise ValueError("simulate_tree_ps needs workers >= 1, iterations >= 1, positive sizes and rates, compute >= 0")
    layout = PSLayout(servers=1, workers=workers)
    rate = rate_bps / 8
    direct = tree == "direct"
    parents = None if direct else MLNetSettings(tree=tree).parents(workers, 1, list(layout.worker_ranks))
    nodes = [] if direct else [SimTreeDriver(layout, w, parents) for w in range(workers)]
    server = layout.server_rank(0)
    events: list[tuple[float, int, Callable[[float], None]]] = []
    seq = itertools.count()
    up_free: dict[int, float] = {}
    down_free: dict[int, float] = {}
    nic = {"in": 0.0, "out": 0.0}

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(seq), fn))

    def transfer(src: int, dst: int, size: float, now: float, deliver: Callable[[float], None]) -> None:
        sent = max(now, up_free.get(src, 0.0)) + size / rate
        up_free[src] = sent
        arrive = max(sent, down_free.get(dst, 0.0) + size / rate)
        down_free[dst] = arrive
        if dst == server:
            nic["in"] += size
        if src == server:
            nic["out"] += size
        at(arrive, deliver)

    rounds_closed = 0
    clocked: dict[int, set[int]] = {}
    waiting_pulls: list[tuple[int, int, int, Callable[[float], None]]] = []  # (need, rank, id, answer)
    done_at: list[float] = [0.0] * workers
    iteration = [0] * workers
    ids = itertools.count(1)
    pull_of: dict[int, int] = {}  # a worker's pull sent to the server itself (direct) -> worker

    def server_request(src: int, header: dict[str, Any], now: float) -> None:
        nonlocal rounds_closed
        op = header["op"]
        if op == "clock":
            clocked.setdefault(int(header["clock"]), set()).update(int(w) for w in header["workers"])
            while len(clocked.get(rounds_closed, ())) == workers:
                rounds_closed += 1
            for item in [p for p in waiting_pulls if p[0] <= rounds_closed]:
                waiting_pulls.remove(item)
                item[3](now)
        elif op == "pull":
            need = int(header["clock"]) - int(header.get("staleness") or 0)

            def answer(t: float, src: int = src, request_id: int = int(header["id"])) -> None:
                meta = protocol.ModelReply(version=rounds_closed, model_clock=rounds_closed).encode()
                transfer(server, src, update_bytes, t, lambda t2: reply_arrived(src, request_id, meta, t2))

            if need <= rounds_closed:
                answer(now)
            else:
                waiting_pulls.append((need, src, int(header["id"]), answer))

    def reply_arrived(rank: int, request_id: int, meta: bytes, now: float) -> None:
        if request_id in pull_of:  # a worker's own pull, answered by the server (direct)
            pulled(pull_of.pop(request_id), now)
        else:  # a node's request upstream
            run(layout.worker_index(rank), now, replies=[(request_id, protocol.decode(meta), meta, None)])

    def run(w: int, now: float, **inputs: Any) -> None:
        src = layout.worker_rank(w)
        for action in nodes[w].turn(now, **inputs):
            if isinstance(action, Deliver):  # the worker's own pull, answered by its node
                pull_of.pop(action.request_id, None)
                pulled(w, now)
            elif action.on == "request":  # to the server
                size = update_bytes if action.payload is not None else 0.0
                transfer(src, action.peer, size, now, lambda t, h=action.fields: server_request(src, h, t))
            elif action.on == "tree":  # to the parent's node
                size = update_bytes if action.payload is not None else 0.0
                transfer(src, action.peer, size, now,
                         lambda t, dst=action.peer, h=action.fields, part=action.payload:
                         run(layout.worker_index(dst), t, messages=[(src, h, part)]))
            else:  # an answer to a child's node: the copy passed on as it came (or an error)
                meta = action.encode()
                transfer(src, action.peer, update_bytes if action.meta is not None else 0.0, now,
                         lambda t, dst=action.peer, rid=action.request_id, m=meta: reply_arrived(dst, rid, m, t))

    def computed(w: int, now: float) -> None:
        k = iteration[w]
        rank = layout.worker_rank(w)
        request_id = next(ids)
        if direct:  # MLNET's BASELINE: the update, the clock and the pull straight to the server
            pull_of[request_id] = w
            transfer(rank, server, update_bytes, now, lambda t: None)
            transfer(rank, server, 0.0, now,
                     lambda t: server_request(rank, {"op": "clock", "clock": k, "workers": [w]}, t))
            transfer(rank, server, 0.0, now,
                     lambda t: server_request(rank, {"op": "pull", "id": request_id, "clock": k + 1}, t))
            return
        run(w, now, events=[("push", 0, "m", k, torch.zeros(1), {"version": k}), ("clock", k),
                            ("pull", 0, {"model": "m", "id": request_id, "clock": k + 1, "staleness": 0})])

    def pulled(w: int, now: float) -> None:
        iteration[w] += 1
        if iteration[w] >= iterations:
            done_at[w] = now
            return
        at(now + compute_s, lambda t: computed(w, t))

    for w in range(workers):
        at(compute_s, lambda t, w=w: computed(w, t))
    while events:
        t, _, fn = heapq.heappop(events)
        fn(t)
    if any(i < iterations for i in iteration):
        raise RuntimeError("simulate_tree_ps stalled: a worker never got its model (a tree node's decision is missing)")
    end = max(done_at)
    return {"tree": tree, "workers": workers, "iterations": iterations, "time_s": end,
            "iteration_s": end / iterations, "server_bytes_in": nic["in"], "server_bytes_out": nic["out"]}
