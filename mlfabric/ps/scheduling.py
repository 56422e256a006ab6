"""MLfabric's scheduler running for real: batches of update requests in, decisions out.

    python -m pytest tests/unit/test_ps_scheduled.py -q

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

Servers apply a batch's updates in the scheduler's order (``ParameterServer`` keeps the
orders): an entry that has not arrived ``slack_s`` after its planned commit is skipped. A
version planned for an update is ``v_init + position``, with ``v_init`` the server's version
plus what earlier batches planned and have not applied yet, so every planned delay is
<= ``tau_max``; an update pushed outside any batch (a fallback) is checked against the bound
at the server, as in vanilla async.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.runtime.executor import tensor_bytes
from mlfabric.transport.base import SendHandle, Transport

from . import protocol
from .monitor import Ledger, NetworkMonitor
from .routing import answer_directly, send_pulls_directly
from .scheduler import BatchSchedule, NetState, Scheduler, SchedulerConfig, UpdateRequest, distribute
from .server import payload_tensor

if TYPE_CHECKING:
    from .server import ParameterServer
    from .worker import PSWorker

log = logging.getLogger("mlfabric.ps")

DEFAULT_RATE_BPS = 10e9  # what the scheduler assumes of a NIC nobody reported (bit/s)


@dataclass(frozen=True, kw_only=True)
class ScheduledSettings:
    """``interval_s``: batching period. ``aggregators``: k aggregators (worker hosts) per
    server, 0 for none. ``rate_bps``: every NIC's line rate (bit/s) when known
    (``MLFABRIC_NIC_RATE``, the emulator's); ``monitor_lag_s``: how late the scheduler sees
    a NIC's measured rate (§7's t_lag). ``decision_timeout_s``: how long a worker waits for
    its decision before pushing unscheduled; ``slack_s``: how long a server waits past an
    entry's planned commit before skipping it."""

    interval_s: float = 0.1
    aggregators: int = 2
    #: k°: distributors earmarked per batch of pulls (§10.3); 0 answers every pull directly.
    distributors: int = 2
    rate_bps: float = DEFAULT_RATE_BPS
    monitor_lag_s: float = 0.2
    decision_timeout_s: float = 2.0
    slack_s: float = 1.0

    def __post_init__(self) -> None:
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

    def as_dict(self) -> dict[str, Any]:
        ms = sorted(self.plan_ms)
        return {"batches": self.batches, "requests": self.requests, "dropped_by_scheduler": self.dropped,
                "aggregated": self.aggregated, "plan_ms_p50": ms[len(ms) // 2] if ms else None,
                "plan_ms_max": ms[-1] if ms else None}


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
        self.scheduler = Scheduler(SchedulerConfig(tau_max=0 if self.sync else int(consistency.delay_bound or 0),
                                                   mode="sync" if self.sync else "async",
                                                   aggregation=bool(self.aggregators), seed=server.config.seed),
                                   servers=list(self.layout.server_ranks), aggregators=self.aggregators)
        self.monitor = NetworkMonitor(hosts=self.layout.world_size, default_bps=settings.rate_bps / 8,
                                      lag_s=settings.monitor_lag_s)
        self.ledger = Ledger()
        # The ledger is read and extended by this thread (pushes) and by server 0's loop
        # (model distribution, :meth:`network`).
        self._ledger_lock = threading.Lock()
        self.stats = SchedulerStats()
        self._pending: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self._planned: dict[str, int] = {}  # per model: the version after every planned update
        self._batches = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        v_init = max(shard.version, self._planned.get(model, 0))
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
        if not self.sync:
            self._planned[model] = v_init + len(plan.applied())
        self._dispatch(model, next(self._batches), plan, pending, v_init, now)

    def _dispatch(self, model: str, batch: int, plan: BatchSchedule, pending: list[tuple[int, dict[str, Any]]],
                  v_init: int, now: float) -> None:
        session, channel = self.server.config.session, self.server.channel
        slack = self.settings.slack_s
        entries: list[list[Any]] = []
        for d in plan.applied():  # application order
            rank, header = pending[d.update_id]
            deadline = max(0.0, (d.commit or now) - now) + slack
            if d.group == 0:
                entries.append(["u", rank, int(header["id"]), deadline, [rank]])
            elif not entries or entries[-1][0] != "g" or entries[-1][1] != d.group:
                entries.append(["g", d.group, 1, deadline, [rank]])
            else:
                entries[-1][2] += 1
                entries[-1][3] = max(entries[-1][3], deadline)
                entries[-1][4].append(rank)
        # Orders first: server 0 then has its order before any update of the batch can arrive.
        order = {"op": protocol.ORDER, "batch": batch, "model": model, "v_init": v_init, "entries": entries,
                 "sync": self.sync, "clocks": sorted({int(h.get("clock", 0)) for _, h in pending})}
        for j in self.layout.server_ranks:
            if j == self.server.server:
                self.server.add_order(order, time.monotonic())
            else:
                self.transport.send(j, protocol.request_tag(session), b"", meta=protocol.encode(**order),
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

    def send_pull(self, worker: "PSWorker", headers: list[bytes]) -> None:
        send_pulls_directly(worker, headers)

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
        me, size = server.transport.rank, float(shard.numel() * shard.element_size())
        lost = server.transport.lost_peers
        direct = [p for p in pulls if p.direct or p.rank in lost]
        batch = [p for p in pulls if p not in direct]
        server.stats.pull_batches += 1
        handles: list[SendHandle] = []
        if self.settings.distributors >= 1 and len(batch) >= 3:
            transfers, relayed, answered_by_server = self._distribute(server, net, batch, shard, header, now)
            handles += relayed
            direct += answered_by_server
        else:
            direct += batch
            transfers = [net.reserve(me, p.rank, size, now) for p in direct]
        handles += answer_directly(server, direct, shard, header)
        if service is not None:
            service.reserve(list(transfers))
        self._busy_until = max((t.end for t in transfers if t.src == me), default=now)
        self._answering = list(handles)
        return handles

    def _distribute(self, server: "ParameterServer", net: NetState, batch: list[Any], shard: torch.Tensor,
                    header: bytes, now: float) -> tuple[list[Any], list[SendHandle], list[Any]]:
        """Plan a batch's distribution and send what goes through distributors (the model with
        its forward list to each, a "via" note to each of their workers); returns the plan's
        transfers, those sends, and the pulls left for the server to answer itself (group 0,
        and the earmarked distributors the plan did not use)."""
        import random

        if self._draws is None:
            self._draws = random.Random(server.config.seed * 7_919 + server.server)
        size = float(shard.numel() * shard.element_size())
        me = server.transport.rank
        ranks = [p.rank for p in batch]
        self._draws.shuffle(ranks)
        ranks.sort(key=lambda r: net.t_en(me, r, size, now))  # stable: ties keep the seeded draw
        k = min(self.settings.distributors, len(ranks) - 1)
        plan = distribute(net, server=me, workers=ranks[k:], distributors=ranks[:k], model_size=size, start=now)
        pull_of = {p.rank: p for p in batch}
        session, channel, payload = server.config.session, server.channel, tensor_bytes(shard)
        fields = protocol.decode(header)
        handles: list[SendHandle] = []
        relays = {d for d, _ in plan.groups}
        for d, members in reversed(plan.groups):  # the paper's order: distributor k° first
            forward = [[w, pull_of[w].request_id] for w in members]
            handles.append(server.transport.send(d, protocol.reply_tag(session, pull_of[d].request_id), payload,
                                                 meta=protocol.encode(**fields, forward=forward), channel=channel))
            for w in members:
                server.transport.send(w, protocol.reply_tag(session, pull_of[w].request_id), b"",
                                      meta=protocol.encode(op="via", distributor=d), channel=channel)
            server.stats.pulls_relayed += len(members)
        by_server = [pull_of[r] for r in (*plan.direct, *ranks[:k]) if r not in relays]
        return list(plan.transfers), handles, by_server

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
        transport.send(0, protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel, meta=protocol.encode(
            op="request", id=request_id, model=model, version=int(first["version"]), norm=float(first["norm"]),
            clock=int(first["clock"]),
            sizes=[c.numel() * c.element_size() for c in components]))
        decision = self._decision(request_id)
        if decision is None:  # no answer in time: push unscheduled (the server bounds its delay)
            self.stats.fallbacks += 1
            # Withdraw the request; if it was planned already, its entry is skipped at the server.
            transport.send(0, protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel,
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
            if w.layout.role(hop) == "server":
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
            msg = transport.mailbox.take(w.channel, tag, 0)
            if msg is not None:
                return protocol.decode(msg.meta)
            if 0 in transport.lost_peers:
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


class Aggregator:
    """Sums the members of the groups the scheduler assigns to this worker's host and forwards
    each sum (per server component) once complete, or at the group's deadline with what came."""

    def __init__(self, worker: "PSWorker", settings: ScheduledSettings) -> None:
        self.worker = worker
        self.settings = settings
        self._groups: dict[tuple[int, int], _Group] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.forwarded = 0
        self.partial = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"mlfabric-ps-aggregator-{self.worker.index}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Forward what is complete (or due), then stop."""
        deadline = time.monotonic() + timeout
        while self._open() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self.worker.transport.mailbox.notify()
        if self._thread is not None:
            self._thread.join(2)

    def _open(self) -> bool:
        with self._lock:
            return any(g.planned and len(g.sent) < len(g.servers) for g in self._groups.values())

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
                else:
                    spec = w.models.get(header["model"])
                    if spec is None:
                        continue
                    _, length = spec.shards(w.layout.servers)[int(header["server"])]
                    self.add_member(header, payload_tensor(msg.payload, spec.torch_dtype, length,
                                                           "aggregated member").clone())
            self._forward_ready(time.monotonic())
            w.transport.progress(version, 0.05)

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
            total = got[0][1].clone()
            for _, t in got[1:]:
                total.add_(t)
            if len(got) < len(group.members):
                self.partial += 1
                log.warning("%s: aggregator: group %d of batch %d forwarded with %d of %d members (deadline)",
                            w.who, slot, batch, len(got), len(group.members))
            first = got[0][0]
            meta = protocol.encode(op=protocol.PUSH, model=group.model, batch=batch, slot=slot,
                                   clock=first["clock"], version=first["version"], norm=0.0,
                                   workers=[w.layout.worker_index(int(h["rank"])) for h, _ in got],
                                   versions=[int(h["version"]) for h, _ in got])
            rate = group.rates[group.servers.index(j)] if group.rates else None
            server = w.server_rank(j)
            paced = rate is not None and w.transport.pace_connection(server, w.channel, rate)
            handle = w.transport.send(server, protocol.request_tag(w.config.session), tensor_bytes(total), meta=meta,
                                      channel=w.channel)
            _wait_sent(w.transport, [handle], w.config.timeout_s)
            if paced:
                w.transport.pace_connection(server, w.channel, None)
            self.forwarded += 1
