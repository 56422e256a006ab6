"""The ``scheduled`` policy's aggregators: a thread on every worker that sums groups and sends replica copies.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_network_replication.py -q

(:mod:`mlfabric.ps.policies.scheduled`, "Aggregators" and "Replication".) With trees (#36)
the same thread runs this host's node of each group's multi-level, cut-through tree (the
summing is :mod:`.cutthrough`'s; framing and repair: "aggregation trees" below and
docs/mlfabric_scheduler.md, "At runtime"):

    .venv/bin/python -m pytest tests/unit/test_ps_trees_runtime.py tests/local/test_ps_trees_processes.py -q
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.transport.base import SendHandle, Transport, tensor_bytes

from ... import protocol
from ...protocol import payload_tensor
from ...waits import sends_done
from .cutthrough import (ChunkSum, Forward, Tree, chunk_elems, chunk_span, decode_tree, node_inputs,
                         reroute, tree_root)
from .settings import ScheduledSettings, unit_scheduler

if TYPE_CHECKING:
    from mlfabric.ps.policy import WorkerPort

log = logging.getLogger("mlfabric.ps")


def wait_sent(transport: Transport, handles: list[SendHandle], timeout: float) -> None:
    """Best effort: the sends leave (paced ones at their rate) before the caller goes on."""
    sends_done(transport, handles, timeout, who=f"rank {transport.rank}", what="scheduled sends")





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
class _TreeGroup:
    """This host's node of a group's aggregation tree (multi-level, cut-through): one
    :class:`~.cutthrough.ChunkSum` per server component; chunks that came before the group's
    order wait in ``early``."""

    model: str = ""
    planned: bool = False
    tree: Tree = field(default_factory=dict)
    servers: list[int] = field(default_factory=list)
    deadline: float = float("inf")
    rates: list[float | None] = field(default_factory=list)
    elems: int = 0
    clock: int = 0
    sums: dict[int, ChunkSum] = field(default_factory=dict)
    early: list[tuple[dict[str, Any], torch.Tensor]] = field(default_factory=list)
    handles: list[SendHandle] = field(default_factory=list)
    paced: set[int] = field(default_factory=set)
    partial: bool = False
    since: float = 0.0
    repaired: set[int] = field(default_factory=set)   # lost nodes whose inputs stand in here
    early_out: list[tuple[int, list[Forward]]] = field(default_factory=list)  # chunks a repair completed


@dataclass
class _Held:
    """A contribution sent toward a tree node (a member's chunks, or a node's forwarded
    chunks), kept until the group's deadline: if the node is lost meanwhile, it goes again to
    the nearest live ancestor (:func:`~.cutthrough.reroute`)."""

    hop: int
    tree: Tree
    until: float
    server: int                # the component j (its server when no ancestor is left)
    messages: list[tuple[protocol.TreeChunk, torch.Tensor]]
    dest: int | None = None    # where it went last (None: the servers)
    key: Any = None            # a node's forwards: ((batch, slot), component), one record for all chunks


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

    def __init__(self, worker: "WorkerPort", settings: ScheduledSettings) -> None:
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
        # aggregation trees (multi-level, cut-through: module docstring of .cutthrough)
        self._trees: dict[tuple[int, int], _TreeGroup] = {}
        self._trees_done: dict[tuple[int, int], float] = {}  # finished nodes: late chunks are ignored
        self._held: list[_Held] = []
        self._redirected: set[tuple[tuple[int, int], int]] = set()  # (group, node) a parent said is lost
        self.rerouted = 0
        self.chunks_forwarded = 0

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
                    # a tree node with chunks in and its order still on the way is open too:
                    # a worker whose own update its node sums must not leave before the order
                    or any(g.planned or g.early for g in self._trees.values())
                    # what this host sent toward a tree node is kept until the group's deadline:
                    # if the node crashes meanwhile it goes again (unless the node left on
                    # purpose: it forwarded its sums before its goodbye)
                    or any(h.until > time.monotonic() and h.hop not in transport.departed_peers
                           for h in self._held)
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
                if header["op"] == "group" and "tree" in header:
                    self._tree_group(header)
                elif header["op"] == "tchunk":
                    self._tree_chunk(header, msg.payload)
                elif header["op"] == "treroute":
                    self._treroute(header)
                elif header["op"] == "group":
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
            self._tree_step(time.monotonic())
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
                tag, meta = protocol.tag(protocol.REPLICATE, session), protocol.Unit(
                    unit=key, model=header["model"]).encode()
            else:
                tag, meta = protocol.tag(protocol.AGGREGATE, session), protocol.ReplicaMember(
                    unit=key, model=header["model"], server=j, rank=w.transport.rank,
                    replica=int(header["replica"]), id=int(header["id"])).encode()
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
                                      meta=protocol.Unit(unit=key, model=unit.model).encode(), channel=channel)
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
                    elif j not in group.sent and not got and now >= group.deadline + self.settings.slack_s:
                        # nothing came by the deadline and its slack (the members were dropped, fell
                        # back or, after a failover, went elsewhere): nothing to forward, and the
                        # server has skipped the entry; closed, so a leaving worker does not wait
                        group.sent.add(j)
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
            # a member may be a host sum (#36): it names every worker update in it
            meta = protocol.GroupSum(model=group.model, batch=batch, slot=slot,
                                     clock=first["clock"], version=first["version"], norm=0.0,
                                     workers=[x for h, _ in got for x in h.get("workers")
                                              or [w.layout.worker_index(int(h["rank"]))]],
                                     versions=[int(x) for h, _ in got for x in h.get("versions") or [h["version"]]],
                                     members=[m for h, _ in got for m in h.get("members")
                                              or [[int(h["rank"]), int(h["id"])]]]).encode()
            rate = group.rates[group.servers.index(j)] if group.rates else None
            server = w.server_rank(j)
            paced = rate is not None and w.transport.pace_connection(server, w.channel, rate)
            handle = w.transport.send(server, protocol.request_tag(w.config.session), tensor_bytes(total), meta=meta,
                                      channel=w.channel)
            wait_sent(w.transport, [handle], w.config.timeout_s)
            if paced:
                w.transport.pace_connection(server, w.channel, None)
            self.forwarded += 1

    # -- aggregation trees: multi-level, cut-through (.cutthrough) -----------------------------
    #
    # Framing: every chunk is one transport message (op "tchunk" on the aggregate tag toward a
    # tree node; op "push" on the request tag toward a server) whose meta names the group
    # (model, batch, slot), the component ``server``, the chunk index ``chunk`` and size
    # ``elems``, the ``source`` it comes from (["m", rank, id] or ["c", host]), the updates
    # summed into it (``members``: [rank, id, version]), the tree's ``root`` and, when it was
    # re-routed around lost nodes, ``lost``: [[host, its inputs], ...]. A node therefore sends
    # chunk i (the transport's sender) while chunk i+1 is still being received (its reader).

    def contribute(self, model: str, server: int, hop: int, tree: Tree,
                   messages: list[tuple[protocol.TreeChunk, torch.Tensor]], hold_s: float) -> list[SendHandle]:
        """A member's update, as chunks, toward its tree node ``hop`` (this host's own node:
        summed at once); kept ``hold_s`` to be sent again around ``hop`` if it is lost."""
        w = self.worker
        if hop == w.transport.rank:
            for chunk, tensor in messages:
                self._tree_chunk(chunk.fields(), tensor.clone())
            return []
        group_key = (messages[0][0].batch, messages[0][0].slot)
        held = _Held(hop=hop, tree=tree, until=time.monotonic() + hold_s, server=server,
                     messages=[(f, t.detach().clone()) for f, t in messages], dest=hop, key=(group_key, server))
        dest, chain = reroute(tree, hop, self._lost(group_key))
        held.dest = dest
        handles = self._send_chunks(model, dest, server, [[h, [list(x) for x in inputs]] for h, inputs in chain],
                                    held.messages)
        with self._lock:
            self._held.append(held)
        return handles

    def _lost(self, key: tuple[int, int]) -> Any:
        """Whether a tree node of group ``key`` is lost: its process crashed (the transport
        says so), or the nearest live ancestor asked for its inputs (it saw the crash first:
        a sender does not always notice a peer it only sends to). A node that left on purpose
        (goodbye) forwarded its sums before it went: not lost."""
        lost = self.worker.transport.lost_peers
        return lambda host: host in lost or (key, host) in self._redirected

    def _send_chunks(self, model: str, dest: int | None, server: int, lost: list[Any],
                     messages: list[tuple[protocol.TreeChunk, torch.Tensor]]) -> list[SendHandle]:
        w = self.worker
        session = w.config.session
        handles = []
        for chunk, tensor in messages:
            chunk = replace(chunk, lost=lost or None)  # the lost nodes as of this send
            if dest is None:  # the servers: the chunk counts toward the group's entry there
                handles.append(w.transport.send(w.server_rank(server), protocol.request_tag(session),
                                                tensor_bytes(tensor), channel=w.channel,
                                                meta=chunk.to_server().encode()))
            else:
                handles.append(w.transport.send(dest, protocol.tag(protocol.AGGREGATE, session), tensor_bytes(tensor),
                                                channel=w.channel, meta=chunk.encode()))
        return handles

    def _tree_group(self, header: dict[str, Any]) -> None:
        """This host's order as a node of a group's tree."""
        w = self.worker
        key = (int(header["batch"]), int(header["slot"]))
        spec = w.models.get(header["model"])
        if spec is None:
            log.error("%s: aggregator: tree group %d of batch %d for unknown model %r ignored", w.who, key[1], key[0],
                      header["model"])
            return
        me = w.transport.rank
        with self._lock:
            if key in self._trees_done:
                return
            group = self._trees.setdefault(key, _TreeGroup(since=time.monotonic()))
            group.model, group.planned = header["model"], True
            group.tree = decode_tree(header["tree"])
            group.servers = [int(j) for j in header["servers"]]
            group.deadline = time.monotonic() + float(header["deadline_in"]) - self._level_share(group.tree, me)
            group.rates = list(header["rates"])
            group.elems = chunk_elems(int(header.get("chunk_bytes", 0)), torch.empty((), dtype=spec.torch_dtype).element_size())
            shards = spec.shards(w.layout.servers)
            inputs = node_inputs(group.tree, me)
            group.sums = {j: ChunkSum(inputs, shards[j][1], group.elems) for j in group.servers}
            early, group.early = group.early, []
        for fields, tensor in early:
            self._tree_chunk(fields, tensor)

    def _repairs(self) -> list[tuple[int, protocol.TreeReroute]]:
        """(Caller holds the lock.) Nodes of this host's unfinished trees that crashed and whose
        nearest live ancestor is this node: their inputs stand in for them here
        (:meth:`~.cutthrough.ChunkSum.lost`), and each live input is asked to send what it
        sent toward the lost node here ("treroute"; it keeps it until the deadline)."""
        w = self.worker
        me, lost = w.transport.rank, w.transport.lost_peers
        asks = []
        for key, group in self._trees.items():
            if not group.planned or not lost:
                continue
            for host in group.tree:
                if host not in lost or host in group.repaired:
                    continue
                parent = group.tree[host].parent
                dest = None if parent is None else reroute(group.tree, parent, lambda h: h in lost)[0]
                if dest != me:
                    continue
                group.repaired.add(host)
                inputs = node_inputs(group.tree, host)
                for j, chunk_sum in group.sums.items():
                    out = chunk_sum.lost(("c", host), inputs)
                    if out:  # the stand-ins' chunks were here already
                        group.early_out.append((j, out))
                log.warning("%s: aggregator: tree node %s of group %d of batch %d lost: its inputs are asked to send "
                            "here", w.who, w.layout.describe(host), key[1], key[0])
                for source in inputs:
                    rank = int(source[1])
                    if rank != me and rank not in lost:
                        asks.append((rank, protocol.TreeReroute(batch=key[0], slot=key[1], lost=host, dest=me)))
        return asks

    def _treroute(self, header: dict[str, Any]) -> None:
        """A parent saw tree node ``lost`` crash: what this host sent toward it goes to ``dest``."""
        key = (int(header["batch"]), int(header["slot"]))
        with self._lock:
            self._redirected.add((key, int(header["lost"])))
        self.worker.transport.mailbox.notify()  # the next _tree_step re-routes the held chunks

    def _level_share(self, tree: Tree, host: int) -> float:
        """How much earlier than the group's deadline this node forwards what came: the slack
        is shared out among the levels (a node at depth d of a tree of height D leaves
        ``slack * (d + 1) / (D + 2)`` before it), so that each level's partial sum still
        reaches the next one, and the root's the server, before the server skips the entry."""
        def depth(h: int) -> int:
            parent = tree[h].parent
            return 0 if parent is None else 1 + depth(parent)
        height = max(depth(h) for h in tree)
        return self.settings.slack_s * (depth(host) + 1) / (height + 2)

    def _tree_chunk(self, header: dict[str, Any], payload: memoryview | torch.Tensor) -> None:
        """A chunk for this host's node (a member's, a child's, or one re-routed around a lost node)."""
        w = self.worker
        key = (int(header["batch"]), int(header["slot"]))
        j, index, elems = int(header["server"]), int(header["chunk"]), int(header["elems"])
        if isinstance(payload, torch.Tensor):
            tensor = payload
        else:
            spec = w.models.get(header["model"])
            if spec is None:
                return
            numel = spec.shards(w.layout.servers)[j][1]
            _, length = chunk_span(index, numel, elems)
            tensor = payload_tensor(payload, spec.torch_dtype, length, f"chunk {index} of group {key[1]}").clone()
        with self._lock:
            if key in self._trees_done:
                return  # the node finished (at its deadline): too late
            group = self._trees.setdefault(key, _TreeGroup(since=time.monotonic()))
            if not group.planned:
                group.early.append((header, tensor))
                return
            if group.elems != elems:
                log.error("%s: aggregator: chunk of %d elements from %s for group %d of batch %d, which cuts chunks of "
                          "%d: ignored (the planner's chunk_bytes differ between messages)", w.who, elems,
                          header.get("source"), key[1], key[0], group.elems)
                return
            chunk_sum = group.sums.get(j)
            if chunk_sum is None:
                log.error("%s: aggregator: chunk for server component %d of group %d of batch %d, which this node does "
                          "not sum: ignored", w.who, j, key[1], key[0])
                return
            out: list[Forward] = []
            for host, inputs in header.get("lost", []):
                out += chunk_sum.lost(("c", int(host)), [tuple(s) for s in inputs])
            out += chunk_sum.add(tuple(header["source"]), index, tensor, [tuple(m) for m in header["members"]])
            if not group.clock:
                group.clock = int(header.get("clock", 0))
        self._tree_forward(key, group, j, out)

    def _tree_forward(self, key: tuple[int, int], group: _TreeGroup, j: int, forwards: list[Forward]) -> None:
        """Send the chunks the node's sum handed back on: to its parent (or the nearest live
        ancestor, naming the lost ones) or, at the root, to the server of component ``j``."""
        if not forwards:
            return
        w = self.worker
        me = w.transport.rank
        parent = group.tree[me].parent
        root = tree_root(group.tree, me)
        messages = [(protocol.TreeChunk(model=group.model, batch=key[0], slot=key[1], server=j, chunk=f.index,
                                        elems=group.elems, source=["c", me], members=[list(m) for m in f.members],
                                        clock=group.clock, root=root), f.tensor) for f in forwards]
        dest, chain = (None, []) if parent is None else reroute(group.tree, parent, self._lost(key))
        lost = [[host, [list(s) for s in inputs]] for host, inputs in chain]
        target = w.server_rank(j) if dest is None else dest
        # one rate per component, or one for the whole tree (every edge runs at the tree's rate)
        rate = (group.rates[min(group.servers.index(j), len(group.rates) - 1)]
                if group.rates and j in group.servers else None)
        if target not in group.paced and rate is not None and w.transport.pace_connection(target, w.channel, rate):
            group.paced.add(target)
        handles = self._send_chunks(group.model, dest, j, lost, messages)
        self.chunks_forwarded += len(forwards)
        with self._lock:
            group.handles += handles
            if parent is not None:  # kept until the deadline: the parent may still be lost
                held = next((h for h in self._held if h.key == (key, j) and h.dest == dest), None)
                if held is None:
                    self._held.append(_Held(hop=parent, tree=group.tree, server=j, messages=messages, dest=dest,
                                            until=group.deadline + self.settings.slack_s, key=(key, j)))
                else:
                    held.messages += messages

    def _tree_step(self, now: float) -> None:
        """Deadlines (forward what came: .cutthrough's expire), finished nodes, and contributions
        whose tree node was lost (sent again to the nearest live ancestor)."""
        w = self.worker
        expired: list[tuple[tuple[int, int], _TreeGroup, int, list[Forward]]] = []
        with self._lock:
            for key, group in list(self._trees.items()):
                if not group.planned:
                    if now - group.since > w.config.timeout_s:
                        log.error("%s: aggregator: %d chunks for group %d of batch %d but no order for it in %.0f s: "
                                  "dropped", w.who, len(group.early), key[1], key[0], w.config.timeout_s)
                        del self._trees[key]
                    continue
                if now >= group.deadline:
                    for j, chunk_sum in group.sums.items():
                        if not chunk_sum.done:
                            missing = chunk_sum.waiting_for()
                            out = chunk_sum.expire()
                            if out:
                                group.partial = True
                                log.warning("%s: aggregator: group %d of batch %d (component %d) forwarded at its "
                                            "deadline without %s", w.who, key[1], key[0], j, sorted(map(str, missing)))
                            expired.append((key, group, j, out))
        for key, group, j, out in expired:
            self._tree_forward(key, group, j, out)
        with self._lock:
            for key, group in list(self._trees.items()):
                if group.planned and all(s.done for s in group.sums.values()) and all(h.done() for h in group.handles):
                    for target in group.paced:
                        w.transport.pace_connection(target, w.channel, None)
                    self.forwarded += 1
                    self.partial += int(group.partial)
                    del self._trees[key]
                    self._trees_done[key] = now
            for key in [k for k, t in self._trees_done.items() if now - t > w.config.timeout_s]:
                del self._trees_done[key]
            self._held = [h for h in self._held if h.until > now]
            asks = self._repairs()
            moved = []
            for held in self._held:
                dest, chain = reroute(held.tree, held.hop, self._lost(held.key[0]))
                if dest != held.dest:
                    held.dest = dest
                    moved.append((held, [[host, [list(s) for s in inputs]] for host, inputs in chain]))
        for key, group in list(self._trees.items()):
            while group.early_out:
                j, out = group.early_out.pop()
                self._tree_forward(key, group, j, out)
        for rank, ask in asks:
            w.transport.send(rank, protocol.tag(protocol.AGGREGATE, w.config.session), b"", channel=w.channel,
                             meta=ask.encode())
        for held, lost in moved:
            self.rerouted += 1
            where = "the servers" if held.dest is None else w.layout.describe(held.dest)
            log.warning("%s: aggregator: tree node %s lost: %d chunks sent again to %s", w.who,
                        w.layout.describe(held.hop), len(held.messages), where)
            model = held.messages[0][0].model
            self._send_chunks(model, held.dest, held.server, lost, held.messages)
