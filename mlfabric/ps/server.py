"""A parameter server: holds shard ``j`` of every model, applies updates, answers pulls.

    python -m pytest tests/unit/test_ps.py tests/local/test_ps_processes.py

One :class:`ParameterServer` per server rank (``ps.init`` makes it from the layout). Its
:meth:`ParameterServer.serve` loop takes the workers' requests (one tag, in arrival order per
worker: :mod:`mlfabric.ps.protocol`), applies pushes under the job's consistency model
(:mod:`mlfabric.ps.consistency`), answers pulls when the consistency allows, through the
routing policy (:mod:`mlfabric.ps.routing`), and returns when every worker has left or was
lost (or :meth:`stop` is called). It never waits unbounded: it sleeps at most until the next
deadline (a lost BSP worker's) or 0.1 s.

Server API (MLfabric Table 1): :meth:`register_update_callback` replaces the default rule
(eq. (1)-(2), :class:`mlfabric.ps.rules.SGDMomentum` with the lr and momentum the workers
registered); :meth:`register_request_callback` sees every pull before it is answered and may
answer with another tensor. Every applied update bumps the shard's version; every applied
update's delay (version when applied - version it was computed from) is recorded
(:class:`ServerStats`). Replicas of this server (``PSLayout.replicas_of``) get every applied
update forwarded (chain replication), or, under MLfabric's network replication (scheduled
policy, :mod:`mlfabric.ps.scheduling`), a small note per applied unit while the workers send
the update itself; the batch's last entry waits for its not-before time (§5.3's delay).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mlfabric.runtime.executor import tensor_bytes
from mlfabric.runtime.fair_share import nic_rates_from
from mlfabric.transport.base import SendHandle, Transport

from . import protocol
from .config import PSConfig
from .consistency import ClockBook
from .layout import PSLayout
from .model import ModelSpec
from .routing import RoutingPolicy, routing_policy
from .rules import SGDMomentum, UpdateInfo, UpdateRule

log = logging.getLogger("mlfabric.ps")

_IDLE_S = 0.1
UpdateCallback = Callable[[torch.Tensor, torch.Tensor, UpdateInfo], None]
RequestCallback = Callable[[str, int, torch.Tensor], "torch.Tensor | None"]


def payload_tensor(payload: memoryview, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
    """The received ``payload`` as a 1-D tensor of ``numel`` x ``dtype`` (no copy when the
    transport's buffer is writable); ValueError naming ``what`` if the size is wrong."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if payload.nbytes != numel * itemsize:
        raise ValueError(f"{what}: {payload.nbytes} bytes, expected {numel} x {dtype} = {numel * itemsize}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    buf = payload if not payload.readonly else memoryview(bytearray(payload))
    return torch.frombuffer(buf, dtype=dtype)


@dataclass
class PendingPull:
    rank: int
    worker: int
    request_id: int
    clock: int
    staleness: float
    arrived: float
    #: The worker asks to be answered by the server itself (its distributor was lost).
    direct: bool = False
    #: An ordered pull (``mlfabric.ps.ordered``): per tensor, in this order; None: one flat reply.
    order: str | None = None


@dataclass
class _Round:
    """BSP: the sum of one iteration's gradients for one shard, and who is in it."""

    total: torch.Tensor
    workers: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class _Entry:
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


def _entry_count(entry: list[Any]) -> int:
    """Worker updates in one entry of a batch order as the scheduler sends it: ``["u", rank,
    id, ...]`` one, ``["g", slot, count, ...]`` an aggregate's members."""
    return 1 if entry[0] == "u" else int(entry[2])


@dataclass
class _BatchOrder:
    batch: int
    entries: list[_Entry]
    next: int = 0


class _Shard:
    """This server's range of one model, its version, rule and statistics."""

    def __init__(self, spec: ModelSpec, offset: int, length: int, values: torch.Tensor, rule: UpdateRule, *,
                 lr: float, momentum: float) -> None:
        self.spec, self.offset, self.length = spec, offset, length
        self.lr, self.momentum = lr, momentum  # what the workers registered (replicas get them)
        self.values = values
        self.rule = rule
        self.version = 0
        self.rounds: dict[int, _Round] = {}
        self.pulls: list[PendingPull] = []
        #: Send order of the tensors for ordered pulls (key -> priority, lower first), if registered.
        self.priorities: dict[str, int] | None = None
        self._snapshot: tuple[int, torch.Tensor] | None = None

    def snapshot(self) -> torch.Tensor:
        """A copy of the values at the current version, shared by every pull of that version
        (the transport reads it in the background while updates go on)."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.values.clone())
        return self._snapshot[1]


@dataclass
class ServerStats:
    """What a server measured; ``delays`` has one entry per applied worker gradient."""

    server: int
    updates_applied: int = 0          # versions: one per applied (possibly combined) update
    worker_updates: int = 0           # worker gradients in them
    dropped: int = 0                  # over the delay bound (async) or late for a closed round
    delays: Counter = field(default_factory=Counter)
    pulls: int = 0
    clock_lag: Counter = field(default_factory=Counter)  # puller's clock - model clock, when asked
    bytes_in: int = 0
    bytes_out: int = 0
    lost_workers: list[int] = field(default_factory=list)
    departed_workers: list[int] = field(default_factory=list)
    missing_rounds: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: The scheduled routing policy: entries of a batch's order that had not arrived in time
    #: (skipped), and updates pushed outside any batch (a worker's fallback).
    skipped: int = 0
    unscheduled: int = 0
    replica_bytes: int = 0  # models and updates forwarded to replicas (chain replication)
    probe_bytes: int = 0    # models sent to replicas to measure their divergence (not replication)
    #: Network replication: batches whose last update waited for a replica to come within
    #: Div_max, the time spent so, and waits that ran out (slack_s) with the bound overrun.
    replica_waits: int = 0
    replica_wait_s: float = 0.0
    bound_overruns: int = 0
    checkpoints: int = 0           # PSConfig.checkpoint_every: shard files written,
    checkpoint_s: float = 0.0      # the time it took (in the serving loop: the overhead)
    checkpoint_bytes: int = 0      # and their size
    #: Model distribution (§10.3, scheduled policy): pull answers relayed by a distributor
    #: (the server sent them no model), and the batches of pulls answered together.
    pulls_relayed: int = 0
    pull_batches: int = 0
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: When this server applied its first update (wall clock, ``time.time()``): for a replica
    #: that took over, the end of the failover.
    first_update_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"server": self.server, "updates_applied": self.updates_applied,
                "worker_updates": self.worker_updates, "dropped": self.dropped,
                "delays": {str(k): v for k, v in sorted(self.delays.items())}, "pulls": self.pulls,
                "clock_lag": {str(k): v for k, v in sorted(self.clock_lag.items())},
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "lost_workers": self.lost_workers,
                "departed_workers": self.departed_workers,
                "missing_rounds": [[t, list(w)] for t, w in self.missing_rounds], "errors": self.errors,
                "skipped": self.skipped, "unscheduled": self.unscheduled, "scheduler": self.scheduler,
                "replica_bytes": self.replica_bytes, "probe_bytes": self.probe_bytes,
                "replica_waits": self.replica_waits, "replica_wait_s": self.replica_wait_s,
                "bound_overruns": self.bound_overruns,
                "pulls_relayed": self.pulls_relayed,
                "checkpoints": self.checkpoints, "checkpoint_s": self.checkpoint_s,
                "checkpoint_bytes": self.checkpoint_bytes,
                "pull_batches": self.pull_batches, "first_update_at": self.first_update_at}


class ParameterServer:
    """Server ``server`` of ``layout`` on ``transport`` (see the module docstring)."""

    def __init__(self, transport: Transport, layout: PSLayout, config: PSConfig, *, server: int | None = None,
                 routing: RoutingPolicy | None = None, channel: str | None = None) -> None:
        self.transport = transport
        self.layout = layout
        self.config = config
        self.server = transport.rank if server is None else server
        #: A replica that took over its lost server (``Replica.promote``) serves that shard.
        self.promoted = layout.role(transport.rank) == "replica"
        if self.promoted:
            if layout.replicated_server(transport.rank) != self.server:
                raise ValueError(f"{layout.describe(transport.rank)} replicates server "
                                 f"{layout.replicated_server(transport.rank)}, not {self.server}")
        elif layout.role(transport.rank) != "server" or self.server != transport.rank:
            raise ValueError(f"{layout.describe(transport.rank)} cannot serve shard {self.server}: server j is rank j")
        self.channel = channel or transport.channels[0]
        #: The line rate (bit/s) of this server's NIC when known (``MLFABRIC_NIC_RATE``, set by
        #: the emulator): ordered pulls are then paced at their fair share of it (ps/ordered.py).
        self.nic_rate_bps: float | None = nic_rates_from(None, (self.channel,)).get(self.channel)
        self.paced_for_pulls: set[int] = set()  # ranks whose connection an ordered answer capped
        self.ordered_in_flight: dict[int, SendHandle] = {}  # rank -> last piece of its latest ordered answer
        if config.pace_ordered_pulls and self.nic_rate_bps is None:
            log.warning("%s: pace_ordered_pulls is set but this server's NIC rate is unknown: ordered answers "
                        "are not paced (set MLFABRIC_NIC_RATE, e.g. 1gbit; the emulator sets it)",
                        layout.describe(transport.rank))
        self.routing = routing or routing_policy(config.routing, config.routing_settings())
        self.who = f"{layout.describe(transport.rank)}"
        self.book = ClockBook(layout.workers, config.consistency, float(config.lost_worker_wait_s or 0.0))
        self.shards: dict[str, _Shard] = {}
        self.stats = ServerStats(server=self.server)
        self._update_callbacks: dict[str | None, UpdateCallback] = {}
        self._request_callback: RequestCallback | None = None
        self._sending: list[tuple[SendHandle, torch.Tensor]] = []
        self._seen_lost: set[int] = set()
        self._stop = threading.Event()
        self._replicas: list[int] = []  # ranks registered with register_as_replica, in order
        # Network replication: per replica and model, the version it has applied and its history
        # norm there (its acks); per model, (version, versions spanned, norm bound) of what this
        # server applied since -- the lead eq. (11) is computed on.
        self._replica_at: dict[int, dict[str, tuple[int, float]]] = {}
        self._lead: dict[str, list[tuple[int, int, float]]] = {}
        self._held_since: float | None = None  # when the batch's last entry began waiting for replicas
        # The scheduled routing policy: batch orders from the scheduler (per model, in batch
        # order), the scheduled updates that arrived, and the scheduler itself on server 0.
        self._orders: dict[str, list[_BatchOrder]] = {}
        self._incoming_orders: list[tuple[dict[str, Any], float]] = []
        self._order_lock = threading.Lock()
        # MLfabric-A: per model, the worker updates in orders not yet applied or skipped (what
        # the scheduler adds to the version to plan the next batch's delays: planned_ahead)
        self._planned_ahead: Counter = Counter()
        self._arrived: dict[tuple[str, int, tuple[Any, ...]], tuple[torch.Tensor, dict[str, Any]]] = {}
        self._finished_batch: dict[str, int] = {}  # per model, the last batch fully applied
        # MLfabric-S: per (model, round) the workers whose routed update is not in yet, with
        # the time after which the round goes on without it.
        self._expected: dict[tuple[str, int], dict[int, float]] = {}
        self._routed_in: dict[tuple[str, int], set[int]] = {}  # (model, round) -> ranks whose update is in
        self.scheduler_service: Any = None
        #: mlnet: tree sums per (node rank, clock) waiting for that node's clock message.
        self._staged: dict[tuple[int, int], list[tuple[dict[str, Any], memoryview]]] = {}
        #: Called at every turn of the serving loop, between requests (fault injection:
        #: ``mlfabric train --fail server:AT`` crashes the process there, its model whole).
        self.on_turn: Callable[[], None] | None = None
        transport.on_peer_lost(lambda peer, reason: transport.mailbox.notify())

    # -- API (MLfabric Table 1) ----------------------------------------------------------------

    def register_update_callback(self, callback: UpdateCallback, model: str | None = None) -> None:
        """``callback(shard, gradient, info)`` applies updates of ``model`` (every model: None)
        instead of eq. (1)-(2); it must change ``shard`` in place."""
        self._update_callbacks[model] = callback
        if model in self.shards:
            self.shards[model].rule = callback

    def register_request_callback(self, callback: RequestCallback) -> None:
        """``callback(model, worker, shard)`` runs before a pull is answered; a tensor it returns
        (same shape and dtype) is sent instead of the shard."""
        self._request_callback = callback

    def stop(self) -> None:
        self._stop.set()
        self.transport.mailbox.notify()

    # -- the loop --------------------------------------------------------------------------------

    def serve(self) -> ServerStats:
        """Serve until every worker has left or was lost (or :meth:`stop`); returns the stats."""
        if self.config.routing == "scheduled" and self.server == 0:
            from .scheduling import SchedulerService

            self.scheduler_service = SchedulerService(self, self.config.scheduled_settings())
            self.scheduler_service.start()
        try:
            return self._serve()
        finally:
            if self.scheduler_service is not None:
                self.scheduler_service.stop()
                self.stats.scheduler = self.scheduler_service.stats.as_dict()

    def _serve(self) -> ServerStats:
        mailbox = self.transport.mailbox
        tag = protocol.request_tag(self.config.session)
        before = self.transport.counters()  # the transport may have carried earlier sessions
        while not self._stop.is_set():
            version = mailbox.version
            if self.on_turn is not None:
                self.on_turn()
            while (msg := mailbox.take(self.channel, tag)) is not None:
                self._handle(msg)
            now = time.monotonic()
            self._track_membership(now)
            self._close_rounds(now)
            self._apply_batches(now)
            self._answer_pulls(now)
            self._sending = [(h, t) for h, t in self._sending if not h.done()]
            if self.book.everyone_gone() and not self._pending_pulls():
                self._apply_batches(float("inf"))  # what arrived of the last batches, in order
                break
            deadline = self.book.next_deadline(now)
            wait = _IDLE_S if deadline is None else min(_IDLE_S, max(0.0, deadline - now))
            held = self.routing.answer_at() if self._pending_pulls() else None
            if held is not None and held > now:  # pulls held for a batch: wake when it may go
                wait = min(wait, held - now)
            self.transport.progress(version, wait)
        self._flush()
        after = self.transport.counters()
        self.stats.bytes_in = sum(c.bytes_recv for c in after.values()) - sum(c.bytes_recv for c in before.values())
        self.stats.bytes_out = sum(c.bytes_sent for c in after.values()) - sum(c.bytes_sent for c in before.values())
        self.stats.missing_rounds = list(self.book.missing)
        if not self._stop.is_set():  # stopped: this server is going away without a word
            for replica in self._replicas:
                self._send_replica(replica, protocol.encode(op="end"), b"")
        return self.stats

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests, co-located roles)."""
        thread = threading.Thread(target=self.serve, name=f"mlfabric-ps-server-{self.server}", daemon=True)
        thread.start()
        return thread

    def _flush(self, timeout: float = 5.0) -> None:
        """Let the last replies leave before the caller closes the transport."""
        deadline = time.monotonic() + timeout
        while self._sending and time.monotonic() < deadline:
            self._sending = [(h, t) for h, t in self._sending if not h.done()]
            if self._sending:
                self.transport.progress(self.transport.mailbox.version, 0.01)

    def _pending_pulls(self) -> bool:
        return any(shard.pulls for shard in self.shards.values())

    # -- membership ------------------------------------------------------------------------------

    def _track_membership(self, now: float) -> None:
        for rank in list(self.transport.lost_peers):
            if rank in self._seen_lost or self.layout.role(rank) != "worker":
                continue
            self._seen_lost.add(rank)
            worker = self.layout.worker_index(rank)
            self.book.lose(worker, now)
            dropped = [key for key in self._staged if key[0] == rank]
            for key in dropped:  # sums whose clock never came: its subtree sends them again
                del self._staged[key]
            self.stats.lost_workers.append(worker)
            for shard in self.shards.values():
                shard.pulls = [p for p in shard.pulls if p.rank != rank]
            wait = (f"BSP rounds go on without it after {self.config.lost_worker_wait_s:g} s"
                    if self.config.consistency.kind == "bsp" else "going on without it")
            log.warning("%s: lost %s (%s); %s", self.who, self.layout.describe(rank),
                        self.transport.lost_peers[rank], wait)
        for rank in list(self.transport.departed_peers):
            # A transport closed without our leave message (the process ended cleanly).
            if self.layout.role(rank) == "worker" and self.layout.worker_index(rank) not in self.book.departed:
                self._leave(self.layout.worker_index(rank))

    def _leave(self, worker: int) -> None:
        if worker not in self.book.departed:
            self.book.leave(worker)
            self.stats.departed_workers.append(worker)

    # -- requests --------------------------------------------------------------------------------

    def _handle(self, msg: Any) -> None:
        if self.layout.role(msg.src) == "replica":
            header = protocol.decode(msg.meta)
            if header.get("op") == "ack":
                self._replica_at.setdefault(msg.src, {})[header["model"]] = (int(header["version"]),
                                                                             float(header["history_norm"]))
            else:
                self._register_replica(msg)
            return
        if self.layout.role(msg.src) == "server":
            header = protocol.decode(msg.meta)
            if header.get("op") == protocol.ORDER:
                self.add_order(header, time.monotonic())
            else:
                log.error("%s: ignored %r from %s", self.who, header.get("op"), self.layout.describe(msg.src))
            return
        if self.layout.role(msg.src) != "worker":
            log.error("%s: ignored a parameter-server request from %s, which is not a worker", self.who,
                      self.layout.describe(msg.src))
            return
        worker = self.layout.worker_index(msg.src)
        try:
            header = protocol.decode(msg.meta)
            op = header["op"]
            if op == protocol.PUSH:
                self._push(worker, header, msg.payload)
            elif op == protocol.CLOCK:
                # An mlnet tree node (ps/mlnet.py) sends one clock for the workers it covers,
                # after the sums of that clock, which count from then on (a node that dies
                # between the two leaves nothing half-applied: its subtree sends them again).
                for staged_header, staged in self._staged.pop((msg.src, int(header["clock"])), []):
                    self._push(worker, {**staged_header, "committed": True}, staged)
                ticked = [int(w) for w in header.get("workers", [worker])]
                for w in ticked:
                    self.book.tick(w, int(header["clock"]))
                if self.config.routing == "mlnet":
                    # the replicas learn the clocks behind the updates they hold: one that takes
                    # over tells re-attaching tree nodes which clocks to send again
                    for replica in self._replicas:
                        self._send_replica(replica, protocol.encode(op="clock", workers=ticked,
                                                                    clock=int(header["clock"])), b"")
            elif op == protocol.PULL:
                self._pull(msg.src, worker, header)
            elif op == protocol.INIT:
                self._init(msg.src, header, msg.payload)
            elif op == protocol.LEAVE:
                for w in header.get("workers", [worker]):
                    self._leave(int(w))
            elif op == protocol.ADOPT:
                self.book.adopt(worker, int(header["clock"]))
            elif op == protocol.ATTACH:
                # an mlnet node re-attaching here after a repair or fall back: the last clock
                # this server has of its subtree (it sends the later ones again)
                workers = [int(w) for w in header["workers"]]
                alive = [w for w in workers if w not in self.book.departed and w not in self.book.lost_at] or workers
                through = min(self.book.clocks[w] for w in alive) - 1
                self.transport.send(msg.src, protocol.reply_tag(self.config.session, int(header["id"])), b"",
                                    meta=protocol.encode(op="attached", through=through), channel=self.channel)
            else:
                raise ValueError(f"unknown request {op!r}")
        except (ValueError, KeyError, TypeError) as exc:
            text = f"{self.who}: request from {self.layout.describe(msg.src)} refused: {exc}"
            log.error("%s", text)
            self.stats.errors.append(text)
            request_id = 0
            try:
                request_id = int(protocol.decode(msg.meta).get("id", 0))
            except ValueError:
                pass
            # Requests that wait for an answer get the error as their answer; pushes and clocks
            # get it on the worker's error tag (id 0), raised by its next call.
            self.transport.send(msg.src, protocol.reply_tag(self.config.session, request_id), b"",
                                meta=protocol.encode(op="error", message=text), channel=self.channel)

    def _shard(self, model: str, what: str) -> _Shard:
        shard = self.shards.get(model)
        if shard is None:
            known = ", ".join(map(repr, self.shards)) or "none yet"
            raise KeyError(f"{what} of model {model!r}, which was never initialised here (models: {known}); "
                           "call init_model on the workers first")
        return shard

    def _init(self, rank: int, header: dict[str, Any], payload: memoryview) -> None:
        spec = ModelSpec.from_json(header["spec"])
        offset, length = spec.shards(self.layout.servers)[self.server]
        existing = self.shards.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise ValueError(f"init_model({spec.name!r}) with a layout that differs from the one registered "
                                 f"first ({existing.spec.to_json()} vs {spec.to_json()})")
            if header.get("priorities") != existing.priorities:
                raise ValueError(f"init_model({spec.name!r}) with other transfer priorities than the ones registered "
                                 "first: every worker must register the same (or none)")
        else:
            values = payload_tensor(payload, spec.torch_dtype, length, f"init of {spec.name!r}").clone()
            lr, momentum = float(header["lr"]), float(header.get("momentum", 0.0))
            rule = self._update_callbacks.get(spec.name) or self._update_callbacks.get(None)
            if rule is None:
                rule = SGDMomentum(lr, momentum)
            shard = self.shards[spec.name] = _Shard(spec, offset, length, values, rule, lr=lr, momentum=momentum)
            shard.priorities = header.get("priorities")
            for replica in self._replicas:
                self._send_snapshot(replica, shard)
        self.transport.send(rank, protocol.reply_tag(self.config.session, int(header["id"])), b"",
                            meta=protocol.encode(op="ok", version=self.shards[spec.name].version),
                            channel=self.channel)

    def _push(self, worker: int, header: dict[str, Any], payload: memoryview) -> None:
        if "workers" in header and self.config.routing == "mlnet" and not header.get("committed"):
            # an mlnet node's sum: counted once the node's clock for it arrives (see CLOCK)
            rank = self.layout.worker_rank(worker)
            self._staged.setdefault((rank, int(header["clock"])), []).append((header, memoryview(bytes(payload))))
            return
        shard = self._shard(header["model"], "push")
        gradient = payload_tensor(payload, shard.spec.torch_dtype, shard.length,
                                  f"push of model {shard.spec.name!r} to server {self.server}")
        consistency = self.config.consistency
        if "batch" in header and consistency.kind != "bsp":  # MLfabric-A: applied in the batch's order
            key = ("g", int(header["slot"])) if "slot" in header else ("u", int(header["rank"]), int(header["id"]))
            self._arrived[(shard.spec.name, int(header["batch"]), key)] = (gradient.clone(), header)
            return
        if self.config.routing == "scheduled" and "batch" not in header:
            self.stats.unscheduled += 1
        if consistency.kind == "bsp":
            if "batch" in header:  # MLfabric-S: the round waits for what the scheduler routed
                self._expected_arrived(header)
            # An aggregate (MLfabric-S) names the workers whose gradients it sums.
            workers = [int(w) for w in header["workers"]] if "workers" in header else [worker]
            versions = [int(v) for v in header["versions"]] if "versions" in header else [int(header["version"])]
            clock = int(header["clock"])
            if clock < self.book.rounds_closed:
                self.stats.dropped += len(workers)  # its round went on without it (a lost worker, a late update)
                return
            self._add_to_round(shard, clock, gradient, workers, versions)
            return
        if "workers" in header:  # an mlnet tree node's sum (ssp): its workers' updates at once
            self._apply(shard, gradient, tuple(int(w) for w in header["workers"]),
                        tuple(int(v) for v in header["versions"]), weight=1.0 / self.layout.workers)
            return
        computed_from = int(header["version"])
        delay = shard.version - computed_from
        if consistency.delay_bound is not None and delay > consistency.delay_bound:
            self.stats.dropped += 1
            return
        self._apply(shard, gradient, (worker,), (computed_from,), weight=1.0 / self.layout.workers)

    def add_order(self, order: dict[str, Any], received: float) -> None:
        """The scheduler's application order of one batch (thread-safe: server 0's scheduler
        runs beside this loop)."""
        with self._order_lock:
            self._incoming_orders.append((order, received))
            if not order.get("sync"):
                self._planned_ahead[order["model"]] += sum(_entry_count(e) for e in order["entries"])
        self.transport.mailbox.notify()

    def planned_ahead(self, model: str) -> int:
        """Worker updates of ``model`` in batch orders this server has not applied or skipped
        yet (MLfabric-A). The next batch's versions start at ``version + planned_ahead``: an
        update that is skipped, dropped here, or missing from its aggregate leaves the count
        without moving the version, so the versions planned next are the ones that will be
        applied (counting it once planned would have shortened every later deadline)."""
        with self._order_lock:
            return self._planned_ahead[model]

    def _apply_batches(self, now: float) -> None:
        """Apply scheduled updates in their batch's order, batches one after the other; an
        entry still missing ``slack`` after its planned commit is skipped."""
        with self._order_lock:  # MLfabric-A's orders; MLfabric-S's are _round_limit's
            incoming = [(o, t) for o, t in self._incoming_orders if not o.get("sync")]
            self._incoming_orders = [(o, t) for o, t in self._incoming_orders if o.get("sync")]
        for order, received in incoming:
            entries = [_Entry(kind=e[0], key=tuple(e[1:3]) if e[0] == "u" else (int(e[1]),),
                              count=_entry_count(e), deadline=received + float(e[3]),
                              ranks=frozenset(int(r) for r in e[4]),
                              unit=int(e[5]) if len(e) > 5 else None, norm=float(e[6]) if len(e) > 6 else None,
                              not_before=received + float(e[7]) if len(e) > 7 and e[7] is not None else 0.0)
                       for e in order["entries"]]
            self._orders.setdefault(order["model"], []).append(
                _BatchOrder(batch=int(order["batch"]), entries=entries))
        for model, orders in self._orders.items():
            shard = self.shards.get(model)
            while orders and shard is not None:
                order = orders[0]
                while order.next < len(order.entries):
                    entry = order.entries[order.next]
                    key = (model, order.batch, (entry.kind, *entry.key))
                    if now < entry.not_before:
                        break  # §5.3: the replica catches up before the batch's last update
                    if order.next == len(order.entries) - 1 and self._replicas_too_far(shard, entry, now):
                        break
                    arrived = self._arrived.pop(key, None)
                    if arrived is None:
                        if now < entry.deadline:
                            break
                        self.stats.skipped += entry.count
                        log.warning("%s: batch %d of %r: %s %s did not arrive in time; skipped", self.who,
                                    order.batch, model, "update" if entry.kind == "u" else "group", entry.key)
                    else:
                        self._apply_scheduled(shard, *arrived, entry=entry)
                    order.next += 1
                    with self._order_lock:  # after the version moved: a planner never counts too few
                        self._planned_ahead[model] -= entry.count
                if order.next < len(order.entries):
                    break
                orders.pop(0)
                self._finished_batch[model] = max(self._finished_batch.get(model, 0), order.batch)
                self._probe_replicas(shard, order.batch)
        # Scheduled updates whose batch is over (their entry was skipped) are late: drop them,
        # counted once, as skipped. A batch this server has no order for yet is not over: its
        # order may still be on the way (it travels from the scheduler on another connection
        # than the update).
        live = {(m, o.batch) for m, orders in self._orders.items() for o in orders}
        for key in [k for k in self._arrived
                    if (k[0], k[1]) not in live and k[1] <= self._finished_batch.get(k[0], 0)]:
            self._arrived.pop(key)

    def _scheduled_ranks(self, model: str) -> set[int]:
        """Workers with an update in a batch entry not applied (or skipped) yet."""
        with self._order_lock:
            incoming = [o for o, _ in self._incoming_orders if o["model"] == model and not o.get("sync")]
        ranks = {int(r) for o in incoming for e in o["entries"] for r in e[4]}
        for order in self._orders.get(model, []):
            for entry in order.entries[order.next:]:
                ranks |= entry.ranks
        return ranks

    def _apply_scheduled(self, shard: _Shard, gradient: torch.Tensor, header: dict[str, Any],
                         entry: _Entry | None = None) -> None:
        workers = tuple(header["workers"]) if "workers" in header else (self.layout.worker_index(int(header["rank"])),)
        versions = tuple(int(v) for v in header["versions"]) if "versions" in header else (int(header["version"]),)
        bound = self.config.consistency.delay_bound
        if bound is not None and shard.version - min(versions) > bound:
            self.stats.dropped += len(workers)  # unscheduled updates moved the version past the plan
            return
        # a group forwarded at its deadline with some members missing is not the unit the
        # replica gets from the network: that one goes the chain way
        complete = entry is not None and len(workers) == entry.count
        self._apply(shard, gradient, workers, versions, weight=1.0 / self.layout.workers,
                    unit=entry.unit if entry is not None and complete else None,
                    members=header.get("members") or [[int(header["rank"]), int(header["id"])]],
                    norm=entry.norm if entry is not None else None)

    def _add_to_round(self, shard: _Shard, clock: int, gradient: torch.Tensor, workers: list[int],
                      versions: list[int]) -> None:
        entry = shard.rounds.get(clock)
        if entry is None:
            shard.rounds[clock] = _Round(gradient.clone(), list(workers), list(versions))
        else:
            entry.total.add_(gradient)
            entry.workers += workers
            entry.versions += versions

    def _expected_arrived(self, header: dict[str, Any]) -> None:
        """MLfabric-S: these workers' updates of the round are in (directly or summed)."""
        ranks = ([self.layout.worker_rank(int(w)) for w in header["workers"]] if "workers" in header
                 else [int(header["rank"])])
        key = (header["model"], int(header["clock"]))
        # The round's order may come after its updates (another connection): remember them.
        self._routed_in.setdefault(key, set()).update(ranks)
        pending = self._expected.get(key)
        if pending is not None:
            for rank in ranks:
                pending.pop(rank, None)

    def _round_limit(self, now: float) -> int | None:
        """MLfabric-S: the first round with a routed update not in yet (and not overdue)."""
        with self._order_lock:
            incoming = [o for o, _ in self._incoming_orders if o.get("sync")]
            self._incoming_orders = [(o, t) for o, t in self._incoming_orders if not o.get("sync")]
            received = time.monotonic()
        for order in incoming:
            # A round's requests are planned together: the order names the round (its clock).
            for clock in order["clocks"]:
                key = (order["model"], int(clock))
                pending = self._expected.setdefault(key, {})
                arrived = self._routed_in.get(key, set())
                for entry in order["entries"]:
                    for rank in entry[4]:
                        if int(rank) not in arrived:
                            pending[int(rank)] = received + float(entry[3])
        for key in list(self._expected):
            pending = self._expected[key]
            for rank, deadline in list(pending.items()):
                if now >= deadline:
                    self.stats.skipped += 1
                    log.warning("%s: round %d of %r: the update of %s did not arrive in time; the round goes "
                                "on without it", self.who, key[1], key[0], self.layout.describe(rank))
                    pending.pop(rank)
            if not pending:
                del self._expected[key]
        for key in [k for k in self._routed_in if k[1] < self.book.rounds_closed]:
            del self._routed_in[key]
        return min((clock for _, clock in self._expected), default=None)

    def _close_rounds(self, now: float) -> None:
        limit = self._round_limit(now) if self.config.routing == "scheduled" else None
        for t in self.book.closable_rounds(now, limit):
            for shard in self.shards.values():
                entry = shard.rounds.pop(t, None)
                if entry is not None:
                    self._apply(shard, entry.total, tuple(entry.workers), tuple(entry.versions),
                                weight=1.0 / len(entry.workers))

    def _apply(self, shard: _Shard, gradient: torch.Tensor, workers: tuple[int, ...],
               computed_from: tuple[int, ...], *, weight: float, unit: int | None = None,
               members: list[list[int]] | None = None,
               norm: float | None = None) -> None:
        info = UpdateInfo(model=shard.spec.name, server=self.server, version=shard.version, workers=workers,
                          computed_from=computed_from, weight=weight)
        shard.rule(shard.values, gradient, info)
        for v in computed_from:
            self.stats.delays[shard.version - v] += 1
        # A BSP round is one update; an aggregate of m asynchronous updates counts as m (its
        # members are applied at once, in the order the scheduler planned their versions).
        before = shard.version
        shard.version += 1 if self.config.consistency.kind == "bsp" else len(workers)
        self.stats.updates_applied += 1
        self.stats.worker_updates += len(workers)
        if self.stats.first_update_at is None:
            self.stats.first_update_at = time.time()
        every = self.config.checkpoint_every
        if every and shard.version // every > before // every:
            self._checkpoint(shard)
        if not self._replicas:
            return
        if norm is None:  # eq. (1): ||u|| = lr weight ||g|| (the replica's divergence estimate uses it)
            norm = abs(shard.lr * weight) * float(torch.linalg.vector_norm(gradient.double()))
        if self._network_replication:
            lead = self._lead.setdefault(shard.spec.name, [])
            lead.append((info.version, shard.version - info.version, norm))
            gone = self.transport.gone_peers
            # what every live replica has applied is never needed again (none live: nothing is)
            acked = min((self._replica_at.get(r, {}).get(shard.spec.name, (0, 0.0))[0] for r in self._replicas
                         if r not in gone), default=shard.version)
            while lead and lead[0][0] < acked:
                lead.pop(0)
        fields = dict(model=shard.spec.name, version=info.version, workers=list(workers),
                      computed_from=list(computed_from), weight=weight, norm=norm, t=time.monotonic())
        for replica in self._replicas:
            if unit is not None and self._network_replication:
                # MLfabric §5.3: the update itself reaches the replica from the workers (the
                # scheduler planned it); the server only says where it stands in its order
                # (with the unit's members, (rank, update id): a replica that takes over asks
                # them for the copies of units the network had not delivered yet)
                self._send_replica(replica, protocol.encode(op="applied", unit=unit, members=members, **fields), b"")
            else:  # chain replication (and, under network replication, what the network did not carry)
                self._send_replica(replica, protocol.encode(op="update", **fields), gradient.clone())

    def _replicas_too_far(self, shard: _Shard, entry: _Entry, now: float) -> bool:
        """§5.3 step 3 with the replicas' own word: the batch's last entry waits while applying
        it would leave a live replica further than Div_max behind (eq. (11) on the acked version
        and history norm, and the norms of what this server applied since, this entry included),
        at most ``slack_s``; then it goes on, counted and warned (``bound_overruns``)."""
        settings = self.config.scheduled_settings()
        bound = settings.divergence
        if not self._network_replication or bound is None or entry.norm is None:
            return False
        name = shard.spec.name
        lead = self._lead.get(name, [])
        gone = self.transport.gone_peers
        far = []
        for replica in self._replicas:
            if replica in gone:
                continue
            version, history_norm = self._replica_at.get(replica, {}).get(name, (0, 0.0))
            behind = [n for v, _, n in lead if v >= version]
            # waiting helps only while the replica has not got everything before this entry
            # (one update over Div_max alone is the scheduler's 'violated', warned there)
            if behind and not bound.allows(history_norm, behind + [entry.norm], shard.momentum):
                far.append(replica)
        if not far:
            if self._held_since is not None:
                self.stats.replica_wait_s += now - self._held_since
                self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = now
            self.stats.replica_waits += 1
        if now - self._held_since < settings.slack_s:
            return True
        self.stats.bound_overruns += 1
        self.stats.replica_wait_s += now - self._held_since
        self._held_since = None
        log.warning("%s: %s still beyond Div_max %s after %.1f s; the batch's last update goes on (the bound is "
                    "overrun: the replica's network path is slower than planned)", self.who,
                    ", ".join(self.layout.describe(r) for r in far), bound, settings.slack_s)
        return False

    @property
    def _network_replication(self) -> bool:
        return self.config.routing == "scheduled" and self.config.scheduled_settings().replication == "network"

    def _probe_replicas(self, shard: _Shard, batch: int) -> None:
        """At a batch's end, with ``measure_divergence``: the replicas get this server's model
        (and its time and version) to measure how far theirs is (:class:`mlfabric.ps.replica.Replica`)."""
        if not self._replicas or not self.config.scheduled_settings().measure_divergence:
            return
        for replica in self._replicas:
            if self.transport.is_gone(replica):
                continue
            values = shard.values.clone()
            handle = self.transport.send(replica, protocol.tag(protocol.REPLICATE, self.config.session),
                                         tensor_bytes(values), channel=self.channel, meta=protocol.encode(
                                             op="probe", model=shard.spec.name, batch=batch, version=shard.version,
                                             t=time.monotonic()))
            self._sending.append((handle, values))
            self.stats.probe_bytes += values.numel() * values.element_size()

    def _checkpoint(self, shard: _Shard) -> None:
        from .checkpoint import checkpoint_path, write_checkpoint

        started = time.perf_counter()
        self.stats.checkpoint_bytes += write_checkpoint(
            checkpoint_path(self.config.checkpoint_dir or ".", shard.spec.name, self.server), values=shard.values,
            version=shard.version, history=getattr(shard.rule, "history", None), offset=shard.offset, lr=shard.lr,
            momentum=shard.momentum)
        self.stats.checkpoints += 1
        self.stats.checkpoint_s += time.perf_counter() - started

    def _pull(self, rank: int, worker: int, header: dict[str, Any]) -> None:
        shard = self._shard(header["model"], "pull")
        staleness = header.get("staleness")
        shard.pulls.append(PendingPull(rank=rank, worker=worker, request_id=int(header["id"]),
                                       clock=int(header["clock"]),
                                       staleness=self.config.consistency.pull_staleness if staleness is None
                                       else float(staleness), arrived=time.monotonic(),
                                       direct=bool(header.get("direct", False)), order=header.get("order")))

    def _answer_pulls(self, now: float) -> None:
        if not self.routing.ready_to_answer(self):
            return  # the policy answers pulls in batches: the ready ones wait for the next one
        for shard in self.shards.values():
            if not shard.pulls:
                continue
            waiting = self._scheduled_ranks(shard.spec.name)
            ready = [p for p in shard.pulls
                     if self.book.pull_ready(p.clock, p.staleness, now) and p.rank not in waiting]
            if not ready:
                continue
            shard.pulls = [p for p in shard.pulls if p not in ready]
            model_clock = self.book.model_clock(now)
            header = protocol.encode(op="model", version=shard.version,
                                     model_clock=None if model_clock == float("inf") else int(model_clock))
            for p in ready:
                self.stats.pulls += 1
                if model_clock != float("inf"):
                    self.stats.clock_lag[int(p.clock - model_clock)] += 1
            ordered = [p for p in ready if p.order is not None]
            if ordered:  # TicTac §5.1: per tensor, in the pull's order (ps/ordered.py)
                ready = [p for p in ready if p.order is None]
                self._answer_in_order(shard, ordered, model_clock)
                if not ready:
                    continue
            if self.paced_for_pulls:
                from .ordered import lift_pacing

                lift_pacing(self, [p.rank for p in ready])
            if self._request_callback is not None:
                for p in ready:
                    answer = self._request_callback(shard.spec.name, p.worker, shard.values)
                    snapshot = shard.snapshot() if answer is None else answer.detach().reshape(-1).clone()
                    self._sending += [(h, snapshot) for h in self.routing.answer_pulls(self, [p], snapshot, header)]
                continue
            snapshot = shard.snapshot()
            self._sending += [(h, snapshot) for h in self.routing.answer_pulls(self, ready, snapshot, header)]

    def _answer_in_order(self, shard: _Shard, pulls: list[PendingPull], model_clock: float) -> None:
        from .ordered import answer_in_order

        clock = None if model_clock == float("inf") else int(model_clock)
        values = []
        for p in pulls:
            answer = None if self._request_callback is None else self._request_callback(shard.spec.name, p.worker,
                                                                                        shard.values)
            values.append(shard.snapshot() if answer is None else answer.detach().reshape(-1).clone())
        self._sending += answer_in_order(self, pulls, shard.spec, shard.offset, values, shard.priorities,
                                         shard.version, clock)

    def _register_replica(self, msg: Any) -> None:
        """register_as_replica: the replica gets every model as it is now (values, version and
        the rule's update history, so its next updates give the same values), then every
        update this server applies, in order."""
        header = protocol.decode(msg.meta)
        name = self.layout.describe(msg.src)
        if header["op"] != "register" or int(header.get("server", -1)) != self.server:
            log.error("%s: ignored %r from %s (replicas only register)", self.who, header, name)
            return
        if msg.src in self._replicas:
            log.warning("%s: %s registered twice; it stays registered once", self.who, name)
            return
        if self._network_replication and self.layout.replicated_server(msg.src) != self.server:
            # the scheduler plans units for the replicas of the layout (PSLayout.replicas_of):
            # one that claims another server's slot would never get its updates
            text = (f"{self.who}: {name} asked to replicate server {self.server}, but under network replication "
                    f"it is server {self.layout.replicated_server(msg.src)}'s replica (replica i mirrors server "
                    f"i % {self.layout.servers}); register without a server, or use replication 'chain'")
            log.error("%s", text)
            self.stats.errors.append(text)
            self.transport.send(msg.src, protocol.tag(protocol.REPLICATE, self.config.session), b"",
                                meta=protocol.encode(op="refused", message=text), channel=self.channel)
            return
        self._replicas.append(msg.src)
        log.info("%s: %s replicates this server", self.who, name)
        for shard in self.shards.values():
            self._send_snapshot(msg.src, shard)

    def _send_snapshot(self, replica: int, shard: _Shard) -> None:
        history = getattr(shard.rule, "history", None)
        values = shard.values.clone() if history is None else torch.cat([shard.values, history])
        self._send_replica(replica, protocol.encode(op="init", spec=shard.spec.to_json(), lr=shard.lr,
                                                    momentum=shard.momentum, version=shard.version,
                                                    history=history is not None, clocks=list(self.book.clocks),
                                                    priorities=shard.priorities),
                           values)

    def _send_replica(self, replica: int, header: bytes, values: torch.Tensor | bytes) -> None:
        if self.transport.is_gone(replica):
            if replica not in self._seen_lost:
                self._seen_lost.add(replica)
                log.warning("%s: %s is gone (%s); this server goes on without it -- the job has no standby for "
                            "server %d now", self.who, self.layout.describe(replica),
                            self.transport.lost_peers.get(replica, "departed"), self.server)
            return
        payload = values if isinstance(values, bytes) else tensor_bytes(values)
        self.stats.replica_bytes += len(payload) if isinstance(payload, bytes) else payload.nbytes
        handle = self.transport.send(replica, protocol.tag(protocol.REPLICATE, self.config.session), payload,
                                     meta=header, channel=self.channel)
        if isinstance(values, torch.Tensor):
            self._sending.append((handle, values))
