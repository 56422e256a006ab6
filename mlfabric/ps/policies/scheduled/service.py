"""The ``scheduled`` policy's scheduler service: a thread beside server 0 that plans batches of updates.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_network_replication.py -q

Workers send it a small request per update; every ``interval_s``, or once every worker still
in the job waits, it plans the batch (:class:`mlfabric.ps.scheduler.Scheduler`: order, drops,
aggregation) on the residual network and sends the decisions, the groups and the servers'
orders; under network replication it plans the replica units too (module docstring of
:mod:`mlfabric.ps.policies.scheduled`). It reaches server 0 through its port.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from mlfabric.transport.base import Transport

from ... import protocol
from ...divergence import update_norm
from ...scheduler import NetState
from ...scheduler.replication import ReplicaUnit, ReplicationPlan, plan_replication
from .core import BatchingCore, BatchPlan, CoreStats, Request
from .cutthrough import TreeNode, encode_tree
from .settings import UNITS_PER_BATCH, ScheduledSettings, aggregator_ranks, avg_rate_bps, host_of_rank

if TYPE_CHECKING:
    from mlfabric.ps.policy import ServerPort

log = logging.getLogger("mlfabric.ps")


@dataclass
class SchedulerStats(CoreStats):
    """The core's counts (copied from it after each turn) and the replication feed's."""

    #: Network replication (§5.3): units sent toward replicas, units punted to a later batch
    #: (counted each time), batches whose last server update was delayed, and batches where
    #: one unit alone exceeds Div_max (no schedule meets it).
    replica_units: int = 0
    replica_punted: int = 0
    replica_delays: int = 0
    replica_violations: int = 0
    #: Seconds from a request's arrival to its decision's send, summed over the decisions
    #: (``held``): what the worker's wait for its decision spends here; the rest of that wait
    #: is the control messages' way through the network and the threads' wake-ups.
    held_s: float = 0.0
    held: int = 0

    def as_dict(self) -> dict[str, Any]:
        ms = sorted(self.plan_ms)
        return {"batches": self.batches, "requests": self.requests, "dropped_by_scheduler": self.dropped,
                "request_to_decision_ms": 1e3 * self.held_s / self.held if self.held else None,
                "aggregated": self.aggregated, "plan_ms_p50": ms[len(ms) // 2] if ms else None,
                "plan_ms_max": ms[-1] if ms else None, "replica_units": self.replica_units,
                "replica_punted": self.replica_punted, "replica_delays": self.replica_delays,
                "replica_violations": self.replica_violations}


class SchedulerService:
    """The scheduler thread of one PS session (module docstring): the runtime's driver of the
    :class:`~.core.BatchingCore`, on server 0's transport. ``clock``: where it reads the time
    (a test hands it a recorded one)."""

    def __init__(self, server: "ServerPort", settings: ScheduledSettings, *, orders: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        #: Where server 0's own orders go (its :class:`~.server.ScheduledServerSide`), and whose
        #: ``planned_ahead`` sets each batch's first version.
        self.orders = orders
        self.transport: Transport = server.transport
        self.layout = server.layout
        self.settings = settings
        self.clock = clock
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
        # Batches are numbered from 1; a promoted replica's scheduler numbers its own apart, so
        # that nothing the lost scheduler planned (a worker's group, a late update, a replica's
        # unit) can be taken for one of its batches.
        self.core = BatchingCore(servers=self.serving, aggregators=self.aggregators, hosts=self.layout.world_size,
                                 tau=None if self.sync else int(consistency.delay_bound or 0),
                                 seed=server.config.seed, interval_s=settings.interval_s, slack_s=settings.slack_s,
                                 rate_bps=settings.rate_bps, monitor_lag_s=settings.monitor_lag_s,
                                 first_batch=1 + (self.transport.rank << 20),
                                 host_of=self._host_of if settings.workers_per_host > 1 else None,
                                 trees=settings.trees, chunk_bytes=settings.chunk_bytes if settings.trees else 0)
        self.monitor, self.ledger = self.core.monitor, self.core.ledger
        # The ledger is read and extended by this thread (pushes) and by server 0's loop
        # (model distribution, :meth:`network`).
        self._ledger_lock = threading.Lock()
        self.stats = SchedulerStats()
        #: When each worker's open request arrived (a worker has one open at a time: its push
        #: waits for the decision), for ``stats.held_s``.
        self._asked: dict[int, float] = {}
        #: Every plan made, when ``record`` is set (tests compare them with the simulator's), and
        #: the turns of the loop so far.
        self.record: list[BatchPlan] | None = None
        self.turns = 0
        self.turn_lock = threading.Lock()
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
        self._request_ids: dict[tuple[str, int], int] = {}

    def _host_of(self, rank: int) -> int:
        """The host of worker ``rank``: its host's leading worker rank (``workers_per_host``
        consecutive workers to a host, :func:`~.settings.host_of_rank`)."""
        return host_of_rank(rank, self.settings.workers_per_host, first=self.layout.worker_ranks[0])

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
        while not self._stop.is_set():
            version = mailbox.version
            now = self.turn()
            wake = self.core.wake_at()
            self.transport.progress(version, max(0.0, min(0.05, (wake if wake is not None else now) - now)))

    def turn(self) -> float:
        """One turn of the loop at one time: read the clock, take the requests that arrived,
        plan if a batch is due, carry the plans out; returns that time. ``turn_lock`` is held
        throughout (a driver that hands the thread a time and a message together holds it)."""
        tag = protocol.tag(protocol.SCHEDULE, self.server.config.session)
        with self.turn_lock:
            now = self.clock()
            while (msg := self.transport.mailbox.take(self.server.channel, tag)) is not None:
                self._take(msg, now)
            counted = {self.layout.worker_rank(w) for w in self.server.book.counted(now)}
            interval_over = self.core.next_batch is not None and now >= self.core.next_batch
            with self._ledger_lock:
                plans = self.core.turn(now, counted, self._v_init, self._failed)
            for plan in plans:
                if self.record is not None:
                    self.record.append(plan)
                if self.replicating:
                    with self._ledger_lock:
                        self._replicate(plan, now)
                self._dispatch(plan, now)
            self._count()
            if interval_over and self._punted:
                # No batch to ride with: the punted units go now (the job may be ending).
                self._flush_replication(now)
            self.turns += 1
        return now

    def _v_init(self, model: str) -> int | None:
        shard = self.server.shards.get(model)
        if shard is None:
            log.error("%s: scheduler: update requests for unknown model %r dropped", self.server.who, model)
            return None
        return shard.version + self.orders.planned_ahead(model)

    def _failed(self, model: str, exc: Exception) -> None:
        log.error("%s: scheduler: planning a batch of %r failed (%s: %s); its workers fall back to unscheduled "
                  "pushes", self.server.who, model, type(exc).__name__, exc, exc_info=exc)

    def _count(self) -> None:
        core = self.core.stats
        self.stats.batches, self.stats.requests = core.batches, core.requests
        self.stats.dropped, self.stats.aggregated, self.stats.plan_ms = core.dropped, core.aggregated, core.plan_ms

    def network(self, now: float) -> NetState:
        """The residual network at ``now`` (capacities minus every reservation still running)."""
        with self._ledger_lock:
            return self.core.network(now)

    def reserve(self, transfers: list[Any]) -> None:
        """Transfers planned outside the scheduler's batches (model distribution) hold their
        bandwidth for the next batches too."""
        with self._ledger_lock:
            self.core.reserve(transfers)

    def _take(self, msg: Any, now: float) -> None:
        header = protocol.decode(msg.meta)
        if header["op"] == "request":
            # the last request of each worker: a host request (#36) names only its leading
            # member's id, the others' decisions need theirs
            self._request_ids[(header["model"], msg.src)] = int(header["id"])
            self._asked[msg.src] = now
            self.core.request(Request(rank=msg.src, id=int(header["id"]), model=header["model"],
                                      version=int(header["version"]), norm=float(header.get("norm") or 0.0),
                                      clock=int(header.get("clock", 0)),
                                      sizes=tuple(float(s) for s in header["sizes"])))
        elif header["op"] == "cancel":
            self.core.cancel(msg.src, int(header["id"]), header["model"])
        elif header["op"] == "monitor":
            self.report(msg.src, header.get("up"), header.get("down"), now)

    def report(self, host: int, up: float | None, down: float | None, now: float | None = None) -> None:
        """A NIC's measured rates (bytes/s) at ``now`` (default: the clock): from a worker's
        monitor message, or this host's own."""
        with self._ledger_lock:
            self.core.report(host, up, down, self.clock() if now is None else now)

    def _dispatch(self, plan: BatchPlan, now: float) -> None:
        session, channel = self.server.config.session, self.server.channel
        # Orders first: server 0 then has its order before any update of the batch can arrive.
        order = protocol.Order(**plan.order())
        meta = order.encode()  # one encoding for every other server
        for j, rank in enumerate(self.serving):
            if j == self.server.server:
                self.orders.add_order(self.server, order.fields(), self.clock())
            else:
                self.transport.send(rank, protocol.request_tag(session), b"", meta=meta, channel=channel)
        trees = plan_trees(plan, self._node_ranks(plan))
        # Groups before decisions: a node learns its order before its members (itself among
        # them) send their chunks, and its worker cannot leave in between.
        for g in plan.groups:
            in_tree = g.slot in trees
            meta = protocol.GroupPlan(batch=plan.batch, slot=g.slot, model=plan.model,
                                      members=[list(m) for m in g.members], servers=list(g.servers),
                                      deadline_in=g.deadline_in, rates=list(g.rates),
                                      tree=trees[g.slot][0] if in_tree else None,
                                      chunk_bytes=int(getattr(g, "chunk_bytes", 0)) if in_tree else None).encode()
            self.transport.send(trees[g.slot][2][g.host] if g.slot in trees else g.host,
                                protocol.tag(protocol.AGGREGATE, session), b"", meta=meta, channel=channel)
        requests = {(r.rank, r.id): r for r in plan.requests}
        for d in plan.decisions:
            host = self._host_members(plan, requests.get((d.rank, d.id)), d)
            if d.drop:
                meta = protocol.Dropped(reason=d.reason, batch=plan.batch).encode()
            else:
                # a member of a tree sends chunk by chunk and keeps its update till its node's
                # deadline (to send it again around the node if it is lost): it gets the tree
                tree = trees.get(d.group) if d.group else None
                node = next((g for g in tree[1] if any(m == (d.rank, d.id) for m in g.members)), None) if tree else None
                # a tree member goes to the node that lists it (its own host: the planner's
                # hop names the group's root, where Alg. 3's one aggregator would be)
                hop = list(d.hop) if node is None else [tree[2][node.host]] * len(d.hop)
                meta = protocol.Planned(
                    batch=plan.batch, group=d.group, position=d.position, hop=hop, start_in=d.start_in,
                    rates=list(d.rates), host_members=host or None,
                    tree=None if node is None else tree[0],
                    chunk_bytes=None if node is None else int(getattr(node, "chunk_bytes", 0)),
                    hold_in=None if node is None else node.deadline_in + self.settings.slack_s).encode()
            asked = self._asked.pop(d.rank, None)
            if asked is not None:
                self.stats.held_s += self.clock() - asked
                self.stats.held += 1
            self.transport.send(d.rank, protocol.tag(protocol.DECISION, session, d.id), b"", meta=meta,
                                channel=channel)

    def _node_ranks(self, plan: BatchPlan) -> dict[int, int]:
        """The rank that runs each tree node: with several workers per host the planner's
        nodes are hosts (numbered like :func:`~.settings.host_of_rank`), run by the host
        request's leading worker (the node's first member), or the host's first worker for a
        node without members; with one worker per host a node is its rank."""
        if self.settings.workers_per_host <= 1:
            return {g.host: g.host for g in plan.groups}
        k, first = self.settings.workers_per_host, self.layout.worker_ranks[0]
        return {g.host: g.members[0][0] if g.members else first + (g.host - first) * k for g in plan.groups}

    def _host_members(self, plan: BatchPlan, request: Request | None, d: Any) -> list[list[int]]:
        """Host-local aggregation (#36): the co-located members summed into a host request
        (``Request.members``) beside its leading one, as ``[rank, request id]``; each is told
        to hand its update to the leader (over shared memory: the transport's link between
        ranks of one host) or that it was dropped with the host request."""
        if request is None or len(request.members) <= 1:
            return []
        session, channel = self.server.config.session, self.server.channel
        out = []
        for rank in request.members:
            if rank == request.rank:
                continue
            rid = self._request_ids.get((plan.model, rank))
            if rid is None:
                log.error("%s: scheduler: host request of %s names %s, whose request id is unknown: its update is "
                          "left out", self.server.who, self.layout.describe(request.rank), self.layout.describe(rank))
                continue
            out.append([rank, rid])
            meta = protocol.ToHost(drop=d.drop, reason=d.reason, batch=plan.batch, host=request.rank,
                                   host_id=request.id).encode()
            self.transport.send(rank, protocol.tag(protocol.DECISION, session, rid), b"", meta=meta, channel=channel)
        return out

    # -- network replication (§5.3) ----------------------------------------------------------

    def _replicate(self, plan: BatchPlan, now: float) -> None:
        """Plan this batch's units toward every replica on the network the batch leaves, send
        the frozen ones on their way, keep the punted ones for the next batch; each entry of
        the server's order gains ``[unit key, norm bound, not-before]`` (the last entry's
        not-before: §5.3 step 3's delay, seconds from now, or None)."""
        model, entries, members, commits = plan.model, plan.entries, plan.members, plan.commits
        shard = self.server.shards[model]
        weight = 1.0 / self.layout.workers  # what the server applies a scheduled update with
        delay_until: float | None = None
        for i, entry in enumerate(entries):
            key = plan.batch * UNITS_PER_BATCH + i
            norm = update_norm(shard.lr, weight, [r.norm for r in members[i]])
            self._unit_members[key] = [(r.rank, r.id) for r in members[i]]
            entry += [key, norm, None]
        for j, serving in enumerate(self.serving):
            units = [ReplicaUnit(key=e[5], norm=e[6], members=tuple((r.rank, float(r.sizes[j])) for r in m))
                     for e, m in zip(entries, members)]
            for replica in self.layout.replicas_of(j):
                if self.transport.is_gone(replica):
                    continue  # the server warns; nothing goes toward a replica that is gone
                if replica == serving:
                    continue  # it took over this shard: it is the server now
                replication = self._plan_replica(model, j, replica, units, commits, now)
                if replication.delay_last_until is not None:
                    delay_until = max(delay_until or 0.0, replication.delay_last_until)
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
                self.transport.send(out.src, aggregate, b"", channel=channel, meta=protocol.ReplicaUnit(
                    unit=key, model=model, server=j, dest=replica, members=[list(m) for m in members],
                    rate=avg_rate_bps(out)).encode())
            for (rank, update_id), tr in zip(members, transfers):
                self.transport.send(rank, aggregate, b"", channel=channel, meta=protocol.Replicate(
                    unit=key, model=model, id=update_id, server=j, dest=tr.dst, replica=replica,
                    start_in=max(0.0, tr.begin - now), rate=avg_rate_bps(tr)).encode())
        if plan.frozen:
            self.transport.send(replica, protocol.tag(protocol.REPLICATE, session), b"", channel=channel,
                                meta=protocol.Units(model=model, units=list(plan.frozen),
                                                    commit_in=[plan.replica_commit[k] - now for k in plan.frozen]).encode())


def plan_trees(plan: BatchPlan, ranks: dict[int, int]) -> dict[int, tuple[list[list[Any]], list[Any], dict[int, int]]]:
    """Per group slot whose nodes form a tree (a node with a ``parent`` or ``children``, or
    cut-through ``chunk_bytes``: :class:`~.core.GroupOrder`'s tree fields), the tree as the
    messages carry it (in ranks: ``ranks`` maps a node's host to the rank running it), its
    nodes' orders and that map. Slots of today's one-level, store-and-forward
    groups are left out: they keep the plain group path (:meth:`Aggregator._forward_ready`).
    MLfabric-S runs the same trees: the server counts a tree's aggregate toward its round."""
    slots: dict[int, list[Any]] = {}
    for g in plan.groups:
        slots.setdefault(g.slot, []).append(g)
    trees = {}
    for slot, nodes in slots.items():
        if not any(getattr(g, "parent", None) is not None or getattr(g, "children", ()) or getattr(g, "chunk_bytes", 0)
                   for g in nodes):
            continue
        def rank(host: int | None) -> int | None:
            return None if host is None else ranks.get(host, host)

        tree = {rank(g.host): TreeNode(parent=rank(getattr(g, "parent", None)),
                                       children=tuple(rank(c) for c in getattr(g, "children", ())),
                                       members=tuple(tuple(m) for m in g.members)) for g in nodes}
        trees[slot] = (encode_tree(tree), nodes, {g.host: rank(g.host) for g in nodes})
    return trees


# --------------------------------------------------------------------------- the worker's daemon

