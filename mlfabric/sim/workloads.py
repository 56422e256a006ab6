"""Simulated workloads: collectives from ``mlfabric.collectives``, parameter servers, MLNET trees, job mixes.

    from mlfabric.sim import PSConfig, simulate_ps
    result = simulate_ps("fat-tree:k=16,oversub=4", "10Gbps", PSConfig(workers=800, servers=50,
                         model_bytes=100e6, strategy="rack"))
    result.time_s

**Collectives** (:func:`simulate_collective`): the per-rank schedules ``collectives.build``
returns, the very objects the runtime executes, compiled by
:func:`~mlfabric.sim.graph.compile_schedules` and run by the engine.

**Parameter server** (:func:`ps_graph`, :class:`PSConfig`): ``W`` workers, ``S`` servers, the
model split evenly across the servers (server ``j`` holds shard ``j``; shard sizes differ by
at most one byte). One iteration of worker ``w``: compute (timed by the compute model), then
*push* shard ``j`` of its gradient to every server ``j``; server ``j`` aggregates once every
push of the iteration has arrived (BSP at the server), then the *pull* sends the new shard
``j`` to every worker; the worker's iteration ends when it holds every shard. With staleness
``s`` (SSP, MLNET §2.2 / BML §2), worker ``w`` may start computing iteration ``i`` once it
finished iteration ``i-1`` and has pulled the model of iteration ``i-1-s``; ``s = 0`` is BSP.
Servers process iterations in order. A worker and a server on the same host (``placement=
"colocated"``, the P2P parameter server of BML §2 when ``W = S = N``) exchange their shard
without the network.

**MLNET trees** (MLNET §3, ``strategy``): for every server a spanning tree rooted at the server
and connecting all workers. Push: a tree node waits for its own gradient and for the messages
of all its children, aggregates them and forwards *one* message of the shard's size to its
parent; the server aggregates its children's messages. Pull: the same tree multicasts the new
shard, each node forwarding it to its children once received. The trees are
:func:`mlfabric.topo.trees.tree_parents`'s, the code the runtime's ``mlnet`` routing policy
(``ps/policies/mlnet.py``) builds its trees with, so simulated and real runs of a placement agree.

* ``baseline``: every worker sends directly to every server (today's PS);
* ``binary`` (``tree`` with ``degree=2``) and ``tree`` of in-degree ``d``: workers sorted by
  host (so rack-mates share subtrees) are split recursively: the root gets ``d`` children, the
  heads of ``d`` contiguous parts of the list, and each part is split the same way below its
  head. Server ``j``'s tree rotates the worker list by ``j*W/S`` so that aggregation work is
  spread over the workers;
* ``rack``: one aggregator per rack (the hosts behind one first-hop switch; 8 on the k=16
  fat-tree, so in-degree 7 as in MLNET §4): every other worker of the rack sends to it, it
  sends one message to the server; server ``j`` uses the rack's ``(j mod size)``-th worker.

In-tree SSP (cached weights answering pulls inside the tree) is not modelled: with trees the
staleness gate applies at the workers as above.

**Job mixes** (:func:`concurrent_ps_graph`): several parameter-server jobs placed
independently on one cluster (hosts may be shared), each with its own priority class
(MLNET §3/§4: 20 models of 200 workers and 50 servers, random priorities).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py -q
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mlfabric.collectives import build
from mlfabric.collectives.bcube import shape_options
from mlfabric.collectives.partition import piece_sizes
from mlfabric.topo import Topology, parse_topology
from mlfabric.topo.trees import rack_of
from mlfabric.topo.trees import tree_parents as shared_tree_parents

from .compute import ComputeModel
from .engine import EngineConfig, SimResult, SimStatus, run_graph
from .graph import GraphBuilder, TaskGraph, compile_schedules, merge_graphs

__all__ = [
    "PSConfig",
    "PS_STRATEGIES",
    "PLACEMENTS",
    "collective_graph",
    "collective_kind",
    "concurrent_ps_graph",
    "iteration_times",
    "ps_graph",
    "ps_placement",
    "rack_of",
    "ring_closed_form_s",
    "simulate_collective",
    "simulate_ps",
    "tree_parents",
]

PS_STRATEGIES = ("baseline", "binary", "rack", "tree")
PLACEMENTS = ("random", "sequential", "colocated", "launch")
_PLACEMENT_STREAM = 3


def _topology(topology: Topology | str, link_rate: float | str | None) -> Topology:
    if isinstance(topology, Topology):
        if link_rate is not None:
            raise ValueError("give the link rate only with a topology spec string")
        return topology
    if link_rate is None:
        raise ValueError("a topology spec string needs a link rate (e.g. '10Gbps')")
    return parse_topology(topology, link_rate)


# --------------------------------------------------------------------------- collectives


def collective_kind(algorithm: str) -> str:
    """``"ring"`` -> ``"allreduce:ring"``; collective kinds (``"broadcast"``...) pass through."""
    from mlfabric.collectives import ALLREDUCE_ALGORITHMS

    if algorithm in ALLREDUCE_ALGORITHMS:
        return f"allreduce:{algorithm}"
    return algorithm


def collective_graph(kind: str, world_size: int, count: int, *, itemsize: int = 4,
                     placement: Sequence[int] | np.ndarray | None = None, compute: ComputeModel | None = None,
                     seed: int = 0, priority: int = 0, **options: Any) -> TaskGraph:
    """The task graph of one collective: ``collectives.build(kind, world_size, r, count, **options)``
    for every rank ``r``, compiled with the given placement (rank -> host)."""
    if kind == "allreduce:ring":
        # A ring is rank 0's schedule rotated: its graph without a schedule per rank (#37).
        from .regular import ring_graph

        graph = ring_graph(world_size, count, itemsize=itemsize, placement=placement, compute=compute, seed=seed,
                           priority=priority, name=kind, **options)
        if graph is not None:
            return graph
    if kind in ("allreduce:bcube", "allreduce:hierarchical"):
        # BML's exchange is rank 0's translated digit by digit: BCube(8,4)'s 4,096 ranks'
        # schedules (1.8 M ops) took ~26 s of CPU to build and compile (#37).
        from .regular import digit_exchange_graph

        graph = digit_exchange_graph(kind, world_size, count, itemsize=itemsize, placement=placement, compute=compute,
                                     seed=seed, priority=priority, name=kind, **options)
        if graph is not None:
            return graph
    # Millions of op objects that never form cycles: the cyclic collector's passes over them
    # were ~12% of a 1,024-rank halving-doubling's wall time (#37).
    paused = gc.isenabled()
    gc.disable()
    try:
        schedules = [build(kind, world_size, r, count, **options) for r in range(world_size)]
        return compile_schedules(schedules, placement=placement, itemsize=itemsize, compute=compute, seed=seed,
                                 priority=priority, name=kind)
    finally:
        if paused:
            gc.enable()


def simulate_collective(kind: str, topology: Topology | str, link_rate: float | str | None = None, *,
                        size_bytes: float, itemsize: int = 4, ranks: int | None = None,
                        placement: str | Sequence[int] = "sequential", compute: ComputeModel | None = None,
                        config: EngineConfig | None = None, on_progress: Callable[[int, int], None] | None = None,
                        on_status: Callable[[SimStatus], None] | None = None,
                        **options: Any) -> SimResult:
    """Simulate one collective of ``size_bytes`` (``size_bytes // itemsize`` elements) over
    ``ranks`` ranks (default: every host), rank ``r`` on host ``r`` or as ``placement`` says
    (``"sequential"``, ``"random"`` with the config's seed, or one host per rank). BML's
    ``n``/``k`` and hierarchical allreduce's ``radices`` default to the topology's shape.
    ``on_progress(tasks done, tasks)``: see :func:`~mlfabric.sim.engine.run_graph`."""
    topo = _topology(topology, link_rate)
    config = config or EngineConfig()
    world = topo.n_hosts if ranks is None else int(ranks)
    if not 1 <= world <= topo.n_hosts and isinstance(placement, str):
        raise ValueError(f"{world} ranks do not fit on the {topo.n_hosts} hosts of {topo.spec}")
    if isinstance(placement, str):
        if placement == "sequential":
            hosts = np.arange(world)
        elif placement == "random":
            rng = np.random.default_rng(np.random.SeedSequence([config.seed, _PLACEMENT_STREAM]))
            hosts = rng.permutation(topo.n_hosts)[:world]
        else:
            raise ValueError(f"collective placement must be 'sequential', 'random' or a host list, got {placement!r}")
    else:
        hosts = np.asarray(placement, dtype=np.int64)
    count = int(size_bytes) // itemsize
    kind = collective_kind(kind)
    if kind.startswith("allreduce:"):
        # BML's n, k and hierarchical's radices come from the topology unless given.
        algorithm = kind.split(":", 1)[1]
        if not (algorithm == "bcube" and {"n", "k"} <= options.keys()) and "radices" not in options:
            options = {**shape_options(algorithm, topo.spec), **options}
    graph = collective_graph(kind, world, count, itemsize=itemsize, placement=hosts,
                             compute=compute, seed=config.seed, **options)
    return run_graph(graph, topo, config, on_progress=on_progress, on_status=on_status)


def ring_closed_form_s(world_size: int, size_bytes: float, link_rate_bps: float) -> float:
    """BML §2: ``2 (N-1)/N x T_F`` with ``T_F = size / link rate`` (ring allreduce, and the P2P
    parameter server on a non-blocking network)."""
    return 2.0 * (world_size - 1) / world_size * size_bytes * 8.0 / link_rate_bps


# --------------------------------------------------------------------------- parameter server


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    """One parameter-server job (see the module docstring)."""

    workers: int
    servers: int
    model_bytes: float
    #: ``baseline``, ``binary``, ``rack`` or ``tree`` (with ``degree``).
    strategy: str = "baseline"
    degree: int | None = None
    #: 0 = BSP; s > 0 = SSP with staleness s.
    staleness: int = 0
    #: Where the pull of an iteration waits: ``"server"`` (server j pulls once every push to
    #: j arrived; MLNET's synchronous PS) or ``"global"`` (no pull starts before every push
    #: of the iteration arrived everywhere: a push phase, then a pull phase).
    barrier: str = "server"
    iterations: int = 1
    #: ``launch`` (servers on hosts 0..S-1, then the workers: rank r on host r of
    #: ``mlfabric launch`` and ``train --emulate``, whose PS ranks are servers first),
    #: ``random`` (disjoint hosts, seeded), ``sequential`` (workers then servers), ``colocated``
    #: (worker i and server i on host i: the P2P parameter server).
    placement: str = "random"
    worker_hosts: tuple[int, ...] | None = None
    server_hosts: tuple[int, ...] | None = None
    compute: ComputeModel | None = None
    priority: int = 0
    name: str = "ps"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1:
            raise ValueError(f"a parameter server needs >= 1 worker and >= 1 server, got {self.workers} and {self.servers}")
        if not (self.model_bytes >= 0 and math.isfinite(self.model_bytes)):
            raise ValueError(f"model_bytes must be finite and >= 0, got {self.model_bytes}")
        if self.strategy not in PS_STRATEGIES:
            raise ValueError(f"unknown PS strategy {self.strategy!r}; choose one of {', '.join(PS_STRATEGIES)}")
        if self.strategy == "tree" and (self.degree is None or self.degree < 1):
            raise ValueError("strategy 'tree' needs degree >= 1 (the in-degree d of MLNET's trees)")
        if self.strategy != "tree" and self.degree is not None:
            raise ValueError("degree applies to strategy 'tree' only (binary is d=2, rack is one aggregator per rack)")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0 (0 = BSP), got {self.staleness}")
        if self.barrier not in ("server", "global"):
            raise ValueError(f"barrier must be 'server' or 'global', got {self.barrier!r}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        for name, count in (("worker_hosts", self.workers), ("server_hosts", self.servers)):
            hosts = getattr(self, name)
            if hosts is not None:
                object.__setattr__(self, name, tuple(int(h) for h in hosts))
                if len(getattr(self, name)) != count:
                    raise ValueError(f"{name} must list {count} hosts, got {len(hosts)}")

    @property
    def tree_degree(self) -> int | None:
        return 2 if self.strategy == "binary" else self.degree


def ps_placement(topology: Topology, config: PSConfig, seed: int = 0, job: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(worker hosts, server hosts) for a job."""
    n, w, s = topology.n_hosts, config.workers, config.servers
    if config.worker_hosts is not None or config.server_hosts is not None:
        if config.worker_hosts is None or config.server_hosts is None:
            raise ValueError("give both worker_hosts and server_hosts, or neither")
        workers, servers = np.asarray(config.worker_hosts), np.asarray(config.server_hosts)
    elif config.placement == "colocated":
        if max(w, s) > n:
            raise ValueError(f"{max(w, s)} colocated roles do not fit on the {n} hosts of {topology.spec}")
        workers, servers = np.arange(w), np.arange(s)
    else:
        if w + s > n:
            raise ValueError(f"{w} workers + {s} servers do not fit on the {n} hosts of {topology.spec}; "
                             "use placement 'colocated' to put a worker and a server on one host")
        if config.placement == "launch":  # listed workers first, as the other placements
            hosts = np.r_[np.arange(s, s + w), np.arange(s)]
        elif config.placement == "sequential":
            hosts = np.arange(n)
        else:
            rng = np.random.default_rng(np.random.SeedSequence([seed, _PLACEMENT_STREAM, job]))
            hosts = rng.permutation(n)
        workers, servers = hosts[:w], hosts[w : w + s]
    for name, hosts in (("worker", workers), ("server", servers)):
        if hosts.size and (hosts.min() < 0 or hosts.max() >= n):
            raise ValueError(f"a {name} host is outside [0, {n}) of {topology.spec}")
    return workers.astype(np.int64), servers.astype(np.int64)


def tree_parents(topology: Topology, config: PSConfig, worker_hosts: np.ndarray, server_hosts: np.ndarray) -> np.ndarray:
    """``(S, W)``: the parent worker of each worker in server ``j``'s tree (-1: the server):
    :func:`mlfabric.topo.trees.tree_parents` (shared with the runtime's ``mlnet`` routing
    policy) with the racks read off ``topology``."""
    kind = "direct" if config.strategy == "baseline" else config.strategy
    racks = rack_of(topology, worker_hosts) if kind == "rack" else None
    return shared_tree_parents(kind, server_hosts.size, worker_hosts, degree=config.degree, racks=racks)


def ps_graph(topology: Topology, config: PSConfig, *, seed: int = 0, job: int = 0) -> TaskGraph:
    """The task graph of ``config.iterations`` iterations of a parameter-server job.

    Ranks in the graph: workers ``0..W-1``, servers ``W..W+S-1``.
    """
    worker_hosts, server_hosts = ps_placement(topology, config, seed, job)
    w, s, iters = config.workers, config.servers, config.iterations
    shard = np.asarray(piece_sizes(int(round(config.model_bytes)), s), dtype=np.float64)
    parents = tree_parents(topology, config, worker_hosts, server_hosts)  # (S, W)
    compute = config.compute.compute_times(iters, w, seed) if config.compute else np.zeros((iters, w))

    # Destination host of each push (and source of each pull): the parent worker's host or the server's.
    server_col = np.broadcast_to(server_hosts[:, None], (s, w))
    up_host = np.where(parents >= 0, worker_hosts[np.maximum(parents, 0)], server_col).ravel()
    worker_row = np.broadcast_to(worker_hosts[None, :], (s, w)).ravel()
    shard_sw = np.broadcast_to(shard[:, None], (s, w)).ravel()
    w_index = np.broadcast_to(np.arange(w)[None, :], (s, w)).ravel()
    j_index = np.broadcast_to(np.arange(s)[:, None], (s, w)).ravel()
    flat_parent = parents.ravel()
    child = np.flatnonzero(flat_parent >= 0)
    child_to = j_index[child] * w + flat_parent[child]  # flat (j, parent) index
    root = np.flatnonzero(flat_parent < 0)

    b = GraphBuilder(config.name)
    computes: list[np.ndarray] = []
    aggregates: list[np.ndarray] = []
    pulled: list[np.ndarray] = []
    for i in range(iters):
        comp = b.add_delays(compute[i], rank=np.arange(w), label="compute")
        push = b.add_transfers(worker_row, up_host, shard_sw, priority=config.priority, rank=w_index,
                               peer=w + j_index, label="push")
        agg = b.add_delays(0.0, n=s, rank=w + np.arange(s), label="aggregate")
        pull = b.add_transfers(up_host, worker_row, shard_sw, priority=config.priority, rank=w_index,
                               peer=w + j_index, label="pull")
        done = b.add_delays(0.0, n=w, rank=np.arange(w), label="pulled")
        b.add_edges(comp[w_index], push)  # own gradient before pushing
        b.add_edges(push[child], push[child_to])  # children before the aggregated push
        b.add_edges(push[root], agg[j_index[root]])  # server aggregates its children
        if config.barrier == "global":
            barrier = b.add_delays(0.0, n=1, label="barrier")
            b.add_edges(agg, barrier[np.zeros(s, dtype=np.int64)])
            b.add_edges(barrier[np.zeros(root.size, dtype=np.int64)], pull[root])
        else:
            b.add_edges(agg[j_index[root]], pull[root])  # server multicasts to its children
        b.add_edges(pull[child_to], pull[child])  # a node forwards once it received
        b.add_edges(pull, done[w_index])  # every shard pulled
        if i:
            b.add_edges(computes[-1], comp)  # a worker computes iterations in order
            b.add_edges(aggregates[-1], agg)  # a server aggregates iterations in order
        gate = i - 1 - config.staleness
        if gate >= 0:
            b.add_edges(pulled[gate], comp)  # staleness bound
        computes.append(comp)
        aggregates.append(agg)
        pulled.append(done)
    return b.build()


def concurrent_ps_graph(topology: Topology, configs: Sequence[PSConfig], *, seed: int = 0,
                        priorities: Sequence[int] | None = None) -> TaskGraph:
    """Several parameter-server jobs on one cluster, each placed independently (job ``i`` with
    placement stream ``i``); ``priorities[i]`` (0 first) overrides ``configs[i].priority``."""
    graphs = [ps_graph(topology, cfg, seed=seed, job=i) for i, cfg in enumerate(configs)]
    prios = list(priorities) if priorities is not None else [cfg.priority for cfg in configs]
    names = [cfg.name if len({c.name for c in configs}) == len(configs) else f"{cfg.name}{i}" for i, cfg in enumerate(configs)]
    return merge_graphs(graphs, names=names, priorities=prios)


def simulate_ps(topology: Topology | str, link_rate: float | str | None = None, ps: PSConfig | None = None, *,
                config: EngineConfig | None = None, jobs: int = 1, priorities: Sequence[int] | None = None,
                on_progress: Callable[[int, int], None] | None = None,
                on_status: Callable[[SimStatus], None] | None = None) -> SimResult:
    """Simulate a parameter-server job (or ``jobs`` copies of it placed independently, with
    ``priorities``) on a topology. ``on_progress(tasks done, tasks)``: see
    :func:`~mlfabric.sim.engine.run_graph`."""
    if ps is None:
        raise ValueError("simulate_ps needs a PSConfig")
    topo = _topology(topology, link_rate)
    config = config or EngineConfig()
    if jobs == 1 and priorities is None:
        graph = ps_graph(topo, ps, seed=config.seed)
    else:
        configs = [replace(ps, name=f"{ps.name}{i}") for i in range(jobs)]
        graph = concurrent_ps_graph(topo, configs, seed=config.seed, priorities=priorities)
    return run_graph(graph, topo, config, on_progress=on_progress, on_status=on_status)


def iteration_times(result: SimResult, iterations: int, workers: int, job: int = 0) -> np.ndarray:
    """End of each iteration of a PS job: when its last worker held every shard."""
    g = result.graph
    label = g.label_names.index("pulled")
    mask = (g.job == job) & (g.label == label)
    finish = result.task_finish_s[mask].reshape(iterations, workers)
    return finish.max(axis=1)

