"""The ``scheduled`` policy's decisions without I/O: messages and time in, actions out.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled_core.py -q

Three cores, each a plain object that never sends, sleeps nor reads the time it decides on
(it only times its own planning, a statistic); the caller hands it what arrived and the time, and carries out what it returns (or what it asks of the
port it is handed). The runtime drives them over the transports (:mod:`.service` on a
thread beside server 0, :mod:`.server` in each server's loop); the simulator
(:mod:`mlfabric.sim.mlfabric`) drives **the same objects** over its flow model, so that the
simulated MLfabric modes run the runtime's batching, planning, application order and model
distribution, not a copy of them:

* :class:`BatchingCore` -- the scheduler: update requests and monitor reports in; every
  ``interval_s`` (or as soon as every worker still counted has a request waiting; MLfabric-A
  on trees: and not before the server's down-link is about free of the trees planned) one
  :class:`BatchPlan` per model out: the servers' application order (entries), each request's
  decision (drop, or next hop / start / rate per server component) and each aggregator's group.
* :class:`OrderBook` -- a server applying batches in their planned order: orders and arrived
  updates in; through its port (``apply``, ``skipped``, ``hold_last``, ``batch_done``) the
  entries applied or skipped in order, each missing one ``slack_s`` past its planned commit.
* :class:`PullBatcher` -- model distribution (§10.3): when a batch of pulls may go and how
  it is split between the server and ``k°`` distributors.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ...monitor import Ledger, NetworkMonitor
from ...scheduler import BatchSchedule, NetState, PullBatchPlan, Scheduler, SchedulerConfig, UpdateRequest, plan_pull_batch
from ...scheduler.trees import attach_to_multicast, plan_multicast
from .settings import avg_rate_bps

#: MLfabric-A on trees (#36): a batch is not planned before the server's down-link is, less
#: this lead, planned free of the trees already planned (as well as not before the
#: ``interval_s`` tick). Every tree costs the server's down-link a whole transfer whatever its
#: size, so a batch every 100 ms while a transfer takes 80-160 ms queues small trees at the
#: server; holding the batch while the link is busy lets it grow instead. 30 ms: 0 / 15 / 30 /
#: 60 ms measured within 0.02x of each other in C1/C2-N1 (docs/mlfabric_scheduler.md, "Trees").
PACE_LEAD_S = 0.03

# --------------------------------------------------------------------------- the scheduler


@dataclass(frozen=True, kw_only=True)
class Request:
    """One update request as the scheduler sees it: who (``rank``), the worker's id for it,
    the model, the version it was computed from, its norm, the worker's clock and the size of
    each server component (bytes).

    Host-local aggregation (#36): ``members`` are the worker ranks whose updates are summed
    on their host (shared memory, no NIC) into this one request; empty means just ``rank``.
    ``rank`` and ``id`` are then the host's leading member and that member's request id (the
    pair stays unique), ``version`` is the **oldest** member's version (so the delay bound the
    scheduler enforces holds for every member) and :attr:`count` worker updates travel as one."""

    rank: int
    id: int
    model: str
    version: int
    sizes: tuple[float, ...]
    norm: float = 0.0
    clock: int = 0
    members: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Worker updates this request carries (1 unless host-local members are summed in it)."""
        return max(1, len(self.members))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The worker ranks whose updates it carries (``members``, or just ``rank``)."""
        return self.members or (self.rank,)


@dataclass(frozen=True, kw_only=True)
class RequestDecision:
    """What the scheduler tells one request's worker: dropped (with the reason), or its group
    (0: direct), position, next hop per server component, start (seconds from the plan) and
    planned rate per component (bit/s; None: unpaced)."""

    rank: int
    id: int
    drop: bool
    reason: str | None = None
    group: int = 0
    position: int = 0
    hop: tuple[int, ...] = ()
    start_in: float = 0.0
    rates: tuple[float | None, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GroupOrder:
    """What one aggregator host is told: its group (slot) of a batch, the members (rank, id),
    the server components it sums, when to forward what came (seconds from the plan) and the
    planned rate of each forward.

    Multi-level pipelined trees (#36; the defaults are today's one level, store-and-forward):
    ``parent`` is the host this node forwards its sum to (None: the servers, one per server
    component, as today: the tree's root, the entry the server applies); ``children`` are the
    aggregator hosts whose partial sums it also waits for, beside its direct ``members``;
    ``chunk_bytes`` > 0 makes it cut-through: chunk i of the sum is forwarded as soon as chunk
    i has arrived from every input (members and children), 0 is store-and-forward. Every node
    of one tree carries the batch's ``slot``."""

    host: int
    slot: int
    members: tuple[tuple[int, int], ...]
    servers: tuple[int, ...]
    deadline_in: float
    rates: tuple[float | None, ...]
    parent: int | None = None
    children: tuple[int, ...] = ()
    chunk_bytes: int = 0


@dataclass(kw_only=True)
class BatchPlan:
    """One planned batch of one model (:class:`BatchingCore`'s action). ``entries``: the
    servers' application order, per entry ``[kind, key, key/count, deadline_in, ranks]``
    (``["u", rank, id, ...]`` one update, ``["g", slot, count, ...]`` an aggregate);
    ``members`` / ``commits``: beside each entry its requests and planned commit time;
    ``schedule``: the scheduler's plan itself (transfers, for a simulator or replication)."""

    model: str
    batch: int
    v_init: int
    now: float
    sync: bool
    entries: list[list[Any]]
    members: list[list[Request]]
    commits: list[float]
    decisions: list[RequestDecision]
    groups: list[GroupOrder]
    clocks: list[int]
    requests: list[Request]
    schedule: BatchSchedule

    def order(self) -> dict[str, Any]:
        """The servers' order message's fields."""
        return {"batch": self.batch, "model": self.model, "v_init": self.v_init, "entries": self.entries,
                "sync": self.sync, "clocks": self.clocks}

    def summary(self) -> dict[str, Any]:
        """Everything decided, as plain data (what check 3 compares between drivers)."""
        return {"model": self.model, "batch": self.batch, "v_init": self.v_init, "entries": self.entries,
                "decisions": [vars(d) for d in self.decisions], "groups": [vars(g) for g in self.groups]}


@dataclass
class CoreStats:
    batches: int = 0
    requests: int = 0
    dropped: int = 0
    aggregated: int = 0
    plan_ms: list[float] = field(default_factory=list)


class BatchingCore:
    """The scheduler's decisions (module docstring). ``servers``: the rank (host) serving each
    shard; ``aggregators``: the worker hosts that may aggregate; ``hosts``: how many hosts the
    monitor tracks; ``tau``: MLfabric-A's delay bound (None: MLfabric-S, ``sync``);
    ``first_batch``: the first batch number (a promoted replica numbers its own apart).

    #36: ``host_of`` maps a worker rank to its host (the network node the scheduler plans
    on; None: the rank is the host, today). Requests of co-located workers waiting for the
    same batch are summed on their host into one request (:func:`merge_host_requests`: the
    rule is "what is ready at the batch, from the same model version"; a worker finishing after
    its host's request was planned goes in a later batch on its own or with its host's next
    ones). ``trees``: plan
    aggregation as multi-level pipelined trees (:mod:`mlfabric.ps.scheduler.trees`) with
    ``chunk_bytes`` cut-through chunks instead of Alg. 3's one level."""

    def __init__(self, *, servers: Sequence[int], aggregators: Sequence[int], hosts: int, tau: int | None,
                 seed: int, interval_s: float, slack_s: float, rate_bps: float, monitor_lag_s: float,
                 first_batch: int = 1, host_of: Callable[[int], int] | None = None, trees: bool = False,
                 chunk_bytes: int = 0) -> None:
        self.host_of = host_of
        self.trees, self.chunk_bytes = trees, int(chunk_bytes)
        self._round: set[int] = set()  # MLfabric-S on trees: the ranks planned in this BSP round
        self.sync = tau is None
        self.interval_s, self.slack_s = interval_s, slack_s
        self.servers = list(servers)
        self.scheduler = Scheduler(SchedulerConfig(tau_max=0 if tau is None else int(tau),
                                                   mode="sync" if self.sync else "async",
                                                   aggregation=bool(aggregators) or trees, seed=seed,
                                                   trees=trees, chunk_bytes=int(chunk_bytes)),
                                   servers=list(servers), aggregators=list(aggregators))
        self.monitor = NetworkMonitor(hosts=hosts, default_bps=rate_bps / 8, lag_s=monitor_lag_s)
        self.ledger = Ledger()
        self.stats = CoreStats()
        self.pending: dict[str, list[Request]] = {}
        self._batches = itertools.count(first_batch)
        self.next_batch: float | None = None  # set by the first turn
        #: MLfabric-A on trees: when the server's down-link is planned free of the trees
        #: planned so far (the latest arrival of a tree at the server); the next batch is
        #: planned PACE_LEAD_S before then (:meth:`due`)
        self.link_free = 0.0

    # -- inputs ----------------------------------------------------------------------------------

    def request(self, request: Request) -> None:
        self.pending.setdefault(request.model, []).append(request)

    def cancel(self, rank: int, request_id: int, model: str) -> None:
        """A worker withdrew a request (it pushed unscheduled): out of the next batch."""
        self.pending[model] = [r for r in self.pending.get(model, []) if not (r.rank == rank and r.id == request_id)]

    def report(self, host: int, up: float | None, down: float | None, now: float) -> None:
        """A NIC's measured rates (bytes/s), as the monitor gets them."""
        self.monitor.report(host, up, down, now)

    # -- time ------------------------------------------------------------------------------------

    def due(self, now: float, counted: set[int]) -> bool:
        """Whether a batch is planned now: the interval is over, or every worker still counted
        (``counted``: their ranks) has a request waiting -- the batch cannot grow, a worker has
        one push outstanding at a time, so waiting out the interval only adds latency.

        MLfabric-A on trees (#36) also paces its batches on the server's down-link: nothing is
        due until the trees planned so far are due at the server within :data:`PACE_LEAD_S`
        (``link_free``); requests arriving while the link is busy make the next batch bigger
        rather than queueing another small tree behind it."""
        if self.next_batch is None:
            self.next_batch = now + self.interval_s
        if self.trees and not self.sync and now < self.link_free - PACE_LEAD_S:
            return False
        if now >= self.next_batch:
            return True
        if not any(self.pending.values()):
            return False
        waiting = {r.rank for reqs in self.pending.values() for r in reqs}
        if self.sync and self.trees:
            # MLfabric-S on trees (#36): a BSP round holds one update per worker, so the round's
            # last requests (every worker not yet planned in this round waiting) cannot grow
            # either: plan them at once, not at the next tick (the round's critical path)
            if counted <= self._round:
                self._round = set()
            return (counted - self._round) <= waiting
        return counted <= waiting

    def wake_at(self) -> float | None:
        """When the next batch is due at the latest (the driver wakes the core then)."""
        if self.trees and not self.sync and self.next_batch is not None:
            return max(self.next_batch, self.link_free - PACE_LEAD_S)
        return self.next_batch

    def turn(self, now: float, counted: set[int], v_init: Callable[[str], int | None],
             on_error: Callable[[str, Exception], None] | None = None) -> list[BatchPlan]:
        """One turn: if due, one plan per model with requests waiting (``v_init(model)``: the
        version its batch starts from, None for a model the server does not know: its
        requests are dropped), and the next batch is ``interval_s`` away."""
        if not self.due(now, counted):
            return []
        plans = []
        for model in [m for m, reqs in self.pending.items() if reqs]:
            pending = self.pending.pop(model)
            first = v_init(model)
            if first is None:
                continue
            try:
                plans.append(self.plan(model, pending, first, now))
            except Exception as exc:  # noqa: BLE001 - a failed plan must not stop the scheduler
                if on_error is None:
                    raise
                on_error(model, exc)
        self.next_batch = now + self.interval_s
        return plans

    # -- planning --------------------------------------------------------------------------------

    def network(self, now: float) -> NetState:
        """The residual network at ``now`` (capacities minus every reservation still running)."""
        return self.ledger.state(now, *self.monitor.capacities(now))

    def reserve(self, transfers: list[Any]) -> None:
        """Transfers planned outside the batches (model distribution) hold their bandwidth too."""
        self.ledger.add(transfers)

    def plan(self, model: str, pending: list[Request], v_init: int, now: float) -> BatchPlan:
        """Plan one batch: order and drops (Alg. 2), aggregation (Alg. 3) on the residual network."""
        started = time.perf_counter()
        if self.sync:
            self._round |= {rank for r in pending for rank in r.ranks}
        if self.host_of is not None:
            pending = merge_host_requests(pending, self.host_of)
        host = self.host_of or (lambda rank: rank)
        requests = [UpdateRequest(update_id=i, worker=host(r.rank), sizes=tuple(r.sizes),
                                  version=min(r.version, v_init), norm=r.norm, count=r.count)
                    for i, r in enumerate(pending)]
        schedule = self.scheduler.schedule(requests, version=v_init, network=self.network(now), now=now)
        self.ledger.add([t for d in schedule.applied() for t in d.transfers] +
                        [t for g in schedule.aggregates for t in g.transfers])
        if self.trees and schedule.aggregates:
            self.link_free = max(self.link_free, max(g.arrival for g in schedule.aggregates))
        self.stats.plan_ms.append(1e3 * (time.perf_counter() - started))
        self.stats.batches += 1
        self.stats.requests += len(requests)
        batch = next(self._batches)
        entries, members, commits = self._entries(schedule, pending, now)
        decisions = []
        for d in schedule.decisions:
            r = pending[d.update_id]
            if d.dropped:
                self.stats.dropped += 1
                decisions.append(RequestDecision(rank=r.rank, id=r.id, drop=True, reason=d.reason))
            else:
                decisions.append(RequestDecision(rank=r.rank, id=r.id, drop=False, group=d.group, position=d.position,
                                                 hop=tuple(d.next_hop), start_in=max(0.0, (d.start or now) - now),
                                                 rates=tuple(avg_rate_bps(t) for t in d.transfers)))
        groups = []
        for g in schedule.aggregates:
            self.stats.aggregated += sum(pending[m].count for m in g.members)
            group = tuple((pending[m].rank, pending[m].id) for m in g.members)
            if g.nodes:  # a pipelined tree (#36): one order per node, its own members
                rate = avg_rate_bps(g.transfers[0]) if g.transfers else None
                deadline = max(0.0, g.commit - now) + self.slack_s
                for node in g.nodes:
                    groups.append(GroupOrder(host=node.host, slot=g.slot,
                                             members=tuple((pending[m].rank, pending[m].id) for m in node.members),
                                             servers=tuple(range(len(self.servers))), deadline_in=deadline,
                                             rates=(rate,), parent=node.parent, children=node.children,
                                             chunk_bytes=g.chunk_bytes))
                continue
            for host in sorted(set(g.hosts)):
                servers = tuple(j for j, h in enumerate(g.hosts) if h == host)
                groups.append(GroupOrder(host=host, slot=g.slot, members=group, servers=servers,
                                         deadline_in=max(0.0, g.commit - now) + self.slack_s,
                                         rates=tuple(avg_rate_bps(g.transfers[j]) if j < len(g.transfers) else None
                                                     for j in servers)))
        return BatchPlan(model=model, batch=batch, v_init=v_init, now=now, sync=self.sync, entries=entries,
                         members=members, commits=commits, decisions=decisions, groups=groups,
                         clocks=sorted({r.clock for r in pending}), requests=list(pending), schedule=schedule)

    def _entries(self, plan: BatchSchedule, pending: list[Request],
                 now: float) -> tuple[list[list[Any]], list[list[Request]], list[float]]:
        """The servers' application order: per entry (an update, or a group's aggregate)
        ``[kind, key, key/count, deadline_in, ranks]``; beside it the entries' members and
        planned commit times."""
        entries: list[list[Any]] = []
        members: list[list[Request]] = []
        commits: list[float] = []
        for d in plan.applied():  # application order
            r = pending[d.update_id]
            commit = d.commit or now
            deadline = max(0.0, commit - now) + self.slack_s
            if d.group == 0 or not entries or entries[-1][0] != "g" or entries[-1][1] != d.group:
                entries.append(["u", r.rank, r.id, deadline, list(r.ranks)] if d.group == 0
                               else ["g", d.group, r.count, deadline, list(r.ranks)])
                members.append([r])
                commits.append(commit)
            else:
                entries[-1][2] += r.count
                entries[-1][3] = max(entries[-1][3], deadline)
                entries[-1][4].extend(r.ranks)
                members[-1].append(r)
                commits[-1] = max(commits[-1], commit)
        return entries, members, commits


def merge_host_requests(requests: Sequence[Request], host_of: Callable[[int], int]) -> list[Request]:
    """Host-local aggregation's rule (#36): the requests of one model waiting for a batch
    whose workers share a host **and were computed from the same model version** become one
    request, the sum of their updates, in the order of each such set's first request. A
    host's workers receive the model together (one copy per host), so they normally share
    the version; a straggler still computing on an older one goes on its own (merged, its
    older version would make the pair's deadline its own: one doomed update would doom both).
    Its ``members`` are every worker rank in it (a request already merged keeps its members),
    ``rank``/``id`` its first request's (the host's leading member: the pair stays unique),
    ``version`` the members' (the oldest, were they to differ), ``norm`` the sum of norms (a
    bound of the sum's norm), ``clock`` the oldest, ``sizes`` the largest per component (a
    sum of dense same-shaped updates is as large as one). A lone request is kept as it is
    (no members added): with one worker per host nothing changes."""
    by_host: dict[tuple[str, int, int], list[Request]] = {}
    for r in requests:
        by_host.setdefault((r.model, host_of(r.rank), r.version), []).append(r)
    out: list[Request] = []
    for group in by_host.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        first = group[0]
        members = tuple(m for r in group for m in r.ranks)
        out.append(Request(rank=first.rank, id=first.id, model=first.model, version=min(r.version for r in group),
                           sizes=tuple(max(c) for c in zip(*(r.sizes for r in group))),
                           norm=sum(r.norm for r in group), clock=min(r.clock for r in group), members=members))
    return out


# --------------------------------------------------------------------------- the servers' orders


@dataclass
class Entry:
    """One entry of a batch's order at a server."""

    kind: str              # "u": one worker's update (key: rank, id); "g": an aggregate (key: slot)
    key: tuple[Any, ...]
    count: int             # worker updates in it
    deadline: float        # skip it if not here by then
    ranks: frozenset[int]  # the workers whose updates it holds (their pulls wait for it)
    #: Network replication (MLfabric §5.3): the replica unit this entry is, its norm bound,
    #: and when it may be applied at the earliest (the batch's last entry, delayed so that the
    #: replica catches up: 0 otherwise).
    unit: int | None = None
    norm: float | None = None
    not_before: float = 0.0


def entry_count(entry: list[Any]) -> int:
    """Worker updates in one entry of a batch order as the scheduler sends it: ``["u", rank,
    id, deadline, ranks, ...]`` one per rank in ``ranks`` (one, or a host request's members,
    #36), ``["g", slot, count, ...]`` an aggregate's ``count``."""
    if entry[0] == "u":
        return max(1, len(entry[4])) if len(entry) > 4 else 1
    return int(entry[2])


def entry_key(header: dict[str, Any]) -> tuple[Any, ...]:
    """The order entry a scheduled push belongs to (an aggregate's slot, or rank and id)."""
    return ("g", int(header["slot"])) if "slot" in header else ("u", int(header["rank"]), int(header["id"]))


@dataclass
class _BatchOrder:
    batch: int
    entries: list[Entry]
    next: int = 0


class OrderPort(Protocol):
    """What an :class:`OrderBook` asks of the server it runs for."""

    def apply(self, model: str, entry: Entry, arrived: Any) -> None: ...

    def skipped(self, model: str, batch: int, entry: Entry) -> None: ...

    def hold_last(self, model: str, entry: Entry, now: float) -> bool: ...

    def batch_done(self, model: str, batch: int) -> None: ...


class OrderBook:
    """MLfabric-A at a server: batches applied one after the other, each in its planned order
    (module docstring). Not thread-safe by itself: the server side holds a lock around
    :meth:`add_order` and :meth:`planned_ahead` (the scheduler thread calls them)."""

    def __init__(self) -> None:
        self._orders: dict[str, list[_BatchOrder]] = {}
        # per model, the worker updates in orders not yet applied or skipped (what the scheduler
        # adds to the version to plan the next batch's delays)
        self.planned: Counter = Counter()
        self._arrived: dict[tuple[str, int, tuple[Any, ...]], Any] = {}
        self._finished_batch: dict[str, int] = {}  # per model, the last batch fully applied

    def add_order(self, order: dict[str, Any], received: float) -> None:
        """A batch's order (``entries`` as :class:`BatchPlan` makes them; times from ``received``)."""
        self.planned[order["model"]] += sum(entry_count(e) for e in order["entries"])
        entries = [Entry(kind=e[0], key=tuple(e[1:3]) if e[0] == "u" else (int(e[1]),),
                         count=entry_count(e), deadline=received + float(e[3]),
                         ranks=frozenset(int(r) for r in e[4]),
                         unit=int(e[5]) if len(e) > 5 else None, norm=float(e[6]) if len(e) > 6 else None,
                         not_before=received + float(e[7]) if len(e) > 7 and e[7] is not None else 0.0)
                   for e in order["entries"]]
        self._orders.setdefault(order["model"], []).append(_BatchOrder(batch=int(order["batch"]), entries=entries))

    def arrived(self, model: str, batch: int, key: tuple[Any, ...], what: Any) -> None:
        """An entry's update (or aggregate) is here: ``what`` is handed to ``apply`` in its turn."""
        self._arrived[(model, batch, key)] = what

    def step(self, now: float, port: OrderPort, models: Callable[[str], bool] = lambda m: True,
             on_applied: Callable[[str, int], None] | None = None) -> None:
        """Apply (or skip) what is due, in order, through ``port``; ``models(m)``: whether the
        server has model ``m`` yet; ``on_applied(model, count)`` after each entry (the server
        side moves ``planned`` under its lock there)."""
        for model, orders in self._orders.items():
            if not models(model):
                continue
            while orders:
                order = orders[0]
                while order.next < len(order.entries):
                    entry = order.entries[order.next]
                    key = (model, order.batch, (entry.kind, *entry.key))
                    if now < entry.not_before:
                        break  # §5.3: the replica catches up before the batch's last update
                    if order.next == len(order.entries) - 1 and port.hold_last(model, entry, now):
                        break
                    arrived = self._arrived.pop(key, None)
                    if arrived is None:
                        if now < entry.deadline:
                            break
                        port.skipped(model, order.batch, entry)
                    else:
                        port.apply(model, entry, arrived)
                    order.next += 1
                    if on_applied is not None:  # after the version moved: a planner never counts too few
                        on_applied(model, entry.count)
                    else:
                        self.planned[model] -= entry.count
                if order.next < len(order.entries):
                    break
                orders.pop(0)
                self._finished_batch[model] = max(self._finished_batch.get(model, 0), order.batch)
                port.batch_done(model, order.batch)
        # Updates whose batch is over (their entry was skipped) are late: dropped. A batch
        # with no order here yet is not over: its order may still be on the way (it travels
        # from the scheduler on another connection than the update).
        live = {(m, o.batch) for m, orders in self._orders.items() for o in orders}
        for key in [k for k in self._arrived
                    if (k[0], k[1]) not in live and k[1] <= self._finished_batch.get(k[0], 0)]:
            self._arrived.pop(key)

    def wake_at(self) -> float | None:
        """The earliest time something held may become due (a deadline or a not-before)."""
        times = [min(e.deadline, e.not_before) if e.not_before else e.deadline
                 for orders in self._orders.values() for o in orders[:1] for e in o.entries[o.next:o.next + 1]]
        return min(times, default=None)

    def held_ranks(self, model: str) -> set[int]:
        """Workers with an update in an entry not applied (or skipped) yet."""
        ranks: set[int] = set()
        for order in self._orders.get(model, []):
            for entry in order.entries[order.next:]:
                ranks |= entry.ranks
        return ranks


# --------------------------------------------------------------------------- model distribution


@dataclass
class PullBatcher:
    """Model distribution's timing and split (§10.3): pulls that become ready while the server
    is still sending the last batch's answers (until their planned end on its up-link, and
    until the sends are done) wait for the next batch; a batch is split by
    :func:`mlfabric.ps.scheduler.plan_pull_batch` with ``distributors`` (k°) earmarked, ties
    drawn from the server's seeded stream."""

    distributors: int
    seed: int
    server: int
    #: #36: distribute each batch of pulls down a pipelined multicast tree of the pullers' hosts
    #: (:func:`mlfabric.ps.scheduler.trees.plan_multicast`, ``PullBatchPlan.tree``) with
    #: ``chunk_bytes`` cut-through chunks; False: §10.3's k° distributors.
    trees: bool = False
    chunk_bytes: int = 0
    busy_until: float = 0.0
    _draws: random.Random | None = field(default=None, repr=False)
    #: the multicast in flight (trees): who forwards to whom, so that late pulls join it
    inflight: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    def ready(self, now: float, sends_done: bool) -> bool:
        """Whether a batch of pulls may go now: the last batch's sends are done and past
        their planned end on the server's up-link. With ``trees`` too (measured: letting a
        version's multicast start while the last is in flight saturates the server's up-link
        and shares every relay's NICs, and the pulls wait longer; docs/mlfabric_scheduler.md)."""
        return sends_done and now >= self.busy_until

    def answer_at(self) -> float:
        return self.busy_until

    def plan(self, network: NetState, *, me: int, pullers: list[int], model_size: float, now: float,
             answered_first: Sequence[int] = ()) -> PullBatchPlan:
        if self.trees:
            hosts = list(dict.fromkeys([*answered_first, *pullers]))  # a host receives the model once
            plan = plan_multicast(network, server=me, pullers=hosts, model_size=model_size,
                                  chunk_bytes=self.chunk_bytes, start=now)
            self.busy_until = max((t.end for t in plan.transfers if t.src == me), default=now)
            self.inflight = dict(plan.tree)
            return plan
        if self._draws is None:
            self._draws = random.Random(self.seed * 7_919 + self.server)
        plan = plan_pull_batch(network, server=me, pullers=pullers, model_size=model_size,
                               distributors=self.distributors, shuffle=self._draws.shuffle, start=now,
                               answered_first=list(answered_first))
        self.busy_until = max((t.end for t in plan.transfers if t.src == me), default=now)
        return plan


    def attach(self, network: NetState, *, me: int, host: int, model_size: float, now: float) -> PullBatchPlan | None:
        """With ``trees``, a pull that is ready while a multicast is in flight (before
        :meth:`ready`) is answered from it: ``host`` joins the tree as a leaf
        (:func:`mlfabric.ps.scheduler.trees.attach_to_multicast`) and gets the version in
        flight, not a later one after the round. None: nothing in flight to join (the pull
        waits for the next round) or the host is already in it."""
        if not self.trees or now >= self.busy_until or not self.inflight:
            return None
        if any(host in dsts for dsts in self.inflight.values()):
            return None
        relay, transfer = attach_to_multicast(network.fork(), tree=self.inflight, server=me, host=host,
                                              model_size=model_size, start=now)
        self.inflight[relay] = (*self.inflight.get(relay, ()), host)
        return PullBatchPlan(groups=(), by_server=(), transfers=(transfer,), tree={relay: (host,)},
                             chunk_bytes=self.chunk_bytes)


__all__ = ["PACE_LEAD_S", "BatchPlan", "BatchingCore", "Entry", "GroupOrder", "OrderBook", "OrderPort", "PullBatcher",
           "Request", "RequestDecision", "entry_count", "entry_key", "merge_host_requests"]
