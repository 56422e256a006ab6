"""The ``scheduled`` policy on a server: batch orders applied in order, pulls answered through distributors.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py -q

* **Orders** (MLfabric-A): the scheduler's application order of each batch; a push that
  belongs to a batch is held until its entry's turn (:meth:`ScheduledServerSide.claim_push`),
  applied in the batch's order through the server's port, or skipped once ``slack_s`` past
  its planned commit. MLfabric-S: a round closes only when the updates the scheduler routed
  for it are in (:meth:`ScheduledServerSide.round_limit`). A worker's pull waits while an
  entry holding its update is still due (:meth:`ScheduledServerSide.held_ranks`).
* **Model distribution** (§10.3): pulls answered in batches, part of them relayed by
  distributors (:meth:`ScheduledServerSide.answer_pulls`).
* Server 0 runs the scheduler (:mod:`~mlfabric.ps.policies.scheduled.service`) beside its loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.transport.base import SendHandle, tensor_bytes

from ... import protocol
from ...policy import answer_directly
from ...protocol import payload_tensor
from ...scheduler import NetState
from .core import Entry, OrderBook, PullBatcher, entry_count, entry_key
from .cutthrough import Assembler, Assembly, ChunkSum, chunk_count, chunk_elems, chunk_span
from .service import SchedulerService
from .settings import ScheduledSettings, host_of_rank

if TYPE_CHECKING:
    from mlfabric.ps.policy import ServerPort
    from mlfabric.ps.shard import PendingPull, Shard

log = logging.getLogger("mlfabric.ps")


class ScheduledServerSide:
    """The server side of the ``scheduled`` policy (module docstring)."""

    def __init__(self, settings: ScheduledSettings) -> None:
        self.settings = settings
        # the last batch of pull answers: (the rank it goes to, its send)
        self._answering: list[tuple[int, SendHandle]] = []
        self._pulls: PullBatcher | None = None  # model distribution's core (made with the server's seed)
        #: The scheduler, on server 0 (or the replica that took server 0 over).
        self.scheduler_service: SchedulerService | None = None
        # MLfabric-A: the batch orders and the scheduled updates that arrived (the core), and
        # the orders handed over by the scheduler's thread, not taken into the core yet.
        self.book = OrderBook()
        self._incoming_orders: list[tuple[dict[str, Any], float]] = []
        self._order_lock = threading.Lock()
        # per model, the worker updates in orders not yet applied or skipped (what the scheduler
        # adds to the version to plan the next batch's delays: planned_ahead); counted here, under
        # the lock, as soon as an order is handed over
        self._planned_ahead: Counter = Counter()
        # MLfabric-S: per (model, round) the workers whose routed update is not in yet, with
        # the time after which the round goes on without it.
        self._expected: dict[tuple[str, int], dict[int, float]] = {}
        self._routed_in: dict[tuple[str, int], set[int]] = {}  # (model, round) -> ranks whose update is in
        # Aggregation trees (.cutthrough): per (model, batch, slot) the root's chunks being put
        # together (a ChunkSum over the root, whose inputs stand in for it if it is lost), and
        # the groups already handed on (their late chunks are ignored).
        self._assembling: dict[tuple[str, int, int], tuple[ChunkSum, Assembler, float]] = {}
        self._assembled: dict[tuple[str, int, int], float] = {}
        self.torn = 0
        self._group_deadlines: dict[tuple[str, int, int], float] = {}  # when the order book skips a group entry

    # -- the serving loop's hooks --------------------------------------------------------------

    def start(self, server: "ServerPort") -> None:
        if server.server == 0:
            self.scheduler_service = SchedulerService(server, self.settings, orders=self)
            self.scheduler_service.start()

    def stop(self, server: "ServerPort") -> None:
        if self.scheduler_service is not None:
            self.scheduler_service.stop()
            server.stats.scheduler = self.scheduler_service.stats.as_dict()

    def claim_message(self, server: "ServerPort", src: int, header: dict[str, Any], payload: memoryview) -> bool:
        if header.get("op") == protocol.ORDER and server.layout.role(src) == "server":
            self.add_order(server, header, time.monotonic())
            return True
        return False

    def claim_push(self, server: "ServerPort", worker: int, header: dict[str, Any], payload: memoryview) -> bool:
        """MLfabric-A: a push of a batch is held for its entry's turn; MLfabric-S: it counts
        toward its round as routed; an update pushed outside any batch (a fallback) is the
        runtime's, counted as unscheduled."""
        if "batch" not in header:
            server.stats.unscheduled += 1
            return False
        if "chunk" in header:  # a chunk of a tree's aggregate (its root's, or re-routed around it)
            self._tree_chunk(server, worker, header, payload)
            return True
        if server.config.consistency.kind == "bsp":
            self._expected_arrived(server, header)
            return False
        shard = server.shard(header["model"], "push")
        gradient = payload_tensor(payload, shard.spec.torch_dtype, shard.length,
                                  f"push of model {shard.spec.name!r} to server {server.server}")
        self.book.arrived(shard.spec.name, int(header["batch"]), entry_key(header), (gradient.clone(), header))
        return True

    def step(self, server: "ServerPort", now: float) -> None:
        if self._assembling:
            self._expire_assemblies(server, now)
        self.apply_batches(server, now)
        if self._assembling or self._assembled:  # incomplete aggregates: their entries were skipped long ago
            limit = server.config.timeout_s
            for key in [k for k, (_, _, t) in self._assembling.items() if now - t > limit]:
                del self._assembling[key]
            for key in [k for k, t in self._assembled.items() if now - t > limit]:
                del self._assembled[key]
            with self._order_lock:
                for key in [k for k, t in self._group_deadlines.items() if now - t > limit]:
                    del self._group_deadlines[key]

    def _expire_assemblies(self, server: "ServerPort", now: float) -> None:
        """A tree's aggregate still incomplete at its entry's deadline (its root was lost and one
        of the inputs standing in for it never came): what came goes on, just before the order
        book would skip the entry (a chunk nobody sent leaves it incomplete: skipped)."""
        with self._order_lock:
            due = [k for k in self._assembling if now >= self._group_deadlines.get(k, float("inf"))]
        for key in due:
            chunk_sum, assembler, _ = self._assembling[key]
            for forward in chunk_sum.expire():
                whole = assembler.add(forward)
                if whole is not None:
                    self._deliver(server, key, whole, clock=0)
                    break
            self._assembling.pop(key, None)

    def _tree_chunk(self, server: "ServerPort", worker: int, header: dict[str, Any], payload: memoryview) -> None:
        """One chunk of a tree's aggregate for this server's component; once every chunk is in,
        the whole aggregate goes the way of an aggregator's push (held for its entry, or counted
        toward its round); a torn one (chunks summed over different members) is not applied:
        its entry is skipped at its deadline like a late one."""
        shard = server.shard(header["model"], "push")
        key = (shard.spec.name, int(header["batch"]), int(header["slot"]))
        if key in self._assembled:
            return
        now = time.monotonic()
        elems, index = int(header["elems"]), int(header["chunk"])
        entry = self._assembling.get(key)
        if entry is None:
            entry = self._assembling[key] = (ChunkSum([("c", int(header["root"]))], shard.length, elems),
                                             Assembler(shard.length, elems, shard.spec.torch_dtype), now)
        chunk_sum, assembler, _ = entry
        _, length = chunk_sum.span(index)
        tensor = payload_tensor(payload, shard.spec.torch_dtype, length,
                                f"chunk {index} of group {key[2]} of batch {key[1]} to server {server.server}").clone()
        forwards = []
        for host, inputs in header.get("lost", []):
            forwards += chunk_sum.lost(("c", int(host)), [tuple(s) for s in inputs])
        forwards += chunk_sum.add(tuple(header["source"]), index, tensor, [tuple(m) for m in header["members"]])
        for forward in forwards:
            whole = assembler.add(forward)
            if whole is not None:
                self._deliver(server, key, whole, clock=int(header.get("clock", 0)))
                return

    def _deliver(self, server: "ServerPort", key: tuple[str, int, int], whole: Assembly, clock: int) -> None:
        """A whole aggregate goes the way of an aggregator's push; a torn one is not applied."""
        self._assembling.pop(key, None)
        self._assembled[key] = time.monotonic()
        if whole.torn:
            self.torn += 1
            log.warning("%s: group %d of batch %d of %r: its chunks hold different updates (a node forwarded at "
                        "its deadline after part of the sum had gone): not applied, its entry is skipped",
                        server.who, key[2], key[1], key[0])
            return
        members = whole.members
        push = {"op": protocol.PUSH, "model": key[0], "batch": key[1], "slot": key[2], "clock": clock,
                "version": min(m[2] for m in members), "norm": 0.0,
                "workers": [server.layout.worker_index(m[0]) for m in members],
                "versions": [m[2] for m in members], "members": [[m[0], m[1]] for m in members]}
        # the sender named: a member worker of the aggregate (the runtime refuses non-workers)
        server.receive_push(server.layout.worker_index(members[0][0]), push, tensor_bytes(whole.tensor))

    def finish(self, server: "ServerPort") -> None:
        self.apply_batches(server, float("inf"))  # what arrived of the last batches, in order

    def add_order(self, server: "ServerPort", order: dict[str, Any], received: float) -> None:
        """The scheduler's application order of one batch (thread-safe: server 0's scheduler
        runs beside this loop)."""
        with self._order_lock:
            self._incoming_orders.append((order, received))
            for e in order["entries"]:
                if e[0] == "g":
                    self._group_deadlines[(order["model"], int(order["batch"]), int(e[1]))] = received + float(e[3])
            if not order.get("sync"):
                self._planned_ahead[order["model"]] += sum(entry_count(e) for e in order["entries"])
        server.wake()

    def planned_ahead(self, model: str) -> int:
        """Worker updates of ``model`` in batch orders this server has not applied or skipped
        yet (MLfabric-A). The next batch's versions start at ``version + planned_ahead``: an
        update that is skipped, dropped here, or missing from its aggregate leaves the count
        without moving the version, so the versions planned next are the ones that will be
        applied (counting it once planned would have shortened every later deadline)."""
        with self._order_lock:
            return self._planned_ahead[model]

    def apply_batches(self, server: "ServerPort", now: float) -> None:
        """Apply scheduled updates in their batch's order, batches one after the other; an
        entry still missing ``slack`` after its planned commit is skipped (:class:`~.core.OrderBook`)."""
        with self._order_lock:  # MLfabric-A's orders; MLfabric-S's are round_limit's
            incoming = [(o, t) for o, t in self._incoming_orders if not o.get("sync")]
            self._incoming_orders = [(o, t) for o, t in self._incoming_orders if o.get("sync")]
        for order, received in incoming:
            self.book.add_order(order, received)
        self.book.step(now, _OrderPort(self, server), models=lambda m: m in server.shards,
                       on_applied=self._applied)

    def _applied(self, model: str, count: int) -> None:
        with self._order_lock:  # after the version moved: a planner never counts too few
            self._planned_ahead[model] -= count

    def held_ranks(self, server: "ServerPort", model: str) -> set[int]:
        """Workers with an update in a batch entry not applied (or skipped) yet: their pulls
        wait for it. With ``trees`` too: the trees branch measured answering from the version
        in flight instead (``PullBatcher.attach``) worse under the delay bound (the next update
        is older at planning, more are dropped; docs/mlfabric_scheduler.md "Trees")."""
        with self._order_lock:
            incoming = [o for o, _ in self._incoming_orders if o["model"] == model and not o.get("sync")]
        return {int(r) for o in incoming for e in o["entries"] for r in e[4]} | self.book.held_ranks(model)

    def _apply_scheduled(self, server: "ServerPort", shard: "Shard", gradient: torch.Tensor, header: dict[str, Any],
                         entry: Entry | None = None) -> None:
        workers = tuple(header["workers"]) if "workers" in header else (server.layout.worker_index(int(header["rank"])),)
        versions = tuple(int(v) for v in header["versions"]) if "versions" in header else (int(header["version"]),)
        bound = server.config.consistency.delay_bound
        if bound is not None and shard.version - min(versions) > bound:
            server.stats.dropped += len(workers)  # unscheduled updates moved the version past the plan
            return
        # a group forwarded at its deadline with some members missing is not the unit the
        # replica gets from the network: that one goes the chain way
        complete = entry is not None and len(workers) == entry.count
        server.apply(shard, gradient, workers, versions, weight=1.0 / server.layout.workers,
                    unit=entry.unit if entry is not None and complete else None,
                    members=header.get("members") or [[int(header["rank"]), int(header["id"])]],
                    norm=entry.norm if entry is not None else None)

    def _expected_arrived(self, server: "ServerPort", header: dict[str, Any]) -> None:
        """MLfabric-S: these workers' updates of the round are in (directly or summed)."""
        ranks = ([server.layout.worker_rank(int(w)) for w in header["workers"]] if "workers" in header
                 else [int(header["rank"])])
        key = (header["model"], int(header["clock"]))
        # The round's order may come after its updates (another connection): remember them.
        self._routed_in.setdefault(key, set()).update(ranks)
        pending = self._expected.get(key)
        if pending is not None:
            for rank in ranks:
                pending.pop(rank, None)

    def round_limit(self, server: "ServerPort", now: float) -> int | None:
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
                    server.stats.skipped += 1
                    log.warning("%s: round %d of %r: the update of %s did not arrive in time; the round goes "
                                "on without it", server.who, key[1], key[0], server.layout.describe(rank))
                    pending.pop(rank)
            if not pending:
                del self._expected[key]
        for key in [k for k in self._routed_in if k[1] < server.book.rounds_closed]:
            del self._routed_in[key]
        return min((clock for _, clock in self._expected), default=None)

    # -- model distribution (§10.3) -------------------------------------------------------------

    def ready_to_answer(self, server: "ServerPort") -> bool:
        """Pulls that become ready while the server is still sending the last batch's answers
        (until their planned end on its up-link, and until the transport has them) wait for
        the next batch: the server's NIC is busy anyway, and together they share one send to
        a distributor instead of each taking the server's up-link. (The transport's handles
        alone would not do: a socket takes a few MB into its buffer at once.)"""
        # A send to a peer that died or left never completes (the transport drops it): it
        # must not hold every later pull (it did: the server stopped answering anyone).
        gone = set(server.transport.lost_peers) | set(server.transport.departed_peers)
        self._answering = [(r, h) for r, h in self._answering if not h.done() and r not in gone]
        busy_until = self._pulls.answer_at() if self._pulls is not None else 0.0
        return not self._answering and time.monotonic() >= busy_until

    def answer_at(self) -> float | None:
        return self._pulls.answer_at() if self._pulls is not None else 0.0


    def answer_pulls(self, server: "ServerPort", pulls: "list[PendingPull]", shard: torch.Tensor,
                     header: protocol.ModelReply, *, source: "Shard | None" = None) -> list[SendHandle]:
        now = time.monotonic()
        service = self.scheduler_service
        if service is not None:
            net = service.network(now)
        else:  # a server without the scheduler beside it plans on line rates
            rate = self.settings.rate_bps / 8
            net = NetState([rate] * server.layout.world_size, [rate] * server.layout.world_size, origin=now)
        if self._pulls is None:
            self._pulls = PullBatcher(distributors=self.settings.distributors, seed=server.config.seed,
                                      server=server.server, trees=self.settings.trees,
                                      chunk_bytes=self.settings.chunk_bytes if self.settings.trees else 0)
        me = server.transport.rank
        lost = server.transport.lost_peers
        pull_of = {p.rank: p for p in pulls}
        asked = [p.rank for p in pulls if p.direct or p.rank in lost]  # to be answered by the server itself
        if self.settings.trees:
            return self._multicast(server, net, pull_of, asked, shard, header, now)
        plan = self._pulls.plan(net, me=me, pullers=[r for r in pull_of if r not in asked],
                                model_size=float(shard.numel() * shard.element_size()), now=now,
                                answered_first=asked)
        server.stats.pull_batches += 1
        session, channel = server.config.session, server.channel
        payload = tensor_bytes(shard)
        handles: list[SendHandle] = []
        to: list[int] = []  # beside each handle, the rank it sends to
        for d, members in reversed(plan.groups):  # the paper's order: distributor k° first
            forward = [[w, pull_of[w].request_id] for w in members]
            to.append(d)
            # the one header every puller gets, with this distributor's list (encoded once, here)
            handles.append(server.transport.send(d, protocol.reply_tag(session, pull_of[d].request_id), payload,
                                                 meta=replace(header, forward=forward).encode(), channel=channel))
            via = protocol.Via(distributor=d).encode()
            for w in members:
                server.transport.send(w, protocol.reply_tag(session, pull_of[w].request_id), b"", meta=via,
                                      channel=channel)
            server.stats.pulls_relayed += len(members)
        handles += answer_directly(server, [pull_of[r] for r in plan.by_server], shard, header)
        to += list(plan.by_server)
        if service is not None:
            service.reserve(list(plan.transfers))
        self._answering = list(zip(to, handles))
        return handles



    def _multicast(self, server: "ServerPort", net: NetState, pull_of: "dict[int, PendingPull]", asked: list[int],
                   shard: torch.Tensor, header: protocol.ModelReply, now: float) -> list[SendHandle]:
        """#36's model distribution: the version leaves the server once per tree root and
        spreads down ``PullBatchPlan.tree`` (the planner's multicast trees over the pullers),
        chunk by chunk: a relay sends chunk i on while it receives chunk i+1
        (:meth:`mlfabric.ps.worker.PSWorker._gather_chunks`). Every puller below a root gets a
        "via" note naming its parent and the tree (its own children in it, whom it serves even
        if its parent is lost and it asks the server directly). Pulls asked directly (a lost
        relay's) are answered by the server itself."""
        assert self._pulls is not None
        me = server.transport.rank
        tree_pullers = [r for r in pull_of if r not in asked]
        # one puller per host in the trees; its co-located pullers hang below it (the model
        # reaches a host once and goes on over shared memory)
        wph, first = self.settings.workers_per_host, server.layout.worker_ranks[0]
        reps: dict[int, int] = {}
        local: dict[int, list[int]] = {}
        for rank in tree_pullers:
            rep = reps.setdefault(host_of_rank(rank, wph, first) if wph > 1 else rank, rank)
            if rep != rank:
                local.setdefault(rep, []).append(rank)
        plan = self._pulls.plan(net, me=me, pullers=list(reps.values()),
                                model_size=float(shard.numel() * shard.element_size()), now=now)
        server.stats.pull_batches += 1
        session, channel = server.config.session, server.channel
        tree = {h: [*kids, *local.get(h, [])] for h, kids in plan.tree.items()}
        for rep, ranks in local.items():
            tree.setdefault(rep, list(ranks))
        mtree = {str(h): [[c, pull_of[c].request_id] for c in kids] for h, kids in tree.items() if h != me}
        parent = {c: h for h, kids in tree.items() for c in kids}
        handles: list[SendHandle] = answer_directly(server, [pull_of[r] for r in asked], shard, header)
        to: list[int] = list(asked)  # beside each handle, the rank it sends to
        for rank in tree_pullers:
            if parent.get(rank, me) != me:
                server.transport.send(rank, protocol.reply_tag(session, pull_of[rank].request_id), b"", channel=channel,
                                      meta=protocol.Via(distributor=parent[rank], mtree=mtree).encode())
                server.stats.pulls_relayed += 1
        elems = chunk_elems(plan.chunk_bytes, shard.element_size())
        numel = shard.numel()
        chunks = chunk_count(numel, elems)
        for root in tree.get(me, ()):
            rid = pull_of[root].request_id
            for index in range(chunks):
                start, length = chunk_span(index, numel, elems)
                meta = protocol.ModelChunk.of(header, mtree=mtree, chunk=index, chunks=chunks, elems=elems or numel,
                                              itemsize=shard.element_size(),
                                              nbytes=numel * shard.element_size()).encode()
                to.append(root)
                handles.append(server.transport.send(root, protocol.reply_tag(session, rid),
                                                     tensor_bytes(shard[start:start + length]), meta=meta,
                                                     channel=channel))
        if self.scheduler_service is not None:
            self.scheduler_service.reserve(list(plan.transfers))
        self._answering = list(zip(to, handles))
        return handles


__all__ = ["ScheduledServerSide"]


class _OrderPort:
    """The :class:`~.core.OrderPort` of one server: what the order book applies goes through
    the server's ``apply``; skips are counted and warned; the replication feed may hold a
    batch's last entry and probes the replicas at a batch's end."""

    def __init__(self, side: ScheduledServerSide, server: "ServerPort") -> None:
        self.side, self.server = side, server

    def apply(self, model: str, entry: Entry, arrived: Any) -> None:
        gradient, header = arrived
        self.side._apply_scheduled(self.server, self.server.shards[model], gradient, header, entry=entry)

    def skipped(self, model: str, batch: int, entry: Entry) -> None:
        self.server.stats.skipped += entry.count
        log.warning("%s: batch %d of %r: %s %s did not arrive in time; skipped", self.server.who, batch, model,
                    "update" if entry.kind == "u" else "group", entry.key)

    def hold_last(self, model: str, entry: Entry, now: float) -> bool:
        return self.server.feed.hold_last(self.server, self.server.shards[model], entry.norm, now)

    def batch_done(self, model: str, batch: int) -> None:
        self.server.feed.probe(self.server, self.server.shards[model], batch)
