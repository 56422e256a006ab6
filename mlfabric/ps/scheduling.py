"""MLfabric's scheduler running for real: batches of update requests in, decisions out.

    python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_network_replication.py -q

The ``scheduled`` routing policy (MLfabric §4) in three parts, each bounded in time. With
consistency ``async:TAU`` it is MLfabric-A; with ``bsp`` it is MLfabric-S (§6): a round's
updates are ordered and aggregated for the round's makespan (obj_sync), none is dropped, and
the server closes a round only when the updates the scheduler routed for it are in (or
``slack_s`` past their planned commit):

* **Scheduler** (:class:`SchedulerService`, a thread beside server 0, rank 0): workers send it
  a small request per update (its size per server, the model version it was computed from,
  its norm). Every ``interval_s`` (100 ms), or as soon as every worker still in the job has a
  request waiting (the batch cannot grow: a worker has one push outstanding), it plans the
  batch it holds with
  :class:`mlfabric.ps.scheduler.Scheduler` (the pure code the simulator and the benchmarks
  use too): order and drops (Alg. 2, ``tau_max``), aggregation (Alg. 3) on the network state
  the :class:`~mlfabric.ps.monitor.NetworkMonitor` reports minus what earlier batches still
  hold (:class:`~mlfabric.ps.monitor.Ledger`). It answers every worker (drop, or next hop per
  server component, start and rate), tells each aggregator its group, and tells each server
  the batch's application order.
* **Worker daemon** (:class:`ScheduledRouting`, in the pushing thread): asks, waits for the
  decision (at most ``decision_timeout_s``: then it pushes directly, unscheduled, and counts a
  fallback), starts each transfer when the schedule says, paced at its planned rate where the
  transport can pace. A server answers a worker's pull once the batch entries holding that
  worker's updates are applied (or skipped), as a direct push is applied before the pull
  that follows it: the worker computes its next update on a model with its own last one.
* **Aggregators** (:class:`Aggregator`, a thread on every worker): sum the members of a group
  and forward the sum to the server, after its last member or at the group's deadline with
  what arrived.
* **Model distribution** (§10.3, :meth:`ScheduledRouting.answer_pulls` on each server): a
  server answers pulls in batches -- the ones that become ready while its last answers are
  still being sent wait for them, and are then answered together with one model version. Of
  a batch of at least three pulls, ``k°`` (``distributors``) pullers are earmarked
  (those the server reaches soonest, ties drawn with the job's seed) and
  :func:`mlfabric.ps.scheduler.distribute` (Alg. 3 with server->distributor->worker times)
  splits the rest: some are answered directly, the others get a small "via" note and their
  model from a distributor, which forwards it as soon as it has it (the worker's
  :meth:`~mlfabric.ps.worker.PSWorker.pull_flat`). A worker whose distributor is lost asks
  the server again, to be answered directly.

**Replication** (MLfabric §5.3, ``ScheduledSettings(replication="network", divergence=...)``,
MLfabric-A with replicas): the server no longer forwards what it applies. After each batch's
plan the scheduler makes one *unit* per entry of the server's order (an update, or a group's
aggregate; norm bound ``lr x weight x`` the members' gradient norms) and runs
:func:`mlfabric.ps.scheduler.replication.plan_replication` per replica on the network the
batch leaves (ledger + the batch's reservations): the frozen units' transfers are reserved and
ordered -- each member worker gets a ``replicate`` (send your copy of update X, component j,
to host H at start S and rate R), each replica aggregator its ``runit`` (members, replica),
each replica the units' order -- the punted ones wait for the next batch (or, with no batch
coming, go at the next tick), and the server order's last entry gets a not-before time when
§5.3 step 3 delays it. Workers keep a copy of each scheduled update until asked (the
:class:`Aggregator` thread: at most ``MAX_COPIES``, freed once sent to every replica, when the
scheduler drops the update, or when the worker leaves). The server tells each replica, per
applied unit, only its key and version (``applied``); the replica applies units in that order
(:mod:`mlfabric.ps.replica`) and acks, and the server holds a batch's last entry while a
replica would be beyond Div_max (eq. (11) on the acked state; ``slack_s`` at most, then it goes
on and counts ``bound_overruns``): the plan's times are predictions, the acks are facts.

Servers apply a batch's updates in the scheduler's order (``ParameterServer`` keeps the
orders): an entry that has not arrived ``slack_s`` after its planned commit is skipped. A
version planned for an update is ``v_init + position``, with ``v_init`` the server's version
plus the updates of earlier batches it has not applied or skipped yet
(``ParameterServer.planned_ahead``: a skipped or dropped one no longer counts), so every
planned delay is <= ``tau_max``; an update pushed outside any batch (a fallback) is checked
against the bound at the server, as in vanilla async.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.runtime.executor import tensor_bytes
from mlfabric.transport.base import SendHandle, Transport

from . import protocol
from .divergence import DivergenceBound, update_norm
from .monitor import Ledger, NetworkMonitor
from .routing import answer_directly, send_pulls_directly
from .scheduler import BatchSchedule, NetState, Scheduler, SchedulerConfig, UpdateRequest, plan_pull_batch
from .scheduler.replication import ReplicaUnit, ReplicationPlan, plan_replication
from .server import payload_tensor

if TYPE_CHECKING:
    from .server import ParameterServer
    from .worker import PSWorker

log = logging.getLogger("mlfabric.ps")

DEFAULT_RATE_BPS = 10e9  # what the scheduler assumes of a NIC nobody reported (bit/s)
REPLICATION_MODES = ("chain", "network")
_UNITS_PER_BATCH = 1_000_000  # a replica unit's key: batch * this + its entry's position


def unit_scheduler(key: int) -> int:
    """The rank of the scheduler that planned replica unit ``key`` (its batches are numbered
    from ``1 + (rank << 20)``)."""
    return (key // _UNITS_PER_BATCH) >> 20


@dataclass(frozen=True, kw_only=True)
class ScheduledSettings:
    """``interval_s``: batching period. ``aggregators``: k aggregators (worker hosts) per
    server, 0 for none. ``rate_bps``: every NIC's line rate (bit/s) when known
    (``MLFABRIC_NIC_RATE``, the emulator's); ``monitor_lag_s``: how late the scheduler sees
    a NIC's measured rate (§7's t_lag). ``decision_timeout_s``: how long a worker waits for
    its decision before pushing unscheduled; ``slack_s``: how long a server waits past an
    entry's planned commit before skipping it.

    Replicas (MLfabric-A only): ``replication`` ``"chain"`` (the baseline: the server forwards
    every update it applies) or ``"network"`` (§5.3: the workers send copies of their
    updates to the replica, through ``replica_aggregators`` k' worker hosts, as the scheduler
    plans them so that the replica never lags the server by more than ``divergence``,
    Div_max; module docstring "Replication"). ``measure_divergence``: the servers send their
    model to their replicas at every batch end, which compare it with theirs (the true
    divergence, and the eq. (11) estimate beside it; costs a model per batch on the server's
    NIC, counted apart)."""

    interval_s: float = 0.1
    aggregators: int = 2
    #: k°: distributors earmarked per batch of pulls (§10.3); 0 answers every pull directly.
    distributors: int = 2
    rate_bps: float = DEFAULT_RATE_BPS
    monitor_lag_s: float = 0.2
    decision_timeout_s: float = 2.0
    slack_s: float = 1.0
    replication: str = "chain"
    divergence: DivergenceBound | None = None
    replica_aggregators: int = 1
    measure_divergence: bool = False

    def __post_init__(self) -> None:
        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {', '.join(REPLICATION_MODES)}, got {self.replication!r}")
        if self.replication == "network" and self.divergence is None:
            raise ValueError("replication 'network' needs a divergence bound (Div_max: a norm such as 0.5, or a "
                             "number of updates such as 30u)")
        if self.replica_aggregators < 0:
            raise ValueError(f"replica_aggregators must be >= 0, got {self.replica_aggregators}")
        for name in ("interval_s", "rate_bps", "decision_timeout_s", "slack_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decision_timeout_s <= self.interval_s:
            log.warning("decision_timeout_s (%g) <= interval_s (%g): workers will push unscheduled before most "
                        "batches are planned", self.decision_timeout_s, self.interval_s)
        if self.aggregators < 0 or self.distributors < 0 or self.monitor_lag_s < 0:
            raise ValueError(f"aggregators, distributors and monitor_lag_s must be >= 0, got {self.aggregators}, "
                             f"{self.distributors}, {self.monitor_lag_s}")


def aggregator_ranks(workers: range, k: int) -> list[int]:
    """``k`` worker ranks spread evenly over the workers (every ``W/k``-th)."""
    w = len(workers)
    k = min(k, w)
    return [workers[(i * w) // k] for i in range(k)] if k else []


def _avg_rate_bps(transfer: Any) -> float | None:
    """A planned transfer's mean rate in bit/s (what pacing enforces), None if it moves nothing."""
    if not transfer.times or transfer.end <= transfer.begin:
        return None
    return 8 * transfer.size / (transfer.end - transfer.begin)


# --------------------------------------------------------------------------- the scheduler


@dataclass
class SchedulerStats:
    batches: int = 0
    requests: int = 0
    dropped: int = 0
    aggregated: int = 0
    plan_ms: list[float] = field(default_factory=list)
    #: Network replication (§5.3): units sent toward replicas, units punted to a later batch
    #: (counted each time), batches whose last server update was delayed, and batches where
    #: one unit alone exceeds Div_max (no schedule meets it).
    replica_units: int = 0
    replica_punted: int = 0
    replica_delays: int = 0
    replica_violations: int = 0

    def as_dict(self) -> dict[str, Any]:
        ms = sorted(self.plan_ms)
        return {"batches": self.batches, "requests": self.requests, "dropped_by_scheduler": self.dropped,
                "aggregated": self.aggregated, "plan_ms_p50": ms[len(ms) // 2] if ms else None,
                "plan_ms_max": ms[-1] if ms else None, "replica_units": self.replica_units,
                "replica_punted": self.replica_punted, "replica_delays": self.replica_delays,
                "replica_violations": self.replica_violations}


class SchedulerService:
    """The scheduler thread of one PS session (module docstring); lives beside server 0."""

    def __init__(self, server: "ParameterServer", settings: ScheduledSettings) -> None:
        self.server = server
        self.transport: Transport = server.transport
        self.layout = server.layout
        self.settings = settings
        consistency = server.config.consistency
        #: MLfabric-A (async:TAU: Alg. 2's deadlines and drops) or MLfabric-S (bsp, §6: a round's
        #: updates ordered and aggregated for the makespan, obj_sync, nothing dropped).
        self.sync = consistency.kind == "bsp"
        if not self.sync and (consistency.kind != "async" or consistency.delay_bound is None):
            raise ValueError("the scheduled routing policy needs consistency async:TAU (MLfabric-A) or bsp "
                             f"(MLfabric-S), got {consistency}")
        self.aggregators = aggregator_ranks(self.layout.worker_ranks, settings.aggregators)
        #: The rank serving each shard: the servers, except this one's shard after a failover
        #: (a replica promoted to server 0 runs the scheduler, :mod:`mlfabric.ps.replica`).
        self.serving = [self.transport.rank if j == server.server else rank
                        for j, rank in enumerate(self.layout.server_ranks)]
        self.scheduler = Scheduler(SchedulerConfig(tau_max=0 if self.sync else int(consistency.delay_bound or 0),
                                                   mode="sync" if self.sync else "async",
                                                   aggregation=bool(self.aggregators), seed=server.config.seed),
                                   servers=list(self.serving), aggregators=self.aggregators)
        self.monitor = NetworkMonitor(hosts=self.layout.world_size, default_bps=settings.rate_bps / 8,
                                      lag_s=settings.monitor_lag_s)
        self.ledger = Ledger()
        # The ledger is read and extended by this thread (pushes) and by server 0's loop
        # (model distribution, :meth:`network`).
        self._ledger_lock = threading.Lock()
        self.stats = SchedulerStats()
        self._pending: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        # Batches are numbered from 1; a promoted replica's scheduler numbers its own apart, so
        # that nothing the lost scheduler planned (a worker's group, a late update, a replica's
        # unit) can be taken for one of its batches.
        self._batches = itertools.count(1 + (self.transport.rank << 20))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Network replication (§5.3): per (model, replica) the units punted to the next batch and
        #: the bound of the replica's history norm where the frozen units leave it.
        self.replicating = settings.replication == "network" and self.layout.replicas > 0
        if self.replicating and self.sync:
            raise ValueError("network replication is planned for MLfabric-A (async:TAU); under bsp use chain")
        self._punted: dict[tuple[str, int], list[ReplicaUnit]] = {}
        self._history_norm: dict[tuple[str, int], float] = {}
        self._unit_members: dict[int, list[tuple[int, int]]] = {}  # unit key -> its (rank, update id)
        self._warned_violation = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlfabric-ps-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.transport.mailbox.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        mailbox = self.transport.mailbox
        tag = protocol.tag(protocol.SCHEDULE, self.server.config.session)
        next_batch = time.monotonic() + self.settings.interval_s
        while not self._stop.is_set():
            version = mailbox.version
            while (msg := mailbox.take(self.server.channel, tag)) is not None:
                self._take(msg)
            now = time.monotonic()
            if now >= next_batch or self._everyone_waiting(now):
                for model in [m for m, reqs in self._pending.items() if reqs]:
                    try:
                        self._plan(model, self._pending.pop(model), now)
                    except Exception:  # noqa: BLE001 - a failed plan must not kill the service
                        log.exception("%s: scheduler: planning a batch of %r failed; its workers fall back to "
                                      "unscheduled pushes", self.server.who, model)
                if now >= next_batch and self._punted:
                    # No batch to ride with: the punted units go now (the job may be ending).
                    self._flush_replication(now)
                next_batch = now + self.settings.interval_s
            self.transport.progress(version, max(0.0, min(0.05, next_batch - now)))

    def network(self, now: float) -> NetState:
        """The residual network at ``now`` (capacities minus every reservation still running)."""
        with self._ledger_lock:
            return self.ledger.state(now, *self.monitor.capacities(now))

    def reserve(self, transfers: list[Any]) -> None:
        """Transfers planned outside the scheduler's batches (model distribution) hold their
        bandwidth for the next batches too."""
        with self._ledger_lock:
            self.ledger.add(transfers)

    def _everyone_waiting(self, now: float) -> bool:
        """Every worker still in the job has an update waiting: the batch cannot grow (a
        worker has one push outstanding at a time), so waiting out the interval only adds
        latency."""
        if not any(self._pending.values()):
            return False
        waiting = {rank for reqs in self._pending.values() for rank, _ in reqs}
        counted = {self.layout.worker_rank(w) for w in self.server.book.counted(now)}
        return counted <= waiting

    def _take(self, msg: Any) -> None:
        header = protocol.decode(msg.meta)
        if header["op"] == "request":
            self._pending.setdefault(header["model"], []).append((msg.src, header))
        elif header["op"] == "cancel":
            pending = self._pending.get(header["model"], [])
            self._pending[header["model"]] = [(r, h) for r, h in pending
                                              if not (r == msg.src and h["id"] == header["id"])]
        elif header["op"] == "monitor":
            self.monitor.report(msg.src, header.get("up"), header.get("down"), time.monotonic())

    def _plan(self, model: str, pending: list[tuple[int, dict[str, Any]]], now: float) -> None:
        shard = self.server.shards.get(model)
        if shard is None:
            log.error("%s: scheduler: update requests for unknown model %r dropped", self.server.who, model)
            return
        started = time.perf_counter()
        v_init = shard.version + self.server.planned_ahead(model)
        requests = [UpdateRequest(update_id=i, worker=rank, sizes=tuple(float(s) for s in h["sizes"]),
                                  version=min(int(h["version"]), v_init), norm=float(h.get("norm", 0.0)))
                    for i, (rank, h) in enumerate(pending)]
        with self._ledger_lock:
            network = self.ledger.state(now, *self.monitor.capacities(now))
            plan = self.scheduler.schedule(requests, version=v_init, network=network, now=now)
            self.ledger.add([t for d in plan.applied() for t in d.transfers] +
                            [t for g in plan.aggregates for t in g.transfers])
        self.stats.plan_ms.append(1e3 * (time.perf_counter() - started))
        self.stats.batches += 1
        self.stats.requests += len(requests)
        batch = next(self._batches)
        entries, members, commits = self._entries(plan, pending, now)
        if self.replicating:
            self._replicate(model, batch, entries, members, commits, now)
        self._dispatch(model, batch, plan, pending, entries, v_init, now)

    def _entries(self, plan: BatchSchedule, pending: list[tuple[int, dict[str, Any]]],
                 now: float) -> tuple[list[list[Any]], list[list[tuple[int, dict[str, Any]]]], list[float]]:
        """The server's application order: per entry (an update, or a group's aggregate)
        ``[kind, key, key/count, deadline_in, ranks]``; beside it the entries' members (rank,
        request header) and planned commit times."""
        slack = self.settings.slack_s
        entries: list[list[Any]] = []
        members: list[list[tuple[int, dict[str, Any]]]] = []
        commits: list[float] = []
        for d in plan.applied():  # application order
            rank, header = pending[d.update_id]
            commit = d.commit or now
            deadline = max(0.0, commit - now) + slack
            if d.group == 0 or not entries or entries[-1][0] != "g" or entries[-1][1] != d.group:
                entries.append(["u", rank, int(header["id"]), deadline, [rank]] if d.group == 0
                               else ["g", d.group, 1, deadline, [rank]])
                members.append([(rank, header)])
                commits.append(commit)
            else:
                entries[-1][2] += 1
                entries[-1][3] = max(entries[-1][3], deadline)
                entries[-1][4].append(rank)
                members[-1].append((rank, header))
                commits[-1] = max(commits[-1], commit)
        return entries, members, commits

    def _dispatch(self, model: str, batch: int, plan: BatchSchedule, pending: list[tuple[int, dict[str, Any]]],
                  entries: list[list[Any]], v_init: int, now: float) -> None:
        session, channel = self.server.config.session, self.server.channel
        slack = self.settings.slack_s
        # Orders first: server 0 then has its order before any update of the batch can arrive.
        order = {"op": protocol.ORDER, "batch": batch, "model": model, "v_init": v_init, "entries": entries,
                 "sync": self.sync, "clocks": sorted({int(h.get("clock", 0)) for _, h in pending})}
        for j, rank in enumerate(self.serving):
            if j == self.server.server:
                self.server.add_order(order, time.monotonic())
            else:
                self.transport.send(rank, protocol.request_tag(session), b"", meta=protocol.encode(**order),
                                    channel=channel)
        for d in plan.decisions:
            rank, header = pending[d.update_id]
            if d.dropped:
                self.stats.dropped += 1
                meta = protocol.encode(op="decision", drop=True, reason=d.reason, batch=batch)
            else:
                meta = protocol.encode(op="decision", drop=False, batch=batch, group=d.group, position=d.position,
                                       hop=list(d.next_hop), start_in=max(0.0, (d.start or now) - now),
                                       rates=[_avg_rate_bps(t) for t in d.transfers])
            self.transport.send(rank, protocol.tag(protocol.DECISION, session, int(header["id"])), b"", meta=meta,
                                channel=channel)
        for g in plan.aggregates:
            self.stats.aggregated += len(g.members)
            members = [[pending[m][0], int(pending[m][1]["id"])] for m in g.members]
            for host in sorted(set(g.hosts)):
                servers = [j for j, h in enumerate(g.hosts) if h == host]
                meta = protocol.encode(op="group", batch=batch, slot=g.slot, model=model, members=members,
                                       servers=servers, deadline_in=max(0.0, g.commit - now) + slack,
                                       rates=[_avg_rate_bps(g.transfers[j]) if j < len(g.transfers) else None
                                              for j in servers])
                self.transport.send(host, protocol.tag(protocol.AGGREGATE, session), b"", meta=meta, channel=channel)

    # -- network replication (§5.3) ----------------------------------------------------------

    def _replicate(self, model: str, batch: int, entries: list[list[Any]],
                   members: list[list[tuple[int, dict[str, Any]]]], commits: list[float], now: float) -> None:
        """Plan this batch's units toward every replica on the network the batch leaves, send
        the frozen ones on their way, keep the punted ones for the next batch; each entry of
        the server's order gains ``[unit key, norm bound, not-before]`` (the last entry's
        not-before: §5.3 step 3's delay, seconds from now, or None)."""
        shard = self.server.shards[model]
        weight = 1.0 / self.layout.workers  # what the server applies a scheduled update with
        delay_until: float | None = None
        for i, entry in enumerate(entries):
            key = batch * _UNITS_PER_BATCH + i
            norm = update_norm(shard.lr, weight, [float(h.get("norm", 0.0)) for _, h in members[i]])
            self._unit_members[key] = [(rank, int(h["id"])) for rank, h in members[i]]
            entry += [key, norm, None]
        for j, serving in enumerate(self.serving):
            units = [ReplicaUnit(key=e[5], norm=e[6], members=tuple((rank, float(h["sizes"][j])) for rank, h in m))
                     for e, m in zip(entries, members)]
            for replica in self.layout.replicas_of(j):
                if self.transport.is_gone(replica):
                    continue  # the server warns; nothing goes toward a replica that is gone
                if replica == serving:
                    continue  # it took over this shard: it is the server now
                plan = self._plan_replica(model, j, replica, units, commits, now)
                if plan.delay_last_until is not None:
                    delay_until = max(delay_until or 0.0, plan.delay_last_until)
        self._forget_units([e[5] for e in entries])
        if delay_until is not None and entries:
            self.stats.replica_delays += 1
            entries[-1][7] = max(0.0, delay_until - now)
            # the delayed entry may arrive later than planned: its skip deadline moves with it
            entries[-1][3] = max(entries[-1][3], entries[-1][7] + self.settings.slack_s)

    def replica_aggregators(self, now: float) -> list[int]:
        """k' replica aggregators among the workers still in the job (one that left has stopped
        its aggregator thread), taken from the end of the workers so that they differ from the
        server's aggregators where there are enough."""
        live = set(self.server.book.counted(now))
        workers = [r for r in reversed(self.layout.worker_ranks) if self.layout.worker_index(r) in live]
        workers = workers or list(reversed(self.layout.worker_ranks))  # none left: units have no member either
        return [workers[i] for i in aggregator_ranks(range(len(workers)), self.settings.replica_aggregators)]

    def _flush_replication(self, now: float) -> None:
        """Send every punted unit now (no batch of server updates to schedule around)."""
        with self._ledger_lock:
            flushed = [u.key for units in self._punted.values() for u in units]
            for (model, replica), units in list(self._punted.items()):
                if units:
                    j = self.layout.replicated_server(replica)
                    self._plan_replica(model, j, replica, [], [], now, flush=True)
        self._forget_units(flushed)

    def _forget_units(self, keys: list[int]) -> None:
        """Units every replica's plan has sent on their way (none holds them punted) need
        their members no more. (Only once every replica was planned: with two replicas of a
        server, the second's plan needs the members the first's froze.)"""
        punted = {u.key for units in self._punted.values() for u in units}
        for key in keys:
            if key not in punted:
                self._unit_members.pop(key, None)

    def _plan_replica(self, model: str, j: int, replica: int, units: list[ReplicaUnit], commits: list[float],
                      now: float, *, flush: bool = False) -> ReplicationPlan:
        """:func:`plan_replication` for one replica (the caller holds the ledger lock), then
        reserve and dispatch what it froze."""
        settings, shard = self.settings, self.server.shards[model]
        punted = self._punted.pop((model, replica), [])
        if flush:  # no server commit to beat: everything goes
            units, punted, commits = punted, [], [float("inf")] * len(punted)
        network = self.ledger.state(now, *self.monitor.capacities(now))
        assert settings.divergence is not None  # ScheduledSettings checks it for "network"
        plan = plan_replication(network, units=units, punted=punted, server_commit=commits, replica=replica,
                                aggregators=self.replica_aggregators(now), bound=settings.divergence,
                                momentum=shard.momentum, history_norm=self._history_norm.get((model, replica), 0.0),
                                start=now)
        self.ledger.add([t for k in plan.frozen for t in plan.transfers[k]])
        self._history_norm[(model, replica)] = plan.history_norm
        if plan.punted:
            self._punted[(model, replica)] = list(plan.punted)
        self.stats.replica_units += len(plan.frozen)
        self.stats.replica_punted += len(plan.punted)
        if plan.violated:
            self.stats.replica_violations += 1
            if not self._warned_violation:
                self._warned_violation = True
                log.warning("%s: scheduler: Div_max %s cannot be met for %s: a single update's norm bound is over "
                            "it (estimate %.3g); the replica is kept as close as the schedule allows -- raise "
                            "--div-max", self.server.who, settings.divergence, self.layout.describe(replica),
                            plan.estimate)
        self._send_replication(model, j, replica, plan, now)
        return plan

    def _send_replication(self, model: str, j: int, replica: int, plan: ReplicationPlan, now: float) -> None:
        """The frozen units' orders: each member worker sends its copy (to the replica, or to
        the unit's replica aggregator, which sums and forwards it); the replica hears the
        units in the server's order."""
        session, channel = self.server.config.session, self.server.channel
        aggregate = protocol.tag(protocol.AGGREGATE, session)
        for key in plan.frozen:
            transfers = plan.transfers[key]
            members = self._unit_members[key]
            if len(members) > 1:  # transfers: one per member to the aggregator, then its sum's
                out = transfers[-1]
                self.transport.send(out.src, aggregate, b"", channel=channel, meta=protocol.encode(
                    op="runit", unit=key, model=model, server=j, dest=replica, members=[list(m) for m in members],
                    rate=_avg_rate_bps(out)))
            for (rank, update_id), tr in zip(members, transfers):
                self.transport.send(rank, aggregate, b"", channel=channel, meta=protocol.encode(
                    op="replicate", unit=key, model=model, id=update_id, server=j, dest=tr.dst, replica=replica,
                    start_in=max(0.0, tr.begin - now), rate=_avg_rate_bps(tr)))
        if plan.frozen:
            self.transport.send(replica, protocol.tag(protocol.REPLICATE, session), b"", channel=channel,
                                meta=protocol.encode(op="units", model=model, units=list(plan.frozen),
                                                     commit_in=[plan.replica_commit[k] - now for k in plan.frozen]))


# --------------------------------------------------------------------------- the worker's daemon


@dataclass
class DaemonStats:
    requested: int = 0
    dropped: int = 0
    fallbacks: int = 0
    aggregated: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"requested": self.requested, "dropped_by_scheduler": self.dropped, "fallbacks": self.fallbacks,
                "sent_to_aggregators": self.aggregated}


class ScheduledRouting:
    """The ``scheduled`` routing policy: a worker's pushes go through the scheduler; a server
    answers pulls in batches through distributors (module docstring)."""

    name = "scheduled"

    def __init__(self, settings: ScheduledSettings | None = None) -> None:
        self.settings = settings or ScheduledSettings()
        self.stats = DaemonStats()
        self._aggregator: Aggregator | None = None
        self._ids = itertools.count(1)
        self._answering: list[SendHandle] = []  # a server's last batch of pull answers
        self._busy_until = 0.0  # ... and when its up-link is planned to be done with them
        self._draws: Any = None  # a server's seeded tie-breaks among distributors

    # -- the worker's side -------------------------------------------------------------------

    def _start(self, worker: "PSWorker") -> None:
        if self._aggregator is None:
            self._worker = worker
            self._aggregator = Aggregator(worker, self.settings)
            self._aggregator.start()

    def send_push(self, worker: "PSWorker", model: str, components: list[torch.Tensor],
                  headers: list[bytes]) -> list[SendHandle] | None:
        """Ask the scheduler, wait for the decision and carry it out: returns once the update
        was handed to the transport at its planned start (a push is then where the schedule
        wants it, like a direct push once the transport has it; nothing is left for the
        caller to wait on), or None once the scheduler dropped it."""
        self._start(worker)
        return [] if self._push(model, components, headers) else None

    def send_pull(self, worker: "PSWorker", headers: list[bytes], *, clocks: list[bytes] | None = None) -> None:
        send_pulls_directly(worker, headers, clocks=clocks)

    # -- the server's side: model distribution (§10.3) ------------------------------------------

    def ready_to_answer(self, server: "ParameterServer") -> bool:
        """Pulls that become ready while the server is still sending the last batch's answers
        (until their planned end on its up-link, and until the transport has them) wait for
        the next batch: the server's NIC is busy anyway, and together they share one send to
        a distributor instead of each taking the server's up-link. (The transport's handles
        alone would not do: a socket takes a few MB into its buffer at once.)"""
        self._answering = [h for h in self._answering if not h.done()]
        return not self._answering and time.monotonic() >= self._busy_until

    def answer_at(self) -> float | None:
        return self._busy_until

    def answer_pulls(self, server: "ParameterServer", pulls: list[Any], shard: torch.Tensor,
                     header: bytes) -> list[SendHandle]:
        now = time.monotonic()
        service = server.scheduler_service
        if service is not None:
            net = service.network(now)
        else:  # a server without the scheduler beside it plans on line rates
            rate = self.settings.rate_bps / 8
            net = NetState([rate] * server.layout.world_size, [rate] * server.layout.world_size, origin=now)
        if self._draws is None:
            self._draws = random.Random(server.config.seed * 7_919 + server.server)
        me = server.transport.rank
        lost = server.transport.lost_peers
        pull_of = {p.rank: p for p in pulls}
        asked = [p.rank for p in pulls if p.direct or p.rank in lost]  # to be answered by the server itself
        plan = plan_pull_batch(net, server=me, pullers=[r for r in pull_of if r not in asked],
                               model_size=float(shard.numel() * shard.element_size()),
                               distributors=self.settings.distributors, shuffle=self._draws.shuffle, start=now,
                               answered_first=asked)
        server.stats.pull_batches += 1
        session, channel = server.config.session, server.channel
        fields = protocol.decode(header)
        payload = tensor_bytes(shard)
        handles: list[SendHandle] = []
        for d, members in reversed(plan.groups):  # the paper's order: distributor k° first
            forward = [[w, pull_of[w].request_id] for w in members]
            handles.append(server.transport.send(d, protocol.reply_tag(session, pull_of[d].request_id), payload,
                                                 meta=protocol.encode(**fields, forward=forward), channel=channel))
            for w in members:
                server.transport.send(w, protocol.reply_tag(session, pull_of[w].request_id), b"",
                                      meta=protocol.encode(op="via", distributor=d), channel=channel)
            server.stats.pulls_relayed += len(members)
        handles += answer_directly(server, [pull_of[r] for r in plan.by_server], shard, header)
        if service is not None:
            service.reserve(list(plan.transfers))
        self._busy_until = max((t.end for t in plan.transfers if t.src == me), default=now)
        self._answering = list(handles)
        return handles

    def flush(self, timeout: float) -> None:
        """A worker leaving: its aggregator forwards what is complete or due, then stops."""
        if self._aggregator is not None:
            self._aggregator.stop(timeout)

    def _push(self, model: str, components: list[torch.Tensor], headers: list[bytes]) -> bool:
        """Carry out one push; False if the scheduler dropped it."""
        w = self._worker
        transport, session = w.transport, w.config.session
        first = protocol.decode(headers[0])
        request_id = next(self._ids)
        self.stats.requested += 1
        # Network replication: the copy is kept before the scheduler can ask for it (its
        # "replicate" may reach the aggregator thread before this thread has the decision).
        keeping = self.settings.replication == "network" and w.layout.replicas > 0 and self._aggregator is not None
        if keeping:
            self._aggregator.keep(model, request_id, components)
        transport.send(w.server_rank(0), protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel,
                       meta=protocol.encode(op="request", id=request_id, model=model, version=int(first["version"]),
                                            norm=float(first["norm"]), clock=int(first["clock"]),
                                            sizes=[c.numel() * c.element_size() for c in components]))
        decision = self._decision(request_id)
        if (decision is None or decision["drop"]) and keeping:  # not a unit: no replica asks for it
            self._aggregator.forget(model, request_id)
        if decision is None:  # no answer in time: push unscheduled (the server bounds its delay)
            self.stats.fallbacks += 1
            # Withdraw the request; if it was planned already, its entry is skipped at the server.
            transport.send(w.server_rank(0), protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel,
                           meta=protocol.encode(op="cancel", id=request_id, model=model))
            handles = [transport.send(w.server_rank(j), protocol.request_tag(session), tensor_bytes(c),
                                      meta=h, channel=w.channel) for j, (c, h) in enumerate(zip(components, headers))]
            _wait_sent(transport, handles, w.config.timeout_s)
            return True
        if decision["drop"]:
            self.stats.dropped += 1
            return False
        time.sleep(float(decision["start_in"]))
        handles, paced = [], []
        for j, (component, header, hop) in enumerate(zip(components, headers, decision["hop"])):
            fields = {**protocol.decode(header), "batch": decision["batch"], "id": request_id, "rank": transport.rank}
            rate = decision["rates"][j] if j < len(decision["rates"]) else None
            if hop != transport.rank and rate is not None and transport.pace_connection(hop, w.channel, rate):
                paced.append(hop)
            if hop in w.serving:  # a server (or the replica that took over one), else an aggregator
                handles.append(transport.send(hop, protocol.request_tag(session), tensor_bytes(component),
                                              meta=protocol.encode(**fields), channel=w.channel))
            else:
                self.stats.aggregated += 1
                member = {**fields, "op": "member", "slot": decision["group"], "server": j}
                if hop == transport.rank:
                    assert self._aggregator is not None
                    self._aggregator.add_member(member, component)
                else:
                    handles.append(transport.send(hop, protocol.tag(protocol.AGGREGATE, session),
                                                  tensor_bytes(component), meta=protocol.encode(**member),
                                                  channel=w.channel))
        _wait_sent(transport, handles, w.config.timeout_s)
        for hop in paced:
            transport.pace_connection(hop, w.channel, None)
        return True

    def _decision(self, request_id: int) -> dict[str, Any] | None:
        w = self._worker
        transport = w.transport
        tag = protocol.tag(protocol.DECISION, w.config.session, request_id)
        deadline = time.monotonic() + self.settings.decision_timeout_s
        while time.monotonic() < deadline:
            version = transport.mailbox.version
            scheduler = w.server_rank(0)  # the scheduler lives beside server 0
            msg = transport.mailbox.take(w.channel, tag, scheduler)
            if msg is not None:
                return protocol.decode(msg.meta)
            if scheduler in transport.lost_peers:
                w._fail_over(scheduler)  # a replica takes over (the fallback push goes to it)
                return None
            transport.progress(version, 0.05)
        log.warning("%s: no decision from the scheduler within %.1f s for update %d: pushing it unscheduled",
                    w.who, self.settings.decision_timeout_s, request_id)
        return None


def _wait_sent(transport: Transport, handles: list[SendHandle], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(not h.done() for h in handles) and time.monotonic() < deadline:
        transport.progress(transport.mailbox.version, 0.01)


# --------------------------------------------------------------------------- aggregators


@dataclass
class _Group:
    model: str = ""
    members: list[tuple[int, int]] = field(default_factory=list)
    servers: list[int] = field(default_factory=list)
    deadline: float = float("inf")
    rates: list[float | None] = field(default_factory=list)
    planned: bool = False
    arrived: dict[int, list[tuple[dict[str, Any], torch.Tensor]]] = field(default_factory=dict)  # per server j
    sent: set[int] = field(default_factory=set)


def _sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total


@dataclass
class _ReplicaSum:
    """A replica unit this host sums (a replica aggregator, §5.3): who is in it, where it goes."""

    model: str = ""
    server: int = 0
    dest: int = -1
    members: list[tuple[int, int]] = field(default_factory=list)
    rate: float | None = None
    arrived: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    since: float = 0.0


@dataclass
class _Replication:
    """A copy this worker sends toward a replica when its planned start comes."""

    due: float
    dest: int
    tag: int
    meta: bytes
    tensor: torch.Tensor
    rate: float | None


class Aggregator:
    """Sums the members of the groups the scheduler assigns to this worker's host and forwards
    each sum (per server component) once complete, or at the group's deadline with what came.

    Network replication (§5.3) rides the same thread: it keeps a copy of each scheduled
    update this worker pushed (:meth:`keep`, at most ``MAX_COPIES``: the oldest is freed with
    a warning, its replica then waits for it in vain and says so), sends a copy when the
    scheduler says (``replicate``: to the replica or a replica aggregator, at the planned
    start and rate) and frees it once every replica of its server has had it; as a replica
    aggregator it sums a unit's members (in the unit's member order) and forwards the sum.
    Copies never asked for (their unit was never frozen) are freed when the worker leaves."""

    MAX_COPIES = 256
    LINGER_S = 0.5

    def __init__(self, worker: "PSWorker", settings: ScheduledSettings) -> None:
        self.worker = worker
        self.settings = settings
        self._groups: dict[tuple[int, int], _Group] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.forwarded = 0
        self.partial = 0
        # network replication: (model, update id) -> [components, sends still to make, the
        # scheduler's rank (copies it planned are asked for only while it lives)]
        self._copies: dict[tuple[str, int], list[Any]] = {}
        self._replications: list[_Replication] = []
        self._replicating: list[tuple[SendHandle, int, torch.Tensor, bool]] = []
        # (unit key, replica) -> the unit being summed here: with several replicas of a server
        # one unit goes to each, possibly through the same replica aggregator
        self._replica_sums: dict[tuple[int, int], _ReplicaSum] = {}
        self.copies_sent = 0
        self.copies_evicted = 0

    def keep(self, model: str, update_id: int, components: list[torch.Tensor]) -> None:
        """Keep a copy of a scheduled update until the scheduler asks for it."""
        with self._lock:
            if len(self._copies) >= self.MAX_COPIES:
                oldest = next(iter(self._copies))
                del self._copies[oldest]
                self.copies_evicted += 1
                log.warning("%s: %d copies of updates kept for replicas and none asked for: freed update %d of %r "
                            "(its replica will miss it)", self.worker.who, self.MAX_COPIES, oldest[1], oldest[0])
            askers = len(self._askers())
            if askers:
                self._copies[(model, update_id)] = [[c.detach().clone() for c in components], askers,
                                                    self.worker.server_rank(0)]

    def _askers(self) -> list[int]:
        """The replicas that may still ask for copies: those in the job that have not taken over a shard."""
        w = self.worker
        gone = w.transport.gone_peers
        return [r for r in w.layout.replica_ranks if r not in gone and r not in w.serving]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"mlfabric-ps-aggregator-{self.worker.index}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Forward what is complete (or due), then stop. Under network replication, linger
        ``LINGER_S`` with nothing open first: this host may have been made a unit's replica
        aggregator just before the scheduler heard that its worker leaves."""
        deadline = time.monotonic() + timeout
        linger = self.LINGER_S if self.settings.replication == "network" and self.worker.layout.replicas else 0.0
        idle_since = None
        while time.monotonic() < deadline:
            if self._open():
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            if idle_since is not None and time.monotonic() - idle_since >= linger:
                break
            time.sleep(0.02)
        self._stop.set()
        self.worker.transport.mailbox.notify()
        if self._thread is not None:
            self._thread.join(2)
        with self._lock:
            self._copies.clear()  # the job is over for this worker: nobody will ask any more

    def forget(self, model: str, update_id: int) -> None:
        with self._lock:
            self._copies.pop((model, update_id), None)

    def _open(self) -> bool:
        transport = self.worker.transport
        gone = transport.gone_peers
        w_serving = set(self.worker.serving)
        with self._lock:
            if self._copies and not self._askers():
                self._copies.clear()  # every replica is gone (or serves): nobody will ask for them
            # a lost scheduler's plans are over (a replica taking over asked for what it missed
            # at once): their copies do not hold a leaving worker back
            orphans = [k for k, (_, _, scheduler) in self._copies.items() if scheduler in gone]
            for key in orphans:
                del self._copies[key]
            # the same for the units this host sums for a replica: a lost scheduler's never
            # complete (its members were told nothing more; a replica following the one that
            # took over starts from a fresh copy), nor do units for a replica gone or serving
            moot = [k for k in self._replica_sums
                    if unit_scheduler(k[0]) in gone or k[1] in gone or k[1] in w_serving]
            for key in moot:
                del self._replica_sums[key]
            # copies still kept: their units were punted, the scheduler asks for them later
            return (any(g.planned and len(g.sent) < len(g.servers) for g in self._groups.values())
                    or bool(self._copies) or bool(self._replications) or any(not h.done() for h, *_ in self._replicating)
                    or bool(self._replica_sums))

    def add_member(self, header: dict[str, Any], component: torch.Tensor) -> None:
        with self._lock:
            group = self._groups.setdefault((int(header["batch"]), int(header["slot"])), _Group())
            group.arrived.setdefault(int(header["server"]), []).append((header, component))
        self.worker.transport.mailbox.notify()

    def _run(self) -> None:
        w = self.worker
        mailbox = w.transport.mailbox
        tag = protocol.tag(protocol.AGGREGATE, w.config.session)
        while not self._stop.is_set():
            version = mailbox.version
            while (msg := mailbox.take(w.channel, tag)) is not None:
                header = protocol.decode(msg.meta)
                if header["op"] == "group":
                    with self._lock:
                        group = self._groups.setdefault((int(header["batch"]), int(header["slot"])), _Group())
                        group.model, group.planned = header["model"], True
                        group.members = [(int(r), int(i)) for r, i in header["members"]]
                        group.servers = [int(j) for j in header["servers"]]
                        group.deadline = time.monotonic() + float(header["deadline_in"])
                        group.rates = list(header["rates"])
                elif header["op"] in ("replicate", "runit", "rmember"):
                    self._replication_message(header, msg.payload)
                else:
                    spec = w.models.get(header["model"])
                    if spec is None:
                        continue
                    _, length = spec.shards(w.layout.servers)[int(header["server"])]
                    self.add_member(header, payload_tensor(msg.payload, spec.torch_dtype, length,
                                                           "aggregated member").clone())
            self._forward_ready(time.monotonic())
            wait = self._send_replications(time.monotonic())
            w.transport.progress(version, min(0.05, wait))

    # -- network replication -------------------------------------------------------------------

    def _replication_message(self, header: dict[str, Any], payload: memoryview) -> None:
        w = self.worker
        session = w.config.session
        now = time.monotonic()
        key = int(header["unit"])
        if header["op"] == "replicate":  # send our copy of update ``id`` toward ``dest``
            with self._lock:
                copy = self._copies.get((header["model"], int(header["id"])))
                if copy is None:
                    if header.get("recovery"):  # a replica taking over asked; the copy went its way before
                        log.info("%s: update %d of %r (unit %d): no copy left to resend to %s", w.who,
                                 int(header["id"]), header["model"], key, w.layout.describe(int(header["dest"])))
                    else:
                        log.error("%s: asked to replicate update %d of %r (unit %d) but holds no copy of it "
                                  "(never pushed, or freed): the replica will wait for it in vain", w.who,
                                  int(header["id"]), header["model"], key)
                    return
                j = int(header["server"])
                tensor = copy[0][j]
                copy[1] -= 1
                if copy[1] <= 0:
                    del self._copies[(header["model"], int(header["id"]))]
            dest = int(header["dest"])
            if w.layout.role(dest) == "replica":
                tag, meta = protocol.tag(protocol.REPLICATE, session), protocol.encode(
                    op="unit", unit=key, model=header["model"])
            else:
                tag, meta = protocol.tag(protocol.AGGREGATE, session), protocol.encode(
                    op="rmember", unit=key, model=header["model"], server=j, rank=w.transport.rank,
                    replica=int(header["replica"]),
                    id=int(header["id"]))
            with self._lock:
                self._replications.append(_Replication(due=now + float(header["start_in"]), dest=dest, tag=tag,
                                                       meta=meta, tensor=tensor, rate=header.get("rate")))
            return
        with self._lock:
            replica = int(header["dest"] if header["op"] == "runit" else header["replica"])
            unit = self._replica_sums.setdefault((key, replica), _ReplicaSum(since=now))
            if header["op"] == "runit":
                unit.model, unit.server, unit.dest = header["model"], int(header["server"]), int(header["dest"])
                unit.members = [(int(r), int(i)) for r, i in header["members"]]
                unit.rate = header.get("rate")
            else:
                spec = w.models.get(header["model"])
                if spec is None:
                    return
                j = int(header.get("server", unit.server))
                _, length = spec.shards(w.layout.servers)[j]
                unit.arrived[(int(header["rank"]), int(header["id"]))] = payload_tensor(
                    payload, spec.torch_dtype, length, "replica unit member").clone()

    def _add_replica_member(self, key: int, replica: int, rank: int, update_id: int, tensor: torch.Tensor) -> None:
        with self._lock:
            self._replica_sums.setdefault((key, replica), _ReplicaSum(since=time.monotonic())).arrived[
                (rank, update_id)] = tensor

    def _send_replications(self, now: float) -> float:
        """Send the copies that are due and the replica units that are complete; returns how
        long until the next copy is due."""
        w = self.worker
        channel = w.channel
        with self._lock:
            due = [r for r in self._replications if r.due <= now]
            self._replications = [r for r in self._replications if r.due > now]
            complete = [(k, u) for k, u in self._replica_sums.items() if u.members and len(u.arrived) >= len(u.members)]
            stale = [k for k, u in self._replica_sums.items()
                     if now - u.since > w.config.timeout_s and (k, u) not in complete]
            for k, _ in complete:
                del self._replica_sums[k]
            for k in stale:
                log.error("%s: replica aggregator: unit %d for %s got %d of its members' copies in %.0f s; dropped "
                          "(its replica will miss it)", w.who, k[0], w.layout.describe(k[1]),
                          len(self._replica_sums[k].arrived), w.config.timeout_s)
                del self._replica_sums[k]
            nxt = min((r.due for r in self._replications), default=now + 0.05)
        gone = w.transport.gone_peers
        for r in due:
            if r.dest in gone:
                continue
            if r.dest == w.transport.rank:  # this host is the unit's replica aggregator
                header = protocol.decode(r.meta)
                self._add_replica_member(int(header["unit"]), int(header["replica"]), int(header["rank"]),
                                         int(header["id"]), r.tensor)
                continue
            paced = r.rate is not None and w.transport.pace_connection(r.dest, channel, r.rate)
            handle = w.transport.send(r.dest, r.tag, tensor_bytes(r.tensor), meta=r.meta, channel=channel)
            self._replicating.append((handle, r.dest, r.tensor, paced))
            self.copies_sent += 1
        for (key, _), unit in complete:
            if unit.dest in gone:
                continue
            total = _sum_in_order([unit.arrived[m] for m in unit.members])
            paced = unit.rate is not None and w.transport.pace_connection(unit.dest, channel, unit.rate)
            handle = w.transport.send(unit.dest, protocol.tag(protocol.REPLICATE, w.config.session), tensor_bytes(total),
                                      meta=protocol.encode(op="unit", unit=key, model=unit.model), channel=channel)
            self._replicating.append((handle, unit.dest, total, paced))
        still = []
        for handle, dest, tensor, paced in self._replicating:
            if handle.done():
                if paced:
                    w.transport.pace_connection(dest, channel, None)
            else:
                still.append((handle, dest, tensor, paced))
        self._replicating = still
        return max(0.0, nxt - now)

    def _forward_ready(self, now: float) -> None:
        w = self.worker
        with self._lock:
            ready = []
            for key, group in self._groups.items():
                if not group.planned:
                    continue
                for j in group.servers:
                    got = group.arrived.get(j, [])
                    if j not in group.sent and got and (len(got) >= len(group.members) or now >= group.deadline):
                        group.sent.add(j)
                        ready.append((key, group, j, list(got)))
            for key in [k for k, g in self._groups.items() if g.planned and len(g.sent) == len(g.servers)
                        and now >= g.deadline]:
                del self._groups[key]
        for (batch, slot), group, j, got in ready:
            # in the members' order, as a replica aggregator sums the same unit: equal bits
            position = {m: i for i, m in enumerate(group.members)}
            got.sort(key=lambda m: position.get((int(m[0]["rank"]), int(m[0]["id"])), len(position)))
            total = _sum_in_order([t for _, t in got])
            if len(got) < len(group.members):
                self.partial += 1
                log.warning("%s: aggregator: group %d of batch %d forwarded with %d of %d members (deadline)",
                            w.who, slot, batch, len(got), len(group.members))
            first = got[0][0]
            meta = protocol.encode(op=protocol.PUSH, model=group.model, batch=batch, slot=slot,
                                   clock=first["clock"], version=first["version"], norm=0.0,
                                   workers=[w.layout.worker_index(int(h["rank"])) for h, _ in got],
                                   versions=[int(h["version"]) for h, _ in got],
                                   members=[[int(h["rank"]), int(h["id"])] for h, _ in got])
            rate = group.rates[group.servers.index(j)] if group.rates else None
            server = w.server_rank(j)
            paced = rate is not None and w.transport.pace_connection(server, w.channel, rate)
            handle = w.transport.send(server, protocol.request_tag(w.config.session), tensor_bytes(total), meta=meta,
                                      channel=w.channel)
            _wait_sent(w.transport, [handle], w.config.timeout_s)
            if paced:
                w.transport.pace_connection(server, w.channel, None)
            self.forwarded += 1
