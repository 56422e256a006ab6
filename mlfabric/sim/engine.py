"""The flow-level discrete-event engine: runs a task graph on a topology with max-min sharing.

    from mlfabric.sim import simulate_collective
    result = simulate_collective("allreduce:ring", "star:n=8", "10Gbps", size_bytes=100e6)
    result.time_s          # simulated seconds of one collective

Model. Every transfer task that becomes ready starts a *flow* from its source host to its
destination host, routed by the topology (seeded per-flow ECMP, or packet spraying: the flow
split evenly over all shortest paths). Flows share links max-min fairly (TCP-like), solved by
:class:`~mlfabric.flow.FlowNetwork`, which re-solves incrementally when flows come and go.
The engine repeats:

1. run every task that is ready *now*: zero-time tasks complete at once (and may make more
   tasks ready), delays set a timer, transfers start flows (all flows started at one instant
   are routed and added in one batch) — except that a transfer on a FIFO connection
   (``TaskGraph.connection``: a rank's messages to one peer on one channel) waits until the
   connection's previous message has arrived, as over one TCP stream;
2. re-solve the rates (only flows whose rate can change get new finish times);
3. advance the clock to the earliest flow finish or timer; every flow finishing within
   ``batch_rtol`` (relative) of that instant completes in the same batch, so flows that
   finish together in exact arithmetic cost one re-solve, not one each.

Most events of a large run only finish flows, count down dependencies and start the flows
of the transfers made ready; with the compiled kernel built, one priority class and no
message latency, those run whole in a compiled loop (``_fill.run_events``,
``mlfabric/flow/_events.c``): every transfer's route is computed once up front, and the
loop completes zero-time tasks, queues and releases FIFO connections, starts flows and
re-solves, handing back to Python only for timers, full solves it cannot do, and batches it
has no room for (issue #37: a ring event went from ~0.7 ms of Python to a few us). Events
whose change stays local (a ring step) skip the re-solve (see ``solve_isolated``). Results
are bit-identical to the Python loop (``EngineConfig(compiled_loop=False)``) on the tests'
runs; ``EngineConfig(compiled_tasks=False)`` is the loop as it was before #37.

Transfers between ranks on the same host use the host's host-internal link when the topology
has one (:meth:`Topology.with_host_links <mlfabric.topo.Topology.with_host_links>`: the
shared-memory hop, at its own rate, shared max-min with the host's other internal
transfers); without one they use no link and complete immediately. Zero-byte transfers
complete immediately, or after ``latency_s`` (a per-message latency added to every network message;
default 0, the fluid model of the closed-form costs). Per-link byte counts are accumulated
when a flow starts (``bytes x`` the fraction of the flow on each link), so they are exact.

Priorities (MLNET §3 "network prioritization"): every transfer has a priority class (0 is
served first). Classes are *strict*: class 0's flows get the max-min allocation of the full
link capacities; class 1's flows get the max-min allocation of what class 0 leaves on every
link, and so on. A high-priority job is therefore slowed down by lower ones only where it
does not saturate a link by itself; it finishes as if alone when it saturates its
bottlenecks. (This is the fluid limit of strict-priority switch queues, the mechanism MLNET
proposes when switches have enough queues; its host-side connection dropping gives the same
order at the edge.) Each class is one ``FlowNetwork`` whose capacities are updated when a
higher class's load changes.

Watchdog: if no flow can make progress (no flows, or all at rate 0), no timer is pending and
tasks are unfinished, the run fails with :class:`SimulationStalled` naming the stuck tasks
(a deadlocked schedule set, a cycle in a graph, a flow over a zero-capacity link); the same
if an event completes nothing repeatedly, or the number of events or the wall time exceeds
its limit. Results are deterministic: the same graph, topology and seed give bit-identical
times and byte counts (wall times aside).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py tests/unit/test_sim_scale.py -q
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlfabric.flow import FlowNetwork, Incidence, UpdateStats, naive_max_min
from mlfabric.flow.network import _fill
from mlfabric.topo import Topology, ecmp_hash
from mlfabric.topo.routing import incidence_from_entries

from .graph import DELAY, TRANSFER, TaskGraph

__all__ = ["EngineConfig", "Engine", "NaiveNetwork", "SimResult", "SimStatus", "SimulationStalled", "run_graph", "ROUTINGS",
           "SOLVERS"]

ROUTINGS = ("ecmp", "spray")
SOLVERS = ("flow", "naive")

_WAITING, _ACTIVE, _DONE = 0, 1, 2
# How many flows the finish-time candidate set holds after a rebuild, and past how many its
# horizon is lowered (see _FlowClass); the compiled helpers' values where they are built.
_CANDIDATES = _fill.CANDIDATES if _fill is not None else 2048
_CANDIDATES_MAX = _fill.CANDIDATES_MAX if _fill is not None else 4 * _CANDIDATES
# Up to this many dependency edges, Engine._complete releases dependents in a Python loop.
_FEW_EDGES = 24
# Where the compiled loop (_fill.run_events, mlfabric/flow/_events.c) hands back to Python:
# between events (for a re-solve it does not do; or to pause), after the re-solve, after
# taking finished flows, with tasks made ready.
_STOP_TOP, _STOP_REFRESHED, _STOP_POPPED, _STOP_READY, _STOP_PAUSE = range(5)
# At most this many events per call of the compiled loop (between calls the engine checks
# its wall-time limit).
_COMPILED_BUDGET = 4096
#: Least wall time between two ``on_progress`` calls of a run (seconds).
PROGRESS_INTERVAL_S = 0.1


@dataclass(frozen=True, kw_only=True)
class SimStatus:
    """Where a run stands (``on_status``; ``mlfabric simulate ... --progress`` prints it)."""

    tasks_done: int
    tasks: int
    events: int
    flows: int
    #: Simulated time reached (seconds).
    sim_time_s: float
    #: Wall time since the run started (seconds).
    wall_s: float
    #: True on the last call, when the run is over.
    finished: bool = False


class SimulationStalled(RuntimeError):
    """The simulation cannot make progress; ``stuck`` describes the unfinished tasks."""

    def __init__(self, message: str, *, time_s: float, stuck: list[str]) -> None:
        super().__init__(message)
        self.time_s = time_s
        self.stuck = stuck


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine routes and batches; defaults are the fluid model of the closed forms."""

    #: ``"ecmp"``: one shortest path per flow, hashed with ``seed``; ``"spray"``: every flow
    #: split evenly over all its shortest paths (per-packet load balancing).
    routing: str = "ecmp"
    seed: int = 0
    #: Added to every message that crosses the network (seconds).
    latency_s: float = 0.0
    #: Flows finishing within this relative distance of the next event finish with it.
    batch_rtol: float = 1e-9
    #: Watchdog: at most this many events (default: 4 x tasks + 1000).
    max_events: int | None = None
    #: Watchdog: fail after this much wall time (seconds); None = no limit.
    max_wall_s: float | None = None
    #: ``"flow"``: the incremental vectorized :class:`~mlfabric.flow.FlowNetwork`;
    #: ``"naive"``: :class:`NaiveNetwork`, a from-scratch pure-Python solve at every event
    #: (the baseline of ``mlfabric bench sim`` and a cross-check in tests).
    solver: str = "flow"
    #: Run the common events (flows finish, dependents count down, nothing new starts) in
    #: the compiled loop (``mlfabric/flow/_events.c``): the same results, without Python's
    #: per-event overhead. Used when the kernel is built, with one priority class and
    #: ``latency_s == 0``; False runs every event in Python (tests compare the two).
    compiled_loop: bool = True
    #: With the compiled loop: it also runs the tasks that become ready (zero-time tasks
    #: complete, transfers start their flows on routes computed once up front, FIFO
    #: connections queue and release) and hands back to Python only for timers and for what
    #: it has no room for (issue #37: a ring event cost ~0.7 ms of Python, now a few us).
    #: False: the engine as it was before (every event that starts a flow runs in Python),
    #: kept for the side-by-side benchmark and the equality tests.
    compiled_tasks: bool = True

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be a finite time >= 0, got {self.latency_s}")
        if not 0 <= self.batch_rtol <= 1e-2:
            raise ValueError(f"batch_rtol must be in [0, 1e-2], got {self.batch_rtol}")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}")
        if self.max_wall_s is not None and not self.max_wall_s > 0:
            raise ValueError(f"max_wall_s must be > 0, got {self.max_wall_s}")


@dataclass(eq=False, kw_only=True)
class SimResult:
    """What a run produced. Times are simulated seconds from 0 (the start of the graph)."""

    graph: TaskGraph = field(repr=False)
    topology: Topology = field(repr=False)
    config: EngineConfig
    #: Completion time of the last task (the makespan; 0 for an empty graph).
    time_s: float
    #: Makespan of each job (``graph.job_names`` order).
    job_time_s: np.ndarray
    task_start_s: np.ndarray = field(repr=False)
    task_finish_s: np.ndarray = field(repr=False)
    #: Bytes carried by every link over the whole run (fractional under spraying).
    link_bytes: np.ndarray = field(repr=False)
    flows: int
    events: int
    solver_updates: dict[str, int]
    wall_s: float

    def rank_finish_s(self, job: int = 0) -> np.ndarray:
        """Completion time of each rank's last task in ``job`` (ranks with no task: 0)."""
        mask = (self.graph.job == job) & (self.graph.rank >= 0)
        ranks = self.graph.rank[mask]
        out = np.zeros(int(ranks.max()) + 1 if ranks.size else 0)
        np.maximum.at(out, ranks, self.task_finish_s[mask])
        return out

    def host_bytes_sent(self) -> np.ndarray:
        """Bytes each host sent into the network (sum over its NICs' egress links)."""
        nics = self.topology.nic_links[:, :, 0]
        return np.where(nics >= 0, self.link_bytes[np.maximum(nics, 0)], 0.0).sum(axis=1)

    def link_summary(self) -> dict[str, Any]:
        """Per-layer totals and maxima of the link byte counts."""
        topo = self.topology
        layers = {}
        for index, name in enumerate(topo.layer_names):
            members = self.link_bytes[topo.link_layer == index]
            if members.size:
                layers[name] = {"links": int(members.size), "total_bytes": float(members.sum()),
                                "max_bytes": float(members.max()), "mean_bytes": float(members.mean())}
        return {"total_bytes": float(self.link_bytes.sum()), "max_bytes": float(self.link_bytes.max(initial=0.0)),
                "busy_links": int(np.count_nonzero(self.link_bytes)), "layers": layers}

    def to_dict(self, *, links: str = "nonzero") -> dict[str, Any]:
        """JSON-ready figures: ``time_s``, per-job times, per-link byte counts (``links``:
        ``"nonzero"``, ``"all"`` or ``"none"``), counts and the engine configuration."""
        topo = self.topology
        out: dict[str, Any] = {
            "time_s": self.time_s,
            "jobs": [{"name": name, "time_s": float(t)} for name, t in zip(self.graph.job_names, self.job_time_s)],
            "topology": str(topo.spec),
            "link_rate_bps": topo.link_rate_bps,
            "routing": self.config.routing,
            "seed": self.config.seed,
            "latency_s": self.config.latency_s,
            "tasks": self.graph.n_tasks,
            "flows": self.flows,
            "events": self.events,
            "solver_updates": dict(self.solver_updates),
            "wall_s": self.wall_s,
            "link_summary": self.link_summary(),
        }
        if links != "none":
            ids = np.arange(topo.n_links) if links == "all" else np.flatnonzero(self.link_bytes)
            out["link_bytes"] = [
                {"link": int(l), "name": topo.link_name(int(l)), "layer": topo.layer_names[int(topo.link_layer[l])],
                 "bytes": float(self.link_bytes[l])}
                for l in ids.tolist()
            ]
        return out


class NaiveNetwork:
    """The part of :class:`~mlfabric.flow.FlowNetwork`'s interface the engine uses, re-solving
    every flow from scratch with :func:`~mlfabric.flow.naive_max_min` after each change."""

    def __init__(self, link_capacity: np.ndarray) -> None:
        self._capacity = np.asarray(link_capacity, dtype=np.float64).copy()
        self.n_links = int(self._capacity.size)
        self._flows: dict[int, list[tuple[int, float]]] = {}
        self._rate: dict[int, float] = {}
        self._next = 0
        self._dirty = False
        self.last_resolved = np.zeros(0, dtype=np.int64)

    @property
    def n_flows(self) -> int:
        return len(self._flows)

    def flow_ids(self) -> np.ndarray:
        return np.fromiter(sorted(self._flows), dtype=np.int64, count=len(self._flows))

    def add_flows(self, incidence: Incidence) -> np.ndarray:
        ids = np.arange(self._next, self._next + incidence.n_flows, dtype=np.int64)
        self._next += incidence.n_flows
        for flow, entries in zip(ids.tolist(), incidence.to_lists()):
            self._flows[flow] = entries
        self._dirty = True
        return ids

    def remove_flows(self, ids: np.ndarray) -> None:
        for flow in np.asarray(ids).tolist():
            del self._flows[flow]
            self._rate.pop(flow, None)
        self._dirty = True

    def set_capacity(self, links: np.ndarray, capacity: np.ndarray) -> None:
        self._capacity[np.asarray(links)] = capacity
        self._dirty = True

    def update(self) -> UpdateStats:
        if not self._dirty:
            self.last_resolved = np.zeros(0, dtype=np.int64)
            return UpdateStats(kind="none", flows_total=len(self._flows), flows_resolved=0, divergence_level=math.inf)
        ids = self.flow_ids()
        rates = naive_max_min([self._flows[f] for f in ids.tolist()], self._capacity.tolist())
        self._rate = dict(zip(ids.tolist(), rates))
        self._dirty = False
        self.last_resolved = ids
        return UpdateStats(kind="full", flows_total=ids.size, flows_resolved=ids.size, divergence_level=0.0)

    def rates(self, ids: np.ndarray) -> np.ndarray:
        self.update()
        return np.array([self._rate[f] for f in np.asarray(ids).tolist()], dtype=np.float64)

    def last_resolved_rates(self) -> np.ndarray:
        return np.array([self._rate[f] for f in self.last_resolved.tolist()], dtype=np.float64)

    def link_load(self) -> np.ndarray:
        self.update()
        load = np.zeros(self.n_links)
        for flow, entries in self._flows.items():
            for link, weight in entries:
                load[link] += weight * self._rate[flow]
        return load

    def incidence(self, ids: np.ndarray) -> Incidence:
        rows = [self._flows[f] for f in np.asarray(ids).tolist()]
        return Incidence.from_paths([[l for l, _ in r] for r in rows], self.n_links, [[w for _, w in r] for r in rows])


class _FlowClass:
    """The flows of one priority class: a FlowNetwork plus per-flow progress.

    Finish times live in ``finish`` (indexed by flow id, inf for free slots). To avoid a scan
    of every flow per event, ``candidates`` (without repeats; ``in_candidates`` marks them)
    holds every live flow whose finish time is at most ``horizon``, plus possibly flows that
    have since moved past it (dropped on the next look). When it runs empty it is rebuilt
    from the ``_CANDIDATES`` earliest finish times. When more than ``_CANDIDATES_MAX`` are
    due by the horizon (finish times bunched: on a 300 x 300 per-server iteration, 52k of
    ~90k flows on average, scanned at every event), the horizon is lowered to the
    ``_CANDIDATES``-th earliest of them.
    """

    def __init__(self, priority: int, capacity: np.ndarray, solver: str = "flow") -> None:
        self.priority = priority
        self.capacity = capacity.copy()
        self.network: FlowNetwork | NaiveNetwork = (
            FlowNetwork(self.capacity) if solver == "flow" else NaiveNetwork(self.capacity))
        self.task = np.zeros(0, dtype=np.int64)
        # Per flow id: remaining bits, rate, stamp (when remaining was last drained), finish
        # time, side by side in one row (the columns of _fill.progress): an event's update of
        # a changed flow touches one cache line, not four scattered arrays.
        self.record = np.zeros((0, 4))
        self._views()
        self.in_candidates = np.zeros(0, dtype=bool)
        self.horizon = -math.inf
        self.candidates = np.zeros(0, dtype=np.int64)
        self.updates: dict[str, int] = {}
        # The per-event bookkeeping in the compiled helpers (_fill.progress, earliest, take).
        self._native = _fill is not None and isinstance(self.network, FlowNetwork)

    def _views(self) -> None:
        self.remaining, self.rate, self.stamp, self.finish = (self.record[:, column] for column in range(4))

    def _grow(self, needed: int) -> None:
        if needed <= self.finish.size:
            return
        size = max(needed, 2 * self.finish.size, 64)
        for name, fill in (("task", -1), ("in_candidates", False)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
        record = np.zeros((size, 4))
        record[:, 3] = math.inf  # finish
        record[: self.record.shape[0]] = self.record
        self.record = record
        self._views()

    def add(self, tasks: np.ndarray, incidence: Incidence, bits: np.ndarray, now: float) -> None:
        ids = self.network.add_flows(incidence)
        self._grow(int(ids.max()) + 1)
        self.task[ids] = tasks
        self.remaining[ids] = bits
        self.rate[ids] = 0.0
        self.stamp[ids] = now
        self.finish[ids] = math.inf

    def set_capacity(self, capacity: np.ndarray) -> None:
        changed = np.flatnonzero(capacity != self.capacity)
        if changed.size:
            self.network.set_capacity(changed, capacity[changed])
            self.capacity = capacity.copy()

    def refresh(self, now: float) -> None:
        stats = self.network.update()
        self.updates[stats.kind] = self.updates.get(stats.kind, 0) + 1
        changed = self.network.last_resolved
        if not changed.size:
            return
        if self._native:
            # The same arithmetic as below, compiled: one call instead of ~15 numpy passes.
            near = np.empty(changed.size, dtype=np.int64)
            n_near = _fill.progress(changed, self.network.last_resolved_rates(), self.record, self.in_candidates, near,
                                    now, self.horizon)
            if n_near:
                self.candidates = np.concatenate([self.candidates, near[:n_near]])
            return
        rate_old = self.rate[changed]
        remaining = self.remaining[changed] - rate_old * (now - self.stamp[changed])
        np.maximum(remaining, 0.0, out=remaining)
        self.remaining[changed] = remaining
        self.stamp[changed] = now
        rate = self.network.last_resolved_rates()
        self.rate[changed] = rate
        with np.errstate(divide="ignore", invalid="ignore"):
            finish = remaining / rate  # inf at rate 0 (remaining > 0), nan at 0/0, 0 at rate inf
        finish[np.isnan(finish)] = 0.0
        finish += now
        self.finish[changed] = finish
        near = changed[finish <= self.horizon]
        if near.size:
            near = near[~self.in_candidates[near]]
            self.in_candidates[near] = True
            self.candidates = np.concatenate([self.candidates, near])

    def next_finish(self) -> float:
        """Earliest finish time of a live flow (inf when none can finish)."""
        if self.network.n_flows == 0:
            return math.inf
        cand = self.candidates
        if cand.size and self._native:
            kept, first, self.horizon = _fill.earliest(cand, self.record, self.in_candidates, self.horizon)
            self.candidates = cand[:kept]
            if kept:
                return first
        elif cand.size:
            times = self.finish[cand]
            if cand.size > _CANDIDATES_MAX and np.count_nonzero(times <= self.horizon) > _CANDIDATES_MAX:
                # Most flows are due by the horizon: lower it (as _fill.earliest does).
                self.horizon = float(np.partition(times, _CANDIDATES - 1)[_CANDIDATES - 1])
            keep = times <= self.horizon
            if not keep.all():
                self.in_candidates[cand[~keep]] = False
                cand, times = cand[keep], times[keep]
                self.candidates = cand
            if cand.size:
                return float(times.min())
        if self._native:
            out = np.empty(self.record.shape[0], dtype=np.int64)
            n_cand, self.horizon, first = _fill.rebuild(self.record, self.in_candidates, out)
            self.candidates = out[:n_cand].copy()
            return first
        finish = self.finish
        finite = finish[np.isfinite(finish)]
        if not finite.size:
            self.horizon = -math.inf
            return math.inf
        if finite.size > _CANDIDATES:
            self.horizon = float(np.partition(finite, _CANDIDATES - 1)[_CANDIDATES - 1])
        else:
            self.horizon = float(finite.max())
        cand = np.flatnonzero(finish <= self.horizon)
        self.in_candidates[cand] = True
        self.candidates = cand
        return float(finish[cand].min())

    def pop_finished(self, threshold: float) -> np.ndarray:
        """Remove the flows finishing by ``threshold``; returns their tasks."""
        if threshold <= self.horizon and self._native:
            # Compiled: the finished candidates' finish times and marks are reset on the way.
            cand = self.candidates
            out = np.empty(cand.size, dtype=np.int64)
            kept, taken = _fill.take(cand, self.record, self.in_candidates, threshold, out)
            self.candidates, done = cand[:kept], out[:taken]
            if not taken:
                return np.zeros(0, dtype=np.int64)
        else:
            if threshold > self.horizon:
                done = np.flatnonzero(self.finish <= threshold)
                if self.candidates.size:
                    keep = self.finish[self.candidates] > threshold
                    self.candidates = self.candidates[keep]
            else:
                cand = self.candidates
                hit = self.finish[cand] <= threshold
                done = cand[hit]
                self.candidates = cand[~hit]
            if not done.size:
                return np.zeros(0, dtype=np.int64)
            self.in_candidates[done] = False
            self.finish[done] = math.inf
        tasks = self.task[done].copy()
        self.task[done] = -1
        self.network.remove_flows(done)
        return tasks

    def stalled(self) -> np.ndarray:
        """Live flow ids with zero rate (after a refresh)."""
        ids = self.network.flow_ids()
        return ids[self.rate[ids] <= 0]


class Engine:
    """Runs one :class:`TaskGraph` on one :class:`Topology`; see the module docstring."""

    def __init__(self, graph: TaskGraph, topology: Topology, config: EngineConfig | None = None, *,
                 on_progress: Callable[[int, int], None] | None = None,
                 on_status: Callable[[SimStatus], None] | None = None) -> None:
        self.graph = graph
        self.topology = topology
        self.config = config or EngineConfig()
        #: ``on_progress(tasks done, tasks)``, at most every PROGRESS_INTERVAL_S of wall time and at the end.
        self.on_progress = on_progress
        #: ``on_status(SimStatus)``, as often as ``on_progress``: events, flows, simulated time.
        self.on_status = on_status
        transfers = graph.kind == TRANSFER
        if transfers.any():
            hosts = np.concatenate([graph.src[transfers], graph.dst[transfers]])
            if hosts.min() < 0 or hosts.max() >= topology.n_hosts:
                bad = int(np.flatnonzero(transfers & ((graph.src < 0) | (graph.src >= topology.n_hosts)
                                                       | (graph.dst < 0) | (graph.dst >= topology.n_hosts)))[0])
                raise ValueError(f"{graph.describe(bad)} names a host outside [0, {topology.n_hosts}) of {topology.spec}")
        self._multi_nic = topology.n_nics > 1
        priorities = np.unique(graph.priority[transfers]) if transfers.any() else np.zeros(0, dtype=np.int64)
        capacity = topology.capacity()
        self._classes = [_FlowClass(int(p), capacity, self.config.solver) for p in priorities.tolist()]
        self._class_of = {int(p): i for i, p in enumerate(priorities.tolist())}
        self._timers: list[tuple[float, int, np.ndarray]] = []
        self._timer_seq = 0
        self.now = 0.0
        n = graph.n_tasks
        self.state = np.full(n, _WAITING, dtype=np.int8)
        self.need = graph.need_all.copy()
        self.any_wait = graph.has_any.copy()
        self.start_s = np.full(n, math.nan)
        self.finish_s = np.full(n, math.nan)
        self.link_bytes = np.zeros(topology.n_links)
        # FIFO connections: whether one has a flow on the wire, and the transfers queued behind
        # it (a linked list in arrays, which the compiled loop reads too: head and tail per
        # connection, next per task; -1 = none).
        n_connections = int(graph.connection.max(initial=-1)) + 1
        self._connection_busy = np.zeros(n_connections, dtype=bool)
        self._queue_head = np.full(n_connections, -1, dtype=np.int64)
        self._queue_tail = np.full(n_connections, -1, dtype=np.int64)
        self._queue_next = np.full(n, -1, dtype=np.int64)
        self.flows = 0
        self.events = 0
        self.done = 0
        self._compiled = (self.config.compiled_loop and self.config.latency_s == 0 and len(self._classes) == 1
                          and self._classes[0]._native and hasattr(_fill, "run_events"))
        self._freed_buffer = np.zeros(0, dtype=np.int64)
        self._candidate_buffer = np.zeros(0, dtype=np.int64)
        self._pending_buffer = np.zeros(0, dtype=np.int64)
        self._pending_count = 0
        self._task_buffer = np.empty(n, dtype=np.int64)
        self._tasks_compiled = self._compiled and self.config.compiled_tasks and self.config.solver == "flow"
        #: Wall time spent in __init__ routing every transfer up front (counted in wall_s).
        self._setup_wall_s = 0.0
        if self._tasks_compiled:
            wall0 = time.perf_counter()
            self._route_all()
            self._setup_wall_s = time.perf_counter() - wall0

    def _route_all(self) -> None:
        """Every transfer's route, computed once (the compiled loop starts flows from them):
        ``_route_of[task]`` indexes the rows ``_route_ptr``/``_route_links``/``_route_weights``
        (-1: the transfer completes at once: empty, or same-host without a host link).

        The transfers of one FIFO connection share one route (same hosts, NIC and ECMP key:
        a 1,024-rank ring's 2 M messages are 1,024 routes); any other transfer gets its own.
        The rows are what ``_route`` gives when the flows start (routing is per row)."""
        g = self.graph
        n = g.n_tasks
        route_of = np.full(n, -1, dtype=np.int64)
        network = (g.kind == TRANSFER) & (g.size_bytes > 0)
        if self.topology.host_links is None:
            network &= g.src != g.dst
        tasks = np.flatnonzero(network)
        conn = g.connection[tasks]
        on_conn = conn >= 0
        rep_of_conn = np.full(self._connection_busy.size, -1, dtype=np.int64)
        # The first task of each connection represents it; the others must agree with it.
        rep_of_conn[conn[on_conn][::-1]] = tasks[on_conn][::-1]
        reps = rep_of_conn[conn[on_conn]]
        same = np.ones(reps.size, dtype=bool)
        for column in (g.src, g.dst, g.nic, g.flow_key):
            same &= column[reps] == column[tasks[on_conn]]
        shared = tasks[on_conn][same]
        own = np.concatenate([tasks[~on_conn], tasks[on_conn][~same]])
        connections = np.flatnonzero(rep_of_conn >= 0)
        routed = np.concatenate([rep_of_conn[connections], np.sort(own)])
        if routed.size:
            incidence = self._route(routed)
            self._route_ptr = incidence.indptr.astype(np.int64)
            self._route_links = incidence.links.astype(np.int64)
            self._route_weights = incidence.weight_array().astype(np.float64)
        else:
            self._route_ptr = np.zeros(1, dtype=np.int64)
            self._route_links = np.zeros(0, dtype=np.int64)
            self._route_weights = np.zeros(0)
        index_of_conn = np.full(self._connection_busy.size, -1, dtype=np.int64)
        index_of_conn[connections] = np.arange(connections.size)
        route_of[shared] = index_of_conn[g.connection[shared]]
        route_of[routed[connections.size:]] = connections.size + np.arange(routed.size - connections.size)
        self._route_of = route_of

    # ------------------------------------------------------------------ routing

    def _route(self, tasks: np.ndarray) -> Incidence:
        topo = self.topology
        if topo.host_links is None:
            return self._route_network(tasks)
        # Same-host transfers take their host's internal link; the router (built for the
        # links between hosts) routes the rest, over the topology's full link set.
        local = self.graph.src[tasks] == self.graph.dst[tasks]
        parts, order = [], []
        if (~local).any():
            routed = self._route_network(tasks[~local])
            parts.append(Incidence(indptr=routed.indptr, links=routed.links, weights=routed.weights,
                                   n_links=topo.n_links))
            order.append(np.flatnonzero(~local))
        if local.any():
            rows = np.flatnonzero(local)
            parts.append(Incidence(indptr=np.arange(rows.size + 1, dtype=np.int64),
                                   links=topo.host_links[self.graph.src[tasks[rows]]], weights=None,
                                   n_links=topo.n_links))
            order.append(rows)
        inverse = np.empty(tasks.size, dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(tasks.size)
        return Incidence.concat(parts).subset(inverse)

    def _route_network(self, tasks: np.ndarray) -> Incidence:
        g, topo, cfg = self.graph, self.topology, self.config
        pairs = np.stack([g.src[tasks], g.dst[tasks]], axis=1)
        special = (g.nic[tasks] >= 0) if self._multi_nic else np.zeros(tasks.size, dtype=bool)
        if not special.any():
            if cfg.routing == "ecmp":
                return topo.route_ecmp(pairs, seed=cfg.seed, flow_keys=g.flow_key[tasks])
            return topo.route_spray(pairs)
        normal = np.flatnonzero(~special)
        parts = []
        if normal.size:
            sub = pairs[normal]
            parts.append(topo.route_ecmp(sub, seed=cfg.seed, flow_keys=g.flow_key[tasks[normal]]) if cfg.routing == "ecmp"
                         else topo.route_spray(sub))
        rows = np.flatnonzero(special)
        parts.append(self._route_by_nic(tasks[rows]))
        order = np.concatenate([normal, rows])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return Incidence.concat(parts).subset(inverse)

    def _route_by_nic(self, tasks: np.ndarray) -> Incidence:
        """Paths that leave the sender through the task's NIC (all shortest paths when none does).

        Vectorized over the tasks, one ``router.select`` per path index: a per-pair path
        enumeration cost ~150 us a pair, i.e. minutes for the million distinct pairs of a
        1,024-host all-to-all (BML's P2P parameter server on BCube(32,2)).
        """
        g, topo, cfg = self.graph, self.topology, self.config
        src, dst, nic = g.src[tasks], g.dst[tasks], g.nic[tasks]
        counts = topo.router.path_counts(src, dst)
        has_nic = nic < topo.n_nics
        egress = np.full(tasks.size, -1, dtype=np.int64)
        egress[has_nic] = topo.nic_links[src[has_nic], nic[has_nic], 0]
        width = int(counts.max(initial=0))
        chosen: list[tuple[np.ndarray, Incidence]] = []  # per path index: (task rows, their paths)
        match = np.zeros((tasks.size, width), dtype=bool)  # path i of row f leaves through its NIC
        for index in range(width):
            rows = np.flatnonzero(counts > index)
            paths = topo.router.select(src[rows], dst[rows], np.full(rows.size, index, dtype=np.int64))
            nonempty = paths.lengths() > 0
            first = np.full(rows.size, -2, dtype=np.int64)  # -2 never equals an egress (-1 = no NIC)
            first[nonempty] = paths.links[paths.indptr[:-1][nonempty]]
            match[rows, index] = first == egress[rows]
            chosen.append((rows, paths))
        exists = np.arange(width) < counts[:, None]
        none = ~match.any(axis=1)
        match[none] = exists[none]  # no path starts at that NIC: any shortest path
        n_match = match.sum(axis=1)
        if cfg.routing == "ecmp":
            # The (h mod m)-th matching path, as in the per-pair loop this replaces.
            hashes = ecmp_hash(src, dst, g.flow_key[tasks], cfg.seed)
            pick = (hashes % np.maximum(n_match, 1).astype(np.uint64)).astype(np.int64)
            weight = (match & (np.cumsum(match, axis=1) - 1 == pick[:, None])).astype(np.float64)
        else:
            weight = match / np.maximum(n_match, 1)[:, None]
        flows, links, weights = [], [], []
        for index, (rows, paths) in enumerate(chosen):
            entry_rows = rows[paths.entry_flows()]
            w = weight[entry_rows, index]
            keep = w > 0
            flows.append(entry_rows[keep])
            links.append(paths.links[keep])
            weights.append(w[keep])
        if not flows:
            return Incidence(indptr=np.zeros(tasks.size + 1, dtype=np.int64), links=np.zeros(0, dtype=np.int64),
                             weights=np.zeros(0), n_links=topo.n_links)
        # Repeated (flow, link) entries add up and rows come out sorted by link (merge_duplicates).
        return incidence_from_entries(tasks.size, topo.n_links, np.concatenate(flows), np.concatenate(links),
                                      np.concatenate(weights))

    # ------------------------------------------------------------------ task life cycle

    def _timer(self, at: np.ndarray, tasks: np.ndarray) -> None:
        order = np.argsort(at, kind="stable")
        at, tasks = at[order], tasks[order]
        bounds = np.flatnonzero(np.diff(at)) + 1
        for chunk_at, chunk in zip(np.split(at, bounds), np.split(tasks, bounds)):
            heapq.heappush(self._timers, (float(chunk_at[0]), self._timer_seq, chunk))
            self._timer_seq += 1

    def _activate(self, tasks: np.ndarray) -> np.ndarray:
        """Start tasks that became ready now; returns those that complete immediately."""
        g, now = self.graph, self.now
        self.start_s[tasks] = now
        kind = g.kind[tasks]
        immediate = []
        delays = tasks[kind == DELAY]
        if delays.size:
            duration = g.duration_s[delays]
            zero = duration <= 0
            immediate.append(delays[zero])
            if not zero.all():
                self._timer(now + duration[~zero], delays[~zero])
        transfers = tasks[kind == TRANSFER]
        if transfers.size:
            src, dst = g.src[transfers], g.dst[transfers]
            size = g.size_bytes[transfers]
            # Same-host transfers are flows too when the host has an internal link.
            local = (src == dst) if self.topology.host_links is None else np.zeros(src.size, dtype=bool)
            empty = (size <= 0) & ~local
            immediate.append(transfers[local])
            if empty.any():
                if self.config.latency_s > 0:
                    self._timer(np.full(int(empty.sum()), now + self.config.latency_s), transfers[empty])
                else:
                    immediate.append(transfers[empty])
            network = self._admit(transfers[~local & ~empty])
            if network.size:
                self._start_flows(network)
        if not immediate:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(immediate) if len(immediate) > 1 else immediate[0]

    def _admit(self, tasks: np.ndarray) -> np.ndarray:
        """The ready transfers that may start now: those on no connection, and the first one
        (lowest task id, i.e. op order) of each idle connection; the others queue behind it."""
        connection = self.graph.connection[tasks]
        fifo = connection >= 0
        if not fifo.any():
            return tasks
        queued, keys = tasks[fifo], connection[fifo]
        order = np.lexsort((queued, keys))
        queued, keys = queued[order], keys[order]
        first = np.ones(keys.size, dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        start = first & ~self._connection_busy[keys]
        head, tail, after = self._queue_head, self._queue_tail, self._queue_next
        for task, key in zip(queued[~start].tolist(), keys[~start].tolist()):
            after[task] = -1
            last = tail[key]
            if last >= 0:
                after[last] = task
            else:
                head[key] = task
            tail[key] = task
        self._connection_busy[keys[start]] = True
        return np.concatenate([tasks[~fifo], queued[start]])

    def _release(self, tasks: np.ndarray) -> None:
        """Transfers whose flows finished free their connections: start what queued behind them."""
        keys = self.graph.connection[tasks]
        keys = keys[keys >= 0]
        if not keys.size:
            return
        following = []
        head, tail, after = self._queue_head, self._queue_tail, self._queue_next
        for key in keys.tolist():
            first = int(head[key])
            if first >= 0:
                following.append(first)
                head[key] = after[first]
                if head[key] < 0:
                    tail[key] = -1
            else:
                self._connection_busy[key] = False
        if following:
            self._start_flows(np.array(following, dtype=np.int64))

    def _start_flows(self, tasks: np.ndarray) -> None:
        g = self.graph
        incidence = self._route(tasks)
        sizes = g.size_bytes[tasks]
        self.link_bytes += incidence.link_load(sizes)
        self.flows += tasks.size
        priority = g.priority[tasks]
        if len(self._classes) == 1:
            self._classes[0].add(tasks, incidence, sizes * 8.0, self.now)
            return
        for p in np.unique(priority).tolist():
            rows = np.flatnonzero(priority == p)
            self._classes[self._class_of[p]].add(tasks[rows], incidence.subset(rows), sizes[rows] * 8.0, self.now)

    def _complete(self, tasks: np.ndarray) -> np.ndarray:
        """Mark tasks done now and release their dependents; returns the tasks now ready."""
        g = self.graph
        self.state[tasks] = _DONE
        self.finish_s[tasks] = self.now
        self.done += tasks.size
        starts = g.dep_ptr[tasks]
        lengths = g.dep_ptr[tasks + 1] - starts
        total = int(lengths.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        if total <= _FEW_EDGES:
            return self._release_few(starts.tolist(), lengths.tolist())
        offsets = np.cumsum(lengths) - lengths
        positions = np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)
        after = g.dep_dst[positions]
        any_edge = g.dep_any[positions]
        if any_edge.any():
            self.any_wait[after[any_edge]] = False
            all_after = after[~any_edge]
        else:
            all_after = after
        if all_after.size:
            np.subtract.at(self.need, all_after, 1)
        # Filter before de-duplicating: most completions only count down a barrier.
        ready = after[(self.state[after] == _WAITING) & (self.need[after] == 0) & ~self.any_wait[after]]
        if ready.size > max(self.state.size >> 6, 1):
            # Many (e.g. every push of a PS iteration at once): a mark per task beats hashing.
            mark = np.zeros(self.state.size, dtype=bool)
            mark[ready] = True
            ready = np.flatnonzero(mark)
        elif ready.size > 1:
            ready = np.unique(ready)
        self.state[ready] = _ACTIVE
        return ready

    def _release_few(self, starts: list[int], lengths: list[int]) -> np.ndarray:
        """:meth:`_complete`'s release of dependents for a handful of edges (most events of
        a large run: a few flows finish and count down a barrier), in plain Python: a dozen
        numpy calls on tiny arrays cost more. Same result: the newly ready tasks, sorted."""
        g, need, any_wait, state = self.graph, self.need, self.any_wait, self.state
        ready = []
        for start, length in zip(starts, lengths):
            for edge in range(start, start + length):
                after = int(g.dep_dst[edge])
                if g.dep_any[edge]:
                    any_wait[after] = False
                else:
                    need[after] -= 1
                if state[after] == _WAITING and need[after] == 0 and not any_wait[after]:
                    state[after] = _ACTIVE
                    ready.append(after)
        return np.array(sorted(ready), dtype=np.int64)

    def _settle(self, ready: np.ndarray) -> None:
        """Run everything that can run at the current instant."""
        while ready.size:
            immediate = self._activate(ready)
            if not immediate.size:
                return
            ready = self._complete(immediate)

    def _finished_flows(self, tasks: np.ndarray) -> np.ndarray:
        """Tasks whose flows just finished: complete now, or after the message latency."""
        if self.config.latency_s > 0 and tasks.size:
            self._timer(np.full(tasks.size, self.now + self.config.latency_s), tasks)
            return np.zeros(0, dtype=np.int64)
        return tasks

    # ------------------------------------------------------------------ rates

    def _refresh_rates(self) -> None:
        classes = self._classes
        if len(classes) == 1:
            classes[0].refresh(self.now)
            return
        residual = self.topology.capacity()
        for index, flow_class in enumerate(classes):
            if index:
                flow_class.set_capacity(np.maximum(residual, 0.0))
            flow_class.refresh(self.now)
            if index + 1 < len(classes):
                residual = residual - flow_class.network.link_load()

    # ------------------------------------------------------------------ main loop

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        g, cfg = self.graph, self.config
        n = g.n_tasks
        max_events = cfg.max_events if cfg.max_events is not None else 4 * n + 1000
        initial = np.flatnonzero((self.need == 0) & ~self.any_wait)
        self.state[initial] = _ACTIVE
        self._settle(initial)
        idle_events = 0
        reported = wall0
        while self.done < n:
            if (self.on_progress is not None or self.on_status is not None) \
                    and time.perf_counter() - reported >= PROGRESS_INTERVAL_S:
                self._report(wall0)
                reported = time.perf_counter()
            refreshed = False
            finished: list[np.ndarray] | None = None
            if self._compiled:
                if cfg.max_wall_s is not None and time.perf_counter() - wall0 > cfg.max_wall_s:
                    raise self._stalled(f"wall-time limit of {cfg.max_wall_s} s exceeded")
                stop, tasks = self._run_compiled(max_events)
                if stop == _STOP_PAUSE:
                    continue
                if stop == _STOP_READY:
                    idle_events = 0
                    self._settle(tasks)
                    continue
                if stop == _STOP_POPPED:
                    finished = [tasks]
                refreshed = stop == _STOP_REFRESHED
            if finished is None:
                if not refreshed:
                    self._refresh_rates()
                t_flow = min((c.next_finish() for c in self._classes), default=math.inf)
                t_timer = self._timers[0][0] if self._timers else math.inf
                t_next = min(t_flow, t_timer)
                if math.isnan(t_next):
                    raise self._stalled("a flow's finish time is NaN (a rate or size is not finite)")
                if math.isinf(t_next):
                    raise self._stalled("no flow can progress and no timer is pending")
                self.events += 1
                if self.events > max_events:
                    raise self._stalled(f"more than {max_events} events: time has stopped advancing")
                if cfg.max_wall_s is not None and time.perf_counter() - wall0 > cfg.max_wall_s:
                    raise self._stalled(f"wall-time limit of {cfg.max_wall_s} s exceeded")
                self.now = max(self.now, t_next)
                finished = [c.pop_finished(self.now + cfg.batch_rtol * abs(self.now)) for c in self._classes]
            threshold = self.now + cfg.batch_rtol * abs(self.now)
            for tasks in finished:
                self._release(tasks)
            completed = [self._finished_flows(t) for t in finished if t.size]
            while self._timers and self._timers[0][0] <= threshold:
                completed.append(heapq.heappop(self._timers)[2])
            batch = np.concatenate(completed) if completed else np.zeros(0, dtype=np.int64)
            if not batch.size and not any(t.size for t in finished):
                idle_events += 1
                if idle_events > 3:
                    raise self._stalled("events complete nothing: time has stopped advancing")
                continue
            idle_events = 0
            if batch.size:
                self._settle(self._complete(batch))
        self._report(wall0, finished=True)
        finish = np.nan_to_num(self.finish_s, nan=0.0)
        job_time = np.zeros(len(g.job_names))
        if n:
            np.maximum.at(job_time, g.job, finish)
        updates: dict[str, int] = {}
        for c in self._classes:
            for kind, count in c.updates.items():
                updates[kind] = updates.get(kind, 0) + count
        return SimResult(
            graph=g, topology=self.topology, config=cfg, time_s=float(finish.max(initial=0.0)), job_time_s=job_time,
            task_start_s=self.start_s, task_finish_s=self.finish_s, link_bytes=self.link_bytes, flows=self.flows,
            events=self.events, solver_updates=updates, wall_s=time.perf_counter() - wall0 + self._setup_wall_s,
        )

    def _pause_after_s(self) -> float:
        """Wall time after which the compiled loop hands back, so progress is reported on time
        (it runs thousands of events per call: seconds on a large halving-doubling)."""
        if self.on_progress is None and self.on_status is None:
            return math.inf
        return PROGRESS_INTERVAL_S

    def _report(self, wall0: float, *, finished: bool = False) -> None:
        if self.on_progress is not None:
            self.on_progress(self.done, self.graph.n_tasks)
        if self.on_status is not None:
            self.on_status(SimStatus(tasks_done=self.done, tasks=self.graph.n_tasks, events=self.events, flows=self.flows,
                                     sim_time_s=self.now, wall_s=time.perf_counter() - wall0 + self._setup_wall_s,
                                     finished=finished))

    def _run_compiled(self, max_events: int) -> tuple[int, np.ndarray]:
        """Run events in the compiled loop until it stops (see ``_STOP_*``); returns where it
        stopped and the tasks it hands over (popped, or made ready)."""
        flow_class = self._classes[0]
        network = flow_class.network
        assert isinstance(network, FlowNetwork)
        pool = np.zeros(0, dtype=np.int64)
        if self._tasks_compiled:
            # Room for the flows the loop starts (it hands back to Python when out of it).
            network._grow_slots(network._slots + max(256, network._n_alive // 2))
            network._grow_entries(network._entries + max(4096, 4 * network._n_alive))
            network._reserve_order(3 * network.slot_capacity + 2048)
            flow_class._grow(network.slot_capacity)
            if network._free:
                pool = np.concatenate(network._free)
            if self._pending_buffer.size < network.slot_capacity:
                self._pending_buffer = np.empty(network.slot_capacity, dtype=np.int64)
            # Flows Python started since the last update: the loop re-solves them first.
            self._pending_count = 0
            if network._pending_new:
                pending = np.concatenate(network._pending_new)
                pending = network._distinct(pending[network._alive[pending] & ~network._solved[pending]])
                self._pending_buffer[: pending.size] = pending
                self._pending_count = pending.size
                network._pending_new = []
        rows = flow_class.record.shape[0]
        if self._candidate_buffer.size < rows:
            self._candidate_buffer = np.empty(max(rows, 2 * self._candidate_buffer.size), dtype=np.int64)
        # In task mode flows come and go inside one call: room for many generations of them.
        freed = 4 * network.slot_capacity + (1 << 16) if self._tasks_compiled else network.slot_capacity
        if self._freed_buffer.size < freed:
            self._freed_buffer = np.empty(max(freed, 2 * self._freed_buffer.size), dtype=np.int64)
        candidates = flow_class.candidates
        self._candidate_buffer[: candidates.size] = candidates
        t_timer = self._timers[0][0] if self._timers else math.inf
        stop, _, partial, none, n_freed, n_tasks, n_candidates, full, used, n_pending = _fill.run_events(
            network, flow_class, self, self._candidate_buffer, self._freed_buffer, self._task_buffer, t_timer,
            max_events, _COMPILED_BUDGET, pool, self._pending_buffer, self._pause_after_s())
        flow_class.candidates = self._candidate_buffer[:n_candidates].copy()
        if self._tasks_compiled:
            # The loop took free slots from the pool, then from the ids it freed, in order.
            rest = [pool[used:], self._freed_buffer[max(0, used - pool.size):n_freed]]
            network._free = [np.concatenate(rest).copy()] if rest[0].size + rest[1].size else []
            network.adopt_removed(np.zeros(0, dtype=np.int64))
            if n_pending:
                network._pending_new = [self._pending_buffer[:n_pending].copy()]
        else:
            network.adopt_removed(self._freed_buffer[:n_freed])
        for kind, count in (("partial", partial), ("none", none), ("full", full)):
            if count:
                flow_class.updates[kind] = flow_class.updates.get(kind, 0) + count
        return stop, self._task_buffer[:n_tasks].copy()

    # ------------------------------------------------------------------ diagnostics

    def _stalled(self, reason: str, limit: int = 12) -> SimulationStalled:
        g = self.graph
        stuck: list[str] = []
        unfinished = np.flatnonzero(self.state != _DONE)
        # Flows that cannot move: name them with their zero-capacity links.
        for c in self._classes:
            for flow in c.stalled()[:limit].tolist():
                task = int(c.task[flow])
                links, _ = c.network.incidence(np.array([flow])).flow(0)
                dead = [self.topology.link_name(int(l)) for l in links if c.capacity[l] <= 0]
                where = f" over zero-capacity link(s) {', '.join(dead)}" if dead else ""
                stuck.append(f"{g.describe(task)}: flow stalled at rate 0{where}")
        # The first waiting task of each (job, rank): usually the one everything else waits on.
        waiting = unfinished[self.state[unfinished] == _WAITING]
        if waiting.size:
            keys = g.job[waiting] * (1 << 32) + np.maximum(g.rank[waiting], -1) + 1
            _, first = np.unique(keys, return_index=True)
            for task in waiting[np.sort(first)][:limit].tolist():
                needs = [f"{int(self.need[task])} all-of dependenc{'y' if self.need[task] == 1 else 'ies'}"]
                if self.any_wait[task]:
                    needs.append("one of its any-of dependencies")
                stuck.append(f"{g.describe(task)} waits for {' and '.join(needs)}")
        ranks = np.unique(g.rank[unfinished])
        ranks = ranks[ranks >= 0]
        message = (
            f"simulation stalled at t={self.now:.9g} s: {reason}; {unfinished.size} of {g.n_tasks} tasks unfinished"
            + (f" on ranks {', '.join(map(str, ranks[:16].tolist()))}{' ...' if ranks.size > 16 else ''}" if ranks.size else "")
            + ". Stuck: " + ("; ".join(stuck) if stuck else "nothing identifiable")
            + ". A deadlock (Recvs waiting on each other, or a dependency cycle) or a zero-capacity path is the usual cause."
        )
        return SimulationStalled(message, time_s=self.now, stuck=stuck)


def run_graph(graph: TaskGraph, topology: Topology, config: EngineConfig | None = None, *,
              on_progress: Callable[[int, int], None] | None = None,
              on_status: Callable[[SimStatus], None] | None = None, **options: Any) -> SimResult:
    """Run ``graph`` on ``topology``; ``options`` are :class:`EngineConfig` fields.
    ``on_progress(tasks done, tasks)`` is called now and then while it runs (a progress display);
    ``on_status(SimStatus)`` with events, flows and simulated time too (``--progress``)."""
    if config is not None and options:
        raise ValueError("give either config or EngineConfig fields, not both")
    return Engine(graph, topology, config or EngineConfig(**options), on_progress=on_progress,
                  on_status=on_status).run()
