"""A parameter server: holds shard ``j`` of every model, applies updates, answers pulls.

    python -m pytest tests/unit/test_ps.py tests/local/test_ps_processes.py

One :class:`ParameterServer` per server rank (``ps.init`` makes it from the layout). Its
:meth:`ParameterServer.serve` loop takes the workers' requests (one tag, in arrival order per
worker: :mod:`mlfabric.ps.protocol`), applies pushes under the job's consistency model
(:mod:`mlfabric.ps.consistency`), answers pulls when the consistency allows, through the
policy (:mod:`mlfabric.ps.policy`, the seam: every policy-specific step is the policy's), and returns when every worker has left or was
lost (or :meth:`stop` is called). It never waits unbounded: it sleeps at most until the next
deadline (a lost BSP worker's) or 0.1 s.

Server API (MLfabric Table 1): :meth:`register_update_callback` replaces the default rule
(eq. (1)-(2), :class:`mlfabric.ps.rules.SGDMomentum` with the lr and momentum the workers
registered); :meth:`register_request_callback` sees every pull before it is answered and may
answer with another tensor. Every applied update bumps the shard's version; every applied
update's delay (version when applied - version it was computed from) is recorded
(:class:`ServerStats`). Replicas of this server (``PSLayout.replicas_of``) get what the
policy's replication feed sends after each applied update (:mod:`mlfabric.ps.policies.replication`:
chain, or MLfabric's network replication).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mlfabric.errors import TransportError
from mlfabric.runtime.fair_share import nic_rates_from
from mlfabric.transport.base import SendHandle, Transport, tensor_bytes

from . import protocol
from .config import PSConfig
from .consistency import ClockBook
from .layout import PSLayout
from .model import ModelSpec
from .policies.ordered import OrderedPulls
from .policy import Policy, make_policy
from .protocol import payload_tensor
from .rules import SGDMomentum, UpdateInfo
from .shard import PendingPull, Round, Shard
from .waits import wait_until

log = logging.getLogger("mlfabric.ps")

_IDLE_S = 0.1
UpdateCallback = Callable[[torch.Tensor, torch.Tensor, UpdateInfo], None]
RequestCallback = Callable[[str, int, torch.Tensor], "torch.Tensor | None"]


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
    #: Workers taken back after a restart (one entry per rejoin), and the gradients applied
    #: per worker (whose updates counted, before and after a rejoin).
    rejoined_workers: list[int] = field(default_factory=list)
    updates_by_worker: Counter = field(default_factory=Counter)
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
                "departed_workers": self.departed_workers, "rejoined_workers": self.rejoined_workers,
                "updates_by_worker": {str(k): v for k, v in sorted(self.updates_by_worker.items())},
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
                 routing: Policy | None = None, channel: str | None = None) -> None:
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
        #: the emulator): ordered pulls are then paced at their fair share of it
        #: (:mod:`mlfabric.ps.policies.ordered`).
        self.nic_rate_bps: float | None = nic_rates_from(None, (self.channel,)).get(self.channel)
        if config.pace_ordered_pulls and self.nic_rate_bps is None:
            log.warning("%s: pace_ordered_pulls is set but this server's NIC rate is unknown: ordered answers "
                        "are not paced (set MLFABRIC_NIC_RATE, e.g. 1gbit; the emulator sets it)",
                        layout.describe(transport.rank))
        #: The routing policy (:mod:`mlfabric.ps.policy`): it claims what it handles itself.
        self.routing: Policy = routing or make_policy(config)
        #: Pull policies offered every ready pull before the routing policy (TicTac's ordered pulls).
        self.pull_policies: list[Policy] = [OrderedPulls(self)]
        #: What follows an applied update toward the replicas (chain, or network replication).
        self.feed = self.routing.replication_feed(config)
        self.who = f"{layout.describe(transport.rank)}"
        self.book = ClockBook(layout.workers, config.consistency, float(config.lost_worker_wait_s or 0.0))
        self.shards: dict[str, Shard] = {}
        self.stats = ServerStats(server=self.server)
        self._update_callbacks: dict[str | None, UpdateCallback] = {}
        self._request_callback: RequestCallback | None = None
        self._sending: list[tuple[SendHandle, Any]] = []
        self._seen_lost: set[int] = set()
        self._stop = threading.Event()
        #: Ranks registered with register_as_replica, in order.
        self.replicas: list[int] = []
        #: Called at every turn of the serving loop, between requests (fault injection:
        #: ``mlfabric train --fail server:AT`` crashes the process there, its model whole).
        self.on_turn: Callable[[], None] | None = None
        #: Called after every update applied (its :class:`UpdateInfo`), on the serving thread:
        #: a measurement's hook (``mlfabric.train.ps_rejoin`` times each update with it).
        self.on_apply: Callable[[UpdateInfo], None] | None = None
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

    def wake(self) -> None:
        """Wake the serving loop (a policy's thread handed it something)."""
        self.transport.mailbox.notify()

    def track(self, handle: SendHandle, source: Any) -> None:
        """Keep ``source`` (a tensor, a received buffer) alive until ``handle`` is done."""
        self._sending.append((handle, source))

    # -- the loop --------------------------------------------------------------------------------

    def serve(self) -> ServerStats:
        """Serve until every worker has left or was lost (or :meth:`stop`); returns the stats."""
        self.routing.start(self)
        try:
            return self._serve()
        finally:
            self.routing.stop(self)

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
            self.routing.step(self, now)
            self._answer_pulls(now)
            self._sending = [(h, t) for h, t in self._sending if not h.done()]
            if self.book.everyone_gone() and not self._pending_pulls():
                self.routing.finish(self)  # what arrived of what the policy holds, in order
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
            for replica in self.replicas:
                self.send_replica(replica, protocol.End().encode(), b"")
        return self.stats

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests, co-located roles)."""
        thread = threading.Thread(target=self.serve, name=f"mlfabric-ps-server-{self.server}", daemon=True)
        thread.start()
        return thread

    def _flush(self, timeout: float = 5.0) -> None:
        """Let the last replies leave before the caller closes the transport."""
        def sent() -> bool:
            self._sending = [(h, t) for h, t in self._sending if not h.done()]
            return not self._sending

        wait_until(self.transport, sent, time.monotonic() + timeout, who=self.who, what="the last replies",
                   required=False, poll=0.01)

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
            self.routing.on_lost(self, rank)
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

    def _rejoin(self, rank: int, worker: int, header: dict[str, Any]) -> None:
        """A restarted process of worker ``rank`` asks back in: the old process's loss is
        taken in first (if not yet), the transport sends to the new process from now on,
        and the worker counts again from the clock :meth:`ClockBook.rejoin` gives it, which
        the answer carries. Its pulls are answered as anyone's (the current model)."""
        readmit = getattr(self.transport, "readmit", None)
        if readmit is None:
            raise ValueError(f"this job's transport ({type(self.transport).__name__}) cannot take a restarted "
                             "process back; use the tcp transport")
        now = time.monotonic()
        self._track_membership(now)  # the old process's loss, if the transport only just saw it
        try:
            readmit(rank, header["endpoints"])
        except TransportError as exc:
            # Nothing can reach the new process: it stays lost here, and its own wait for
            # this answer runs out naming this server.
            text = f"{self.who}: could not take back restarted {self.layout.describe(rank)}: {exc}"
            log.error("%s", text)
            self.stats.errors.append(text)
            return
        if not self.routing.takes_back_workers:
            # Refused after the readmission, so that the refusal reaches the new process (it
            # raises it, naming this server); the worker stays out of the clocks.
            raise ValueError(f"a restarted worker cannot rejoin under routing {self.config.routing!r} yet "
                             "(direct and mlnet routing only; docs/elastic.md): restart the job instead")
        # An open BSP round may hold an update its old process pushed without the clock after it.
        pushed = max((t + 1 for shard in self.shards.values() for t, entry in shard.rounds.items()
                      if worker in entry.workers), default=0)
        clock = self.book.rejoin(worker, now, pushed=max(pushed, int(header.get("at_least", 0))))
        self._seen_lost.discard(rank)
        self.stats.rejoined_workers.append(worker)
        log.warning("%s: %s is back (incarnation %s); it counts again from clock %d", self.who,
                    self.layout.describe(rank), header.get("incarnation"), clock)
        self.transport.send(rank, protocol.reply_tag(self.config.session, int(header["id"])), b"",
                            meta=protocol.Rejoined(clock=clock).encode(), channel=self.channel)

    def _leave(self, worker: int) -> None:
        if worker not in self.book.departed:
            self.book.leave(worker)
            self.stats.departed_workers.append(worker)

    # -- requests --------------------------------------------------------------------------------

    def _handle(self, msg: Any) -> None:
        role = self.layout.role(msg.src)
        if role == "replica":
            header = protocol.decode(msg.meta)
            if header.get("op") == "ack":
                self.feed.on_ack(self, msg.src, header)
            else:
                self._register_replica(msg.src, header)
            return
        if role == "server":
            header = protocol.decode(msg.meta)
            if not self.routing.claim_message(self, msg.src, header, msg.payload):
                log.error("%s: ignored %r from %s", self.who, header.get("op"), self.layout.describe(msg.src))
            return
        if role != "worker":
            log.error("%s: ignored a parameter-server request from %s, which is not a worker", self.who,
                      self.layout.describe(msg.src))
            return
        worker = self.layout.worker_index(msg.src)
        header: dict[str, Any] = {}
        try:
            header = protocol.decode(msg.meta)
            op = header["op"]
            if op == protocol.PUSH:
                self.receive_push(worker, header, msg.payload)
            elif op == protocol.REJOIN:
                self._rejoin(msg.src, worker, header)
            elif self.routing.claim_message(self, msg.src, header, msg.payload):
                pass  # the policy's own request (an mlnet node re-attaching)
            elif op == protocol.CLOCK:
                clock = int(header["clock"])
                self.routing.before_clock(self, msg.src, worker, clock)
                # a tree node (mlnet) sends one clock for the workers it covers
                ticked = [int(w) for w in header.get("workers", [worker])]
                for w in ticked:
                    self.book.tick(w, clock)
                self.routing.after_clock(self, ticked, clock)
            elif op == protocol.PULL:
                self._pull(msg.src, worker, header)
            elif op == protocol.INIT:
                self._init(msg.src, header, msg.payload)
            elif op == protocol.LEAVE:
                for w in header.get("workers", [worker]):
                    self._leave(int(w))
            elif op == protocol.ADOPT:
                self.book.adopt(worker, int(header["clock"]))
            else:
                raise ValueError(f"unknown request {op!r}")
        except (ValueError, KeyError, TypeError) as exc:
            text = f"{self.who}: request from {self.layout.describe(msg.src)} refused: {exc}"
            log.error("%s", text)
            self.stats.errors.append(text)
            try:
                request_id = int(header.get("id", 0))
            except (ValueError, TypeError):
                request_id = 0
            # Requests that wait for an answer get the error as their answer; pushes and clocks
            # get it on the worker's error tag (id 0), raised by its next call.
            self.transport.send(msg.src, protocol.reply_tag(self.config.session, request_id), b"",
                                meta=protocol.ErrorReply(message=text).encode(), channel=self.channel)

    def shard(self, model: str, what: str) -> Shard:
        """This server's shard of ``model``; KeyError naming ``what`` if it was never initialised."""
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
            shard = self.shards[spec.name] = Shard(spec, offset, length, values, rule, lr=lr, momentum=momentum)
            shard.priorities = header.get("priorities")
            for replica in self.replicas:
                self._send_snapshot(replica, shard)
        self.transport.send(rank, protocol.reply_tag(self.config.session, int(header["id"])), b"",
                            meta=protocol.Ok(version=self.shards[spec.name].version).encode(),
                            channel=self.channel)

    def receive_push(self, worker: int, header: dict[str, Any], payload: memoryview) -> None:
        """A push from ``worker`` (or a tree node / aggregator sending for several): the policy
        may claim it (hold, stage, drop); otherwise it is applied under the consistency model."""
        if self.routing.claim_push(self, worker, header, payload):
            return
        shard = self.shard(header["model"], "push")
        gradient = payload_tensor(payload, shard.spec.torch_dtype, shard.length,
                                  f"push of model {shard.spec.name!r} to server {self.server}")
        consistency = self.config.consistency
        if consistency.kind == "bsp":
            # An aggregate (a tree node's, an aggregator's) names the workers whose gradients it sums.
            workers = [int(w) for w in header["workers"]] if "workers" in header else [worker]
            versions = [int(v) for v in header["versions"]] if "versions" in header else [int(header["version"])]
            clock = int(header["clock"])
            if clock < self.book.rounds_closed:
                self.stats.dropped += len(workers)  # its round went on without it (a lost worker, a late update)
                return
            self._add_to_round(shard, clock, gradient, workers, versions)
            return
        if "workers" in header:  # a tree node's sum (ssp): its workers' updates at once
            self.apply(shard, gradient, tuple(int(w) for w in header["workers"]),
                       tuple(int(v) for v in header["versions"]), weight=1.0 / self.layout.workers)
            return
        computed_from = int(header["version"])
        delay = shard.version - computed_from
        if consistency.delay_bound is not None and delay > consistency.delay_bound:
            self.stats.dropped += 1
            return
        self.apply(shard, gradient, (worker,), (computed_from,), weight=1.0 / self.layout.workers)

    def _add_to_round(self, shard: Shard, clock: int, gradient: torch.Tensor, workers: list[int],
                      versions: list[int]) -> None:
        entry = shard.rounds.get(clock)
        if entry is None:
            shard.rounds[clock] = Round(gradient.clone(), list(workers), list(versions))
        else:
            entry.total.add_(gradient)
            entry.workers += workers
            entry.versions += versions

    def _close_rounds(self, now: float) -> None:
        limit = self.routing.round_limit(self, now)
        for t in self.book.closable_rounds(now, limit):
            for shard in self.shards.values():
                entry = shard.rounds.pop(t, None)
                if entry is not None:
                    self.apply(shard, entry.total, tuple(entry.workers), tuple(entry.versions),
                               weight=1.0 / len(entry.workers))

    def apply(self, shard: Shard, gradient: torch.Tensor, workers: tuple[int, ...],
              computed_from: tuple[int, ...], *, weight: float, unit: int | None = None,
              members: list[list[int]] | None = None, norm: float | None = None) -> None:
        """Apply one update (a worker's, a round's sum, an aggregate) to ``shard`` with its rule,
        record its delays, bump the version, checkpoint when due, and hand it to the
        replication feed (``unit``, ``members``, ``norm``: network replication's unit)."""
        info = UpdateInfo(model=shard.spec.name, server=self.server, version=shard.version, workers=workers,
                          computed_from=computed_from, weight=weight)
        shard.rule(shard.values, gradient, info)
        if self.on_apply is not None:
            self.on_apply(info)
        for v in computed_from:
            self.stats.delays[shard.version - v] += 1
        # A BSP round is one update; an aggregate of m asynchronous updates counts as m (its
        # members are applied at once, in the order the scheduler planned their versions).
        before = shard.version
        shard.version += 1 if self.config.consistency.kind == "bsp" else len(workers)
        self.stats.updates_applied += 1
        self.stats.worker_updates += len(workers)
        self.stats.updates_by_worker.update(workers)
        if self.stats.first_update_at is None:
            self.stats.first_update_at = time.time()
        every = self.config.checkpoint_every
        if every and shard.version // every > before // every:
            self._checkpoint(shard)
        if self.replicas:
            self.feed.after_apply(self, shard, info.version, gradient, workers, computed_from, weight, unit,
                                  members, norm)

    def _checkpoint(self, shard: Shard) -> None:
        from .checkpoint import checkpoint_path, write_checkpoint

        started = time.perf_counter()
        self.stats.checkpoint_bytes += write_checkpoint(
            checkpoint_path(self.config.checkpoint_dir or ".", shard.spec.name, self.server), values=shard.values,
            version=shard.version, history=shard.history, offset=shard.offset, lr=shard.lr,
            momentum=shard.momentum)
        self.stats.checkpoints += 1
        self.stats.checkpoint_s += time.perf_counter() - started

    def _pull(self, rank: int, worker: int, header: dict[str, Any]) -> None:
        shard = self.shard(header["model"], "pull")
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
            waiting = self.routing.held_ranks(self, shard.spec.name)
            ready = [p for p in shard.pulls
                     if self.book.pull_ready(p.clock, p.staleness, now) and p.rank not in waiting]
            if not ready:
                continue
            shard.pulls = [p for p in shard.pulls if p not in ready]
            model_clock = self.book.model_clock(now)
            header = protocol.ModelReply(version=shard.version, model_clock=None if model_clock == float("inf")
                                         else int(model_clock))
            for p in ready:
                self.stats.pulls += 1
                if model_clock != float("inf"):
                    self.stats.clock_lag[int(p.clock - model_clock)] += 1
            for policy in self.pull_policies:  # TicTac's ordered pulls first (policies/ordered.py)
                claimed = [p for p in ready if policy.claims_pull(p)]
                if claimed:
                    ready = [p for p in ready if p not in claimed]
                    self._answer_with(policy, shard, claimed, header)
            if not ready:
                continue
            for policy in self.pull_policies:
                policy.others_answered(self, [p.rank for p in ready])
            self._answer_with(self.routing, shard, ready, header)

    def _answer_with(self, policy: Policy, shard: Shard, pulls: list[PendingPull],
                     header: protocol.ModelReply) -> None:
        """``policy`` answers ``pulls`` with the shard's snapshot (per pull what the request
        callback returns, where one is registered)."""
        if self._request_callback is None:
            snapshot = shard.snapshot()
            self._sending += [(h, snapshot) for h in policy.answer_pulls(self, pulls, snapshot, header, source=shard)]
            return
        for p in pulls:
            answer = self._request_callback(shard.spec.name, p.worker, shard.values)
            snapshot = shard.snapshot() if answer is None else answer.detach().reshape(-1).clone()
            self._sending += [(h, snapshot) for h in policy.answer_pulls(self, [p], snapshot, header, source=shard)]

    # -- replicas --------------------------------------------------------------------------------

    def _register_replica(self, src: int, header: dict[str, Any]) -> None:
        """register_as_replica: the replica gets every model as it is now (values, version and
        the rule's update history, so its next updates give the same values), then what the
        replication feed sends for every update this server applies, in order."""
        name = self.layout.describe(src)
        if header["op"] != "register" or int(header.get("server", -1)) != self.server:
            log.error("%s: ignored %r from %s (replicas only register)", self.who, header, name)
            return
        if src in self.replicas:
            log.warning("%s: %s registered twice; it stays registered once", self.who, name)
            return
        text = self.feed.refusal(self, src)
        if text is not None:
            log.error("%s", text)
            self.stats.errors.append(text)
            self.transport.send(src, protocol.tag(protocol.REPLICATE, self.config.session), b"",
                                meta=protocol.Refused(message=text).encode(), channel=self.channel)
            return
        self.replicas.append(src)
        log.info("%s: %s replicates this server", self.who, name)
        for shard in self.shards.values():
            self._send_snapshot(src, shard)

    def _send_snapshot(self, replica: int, shard: Shard) -> None:
        history = shard.history
        values = shard.values.clone() if history is None else torch.cat([shard.values, history])
        self.send_replica(replica, protocol.ReplicaInit(spec=shard.spec.to_json(), lr=shard.lr,
                                                        momentum=shard.momentum, version=shard.version,
                                                        history=history is not None, clocks=list(self.book.clocks),
                                                        priorities=shard.priorities).encode(),
                          values)

    def send_replica(self, replica: int, header: bytes, values: torch.Tensor | bytes) -> None:
        """Send ``replica`` a replication message (a note, or a tensor kept alive until sent);
        a replica that is gone is warned about once and skipped."""
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
