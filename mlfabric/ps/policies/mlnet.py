"""MLNET's routing policy (MLNET §3): pushes aggregate up per-server trees, pulls multicast down.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet.py -q
    mlfabric train --workload hyperplane --workers 4 --servers 2 --sync ps-bsp,mlnet-binary,mlnet-rack+ssp:1

``PSConfig(routing="mlnet",
mlnet=MLNetSettings(...))``. The worker's code does not change (``push``/``pull``/``clock``,
``PSOptimizer``); the servers see one worker per subtree and answer as for direct routing.

**Trees.** For every server ``j`` a spanning tree over the workers
(:func:`mlfabric.topo.trees.tree_parents`, the code the simulator uses too): ``binary``
(in-degree 2), ``rack`` (one aggregator per rack, from :attr:`MLNetSettings.racks`) or
``tree:D`` (in-degree D).

**Host proxy.** Each worker process runs one :class:`TreeNode` thread: the node of its host in
every server's tree (one worker process per host here; with several per host the first one's
node would serve them all, which this slice does not build). The worker hands its pushes,
clocks, pulls and its leave to its own node (in-process); nodes talk to their parents and
children over the job's transport on the ``TREE`` tag:

* *push / clock* (up): for each clock ``c`` a node waits for its own worker's clock ``c`` and
  each child's, sums the pushes of ``c`` (its own and its children's sums) per model, and
  forwards one sum, then one clock naming every worker it covers, to its parent; a root-level
  node sends them to server ``j`` as an aggregate update (``workers``/``versions`` in the
  header: the server applies it like that many updates). Under BSP the round of ``c`` cannot
  close before a sum arrives, because the forwarding node's own clock travels with it.
* *pull* (down): a node answers a pull (its worker's or a child's) from the model copy it holds
  when that copy's model clock ``c_model >= c_worker - s`` (SSP's bound, MLNET §3; ``s = 0``
  under BSP), and otherwise asks its parent once for what the most demanding waiting pull
  needs, then answers every pull the new copy satisfies. The node answers its own worker by
  placing the reply in the worker's mailbox as from the server it stands for.
* *leave*: a leaving worker's node keeps serving its children until their subtrees have left
  (bounded by the job's timeout), and forwards each leave after the sums it covers.

``pull_in_order`` (TicTac's per-tensor order, ``ps/policies/ordered.py``) does not go through the tree:
the servers answer it directly, under the same clocks.

**Failures** (MLNET §3, docs/parameter_server.md "Failures: repair and fall back"): a lost
child's children are adopted by its node; a node whose parent is lost re-attaches to the first
live ancestor (or the server) and sends again the clocks it lacks; two nodes lost within
``FALLBACK_WINDOW_S`` tear the trees down (direct push/pull). Sums count only with their
clock, at nodes and servers, so nothing is half-applied. A lost server whose replica takes
over (SSP, ``PSLayout(replicas=...)``) is replaced: the root-level nodes attach to the replica
and send again the clocks it lacks; without one, the worker's next call fails, naming it.
A killed worker's restarted process (``MLFABRIC_INCARNATION``) re-enters every tree as a leaf
of its first live ancestor, from the next clock that ancestor sends up (:meth:`TreeCore._enter_all`
and :meth:`TreeCore._take_back`; ``tests/unit/test_ps_mlnet_reentry.py``); a later failure
that touches it tears the trees down.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, Union

import numpy as np
import torch

from mlfabric import TOPOLOGY_ENV
from mlfabric.errors import PeerLostError, TransportError
from mlfabric.topo.trees import children_of, parse_tree_kind, rack_of, subtree_of, tree_parents
from mlfabric.transport.base import Message, SendHandle, tensor_bytes

from .. import protocol
from ..policy import Policy, register_policy
from ..protocol import payload_tensor

if TYPE_CHECKING:
    from ..config import PSConfig
    from ..layout import PSLayout
    from ..policy import ServerPort, WorkerPort

log = logging.getLogger("mlfabric.ps")

#: Request ids of a node's own pulls to its parent start here, apart from its worker's ids
#: (both share the rank's reply tags).
_NODE_IDS = 1 << 38
_IDLE_S = 0.05
#: Two tree nodes lost within this many seconds are "several concurrent failures" (MLNET §3):
#: the trees are torn down and every worker pushes and pulls directly.
FALLBACK_WINDOW_S = 3.0
FALL_BACK = protocol.FALL_BACK


@dataclass(frozen=True, kw_only=True)
class MLNetSettings:
    """``tree``: ``binary``, ``rack`` or ``tree:D``. ``hosts``: the host of each worker (its
    order shapes the trees: rack-mates share subtrees); ``racks``: the rack of each worker
    (``rack`` trees). Defaults: rank ``r`` on host ``r`` (the launchers' placement), racks
    read off the launch's topology (``MLFABRIC_TOPOLOGY``, e.g. ``racks:r=2,h=6``), or every
    worker in one rack when no topology is set (loopback runs: one aggregator per server)."""

    tree: str = "binary"
    hosts: tuple[int, ...] | None = None
    racks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        kind, _degree = parse_tree_kind(self.tree)  # raises with the accepted forms
        if kind == "direct":
            raise ValueError("mlnet trees are binary, rack or tree:D; direct routing is routing='direct'")
        for name in ("hosts", "racks"):
            values = getattr(self, name)
            if values is not None:
                object.__setattr__(self, name, tuple(int(v) for v in values))

    def parents(self, workers: int, servers: int, worker_ranks: Sequence[int] | None = None) -> np.ndarray:
        """The ``(servers, workers)`` parent table (:func:`mlfabric.topo.trees.tree_parents`);
        ``worker_ranks``: each worker's rank, its host by default."""
        kind, degree = parse_tree_kind(self.tree)
        hosts = self.hosts or tuple(worker_ranks if worker_ranks is not None else range(workers))
        if len(hosts) != workers:
            raise ValueError(f"mlnet: hosts gives {len(hosts)} hosts for {workers} workers")
        racks = None
        if kind == "rack":
            racks = self.racks
            spec = os.environ.get(TOPOLOGY_ENV)
            if racks is None and spec:
                from mlfabric.topo import parse_topology

                topology = parse_topology(spec, "10Gbps")  # the rate does not change the racks
                if max(hosts) >= topology.n_hosts:
                    raise ValueError(f"mlnet rack trees: worker hosts up to {max(hosts)}, but {spec} "
                                     f"({TOPOLOGY_ENV}) has {topology.n_hosts} hosts")
                racks = tuple(rack_of(topology, hosts).tolist())
            racks = racks if racks is not None else (0,) * workers
        return tree_parents(kind, servers, hosts, degree=degree, racks=racks)


@dataclass
class NodeStats:
    """What one worker's tree node did (summed over its servers' trees)."""

    sums_forwarded: int = 0       # sums (one per clock, model and tree) sent up
    updates_aggregated: int = 0   # worker updates inside them
    pulls_from_cache: int = 0     # pulls answered from the node's copy
    pulls_upstream: int = 0       # requests the node sent its parent (or server)
    lost_children: list[int] = field(default_factory=list)
    #: Repairs: lost children whose children this node adopted, re-attachments to a new parent
    #: (or the server), the fall back to direct push/pull, and clocks sent again on the way.
    adopted: int = 0
    repairs: int = 0
    fallbacks: int = 0
    resent_clocks: int = 0
    #: Restarted workers this node took back as leaves (MLNET §3's recovered node re-entering),
    #: one entry per tree and re-entry.
    taken_back: list[int] = field(default_factory=list)
    #: When each re-attachment was answered (wall clock): the end of a repair or fall back.
    attached_at: list[float] = field(default_factory=list)
    #: (this worker's clock, the model clock of the copy it got) for every pull, every tree.
    pull_clocks: list[tuple[int, int | None]] = field(default_factory=list)

    @property
    def max_staleness(self) -> int | None:
        """The largest c_worker - c_model any of this worker's pulls returned."""
        lags = [c - m for c, m in self.pull_clocks if m is not None]
        return max(lags) if lags else None

    def as_dict(self) -> dict[str, Any]:
        return {"sums_forwarded": self.sums_forwarded, "updates_aggregated": self.updates_aggregated,
                "pulls_from_cache": self.pulls_from_cache, "pulls_upstream": self.pulls_upstream,
                "lost_children": self.lost_children, "max_staleness": self.max_staleness,
                "adopted": self.adopted, "repairs": self.repairs, "fallbacks": self.fallbacks,
                "resent_clocks": self.resent_clocks, "attached_at": self.attached_at, "taken_back": self.taken_back}


@dataclass
class _Sum:
    total: torch.Tensor
    workers: list[int]
    versions: list[int]


@dataclass
class _Clock:
    """What a node holds of one clock, per source member (itself or a child): its sums per
    model, and the workers its clock message named. A member's part counts once its clock
    arrived (``through``); a lost member's later parts are dropped (its subtree sends them again
    to the node that adopts it)."""

    parts: dict[int, dict[str, _Sum]] = field(default_factory=dict)
    clocked: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class _Copy:
    """The last model copy a node received for one model of one tree: its header as it came
    (passed on as it is) and its payload (the received buffer)."""

    model_clock: float
    meta: bytes
    payload: Any


@dataclass
class _Tree:
    """This node's place in server ``server``'s tree and what it holds for it."""

    server: int
    parent: int                      # worker index, -1: the server
    members: list[int]               # this worker, then its children (worker indices)
    through: dict[int, int]          # member -> last clock whose unit arrived
    final: set[int] = field(default_factory=set)    # members that left or were lost
    pending: dict[int, _Clock] = field(default_factory=dict)
    next_clock: int = 0
    leaves: list[tuple[int, list[int]]] = field(default_factory=list)  # (after clock, workers)
    done: bool = False
    cache: dict[str, _Copy] = field(default_factory=dict)
    waiting: dict[str, list[tuple[float, Any]]] = field(default_factory=dict)  # model -> (need, reply to)
    asked: dict[str, float] = field(default_factory=dict)  # model -> need of the request upstream
    #: The last clocks sent up (clock -> sums, workers clocked) and this node's own worker's
    #: pushes (clock -> sums), kept to send again to a new parent (repair, fall back).
    sent: dict[int, tuple[dict[str, _Sum], list[int]]] = field(default_factory=dict)
    own: dict[int, dict[str, _Sum]] = field(default_factory=dict)
    #: A re-attachment waiting for its answer (request id): nothing goes up meanwhile.
    attaching: int | None = None
    #: A restarted worker's node re-entering this tree: the answer of its new parent is
    #: awaited (``entering``), then the first clock that parent takes from it (``entry``;
    #: None: under the server, or the trees fell back).
    entering: bool = False
    entry: int | None = None
    #: The server rank a root-level node sends to: the server, or the replica it re-attached
    #: to after a failover (the worker's thread may redirect first; the node follows by
    #: re-attaching, never in the middle of a clock).
    server_rank: int = -1


class TreePort(Protocol):
    """What a tree node's core knows of the worker it runs for: its place in the job, the rank
    serving each server's shard now, and the failover it may ask for (a lost server whose
    replica takes over). The runtime hands it the worker (:class:`_WorkerTreePort`); the
    simulator its own (``sim/mlnet.py``)."""

    layout: "PSLayout"
    index: int
    rank: int
    who: str
    pull_staleness: float

    def server_rank(self, server: int) -> int: ...

    def fail_over(self, peer: int) -> bool: ...


@dataclass(frozen=True)
class _Headed:
    """What an action's message carries: a typed ``header`` (to a node with the ``tree`` it
    belongs to) encoded once, by the driver, or the ``meta`` a model copy arrived with (passed
    on as it is)."""

    header: protocol.Header | None = None
    tree: int | None = None
    meta: bytes | None = None

    @property
    def fields(self) -> dict[str, Any] | None:
        """The header as the receiver decodes it (the simulator hands it over without bytes)."""
        if self.header is None:
            return None
        return self.header.fields() if self.tree is None else self.header.fields(tree=self.tree)

    def encode(self) -> bytes:
        if self.meta is not None:
            return self.meta
        assert self.header is not None, "an mlnet action with neither a header nor a model copy's meta"
        return self.header.encode() if self.tree is None else self.header.encode(tree=self.tree)


@dataclass(frozen=True, kw_only=True)
class Send(_Headed):
    """An action of a tree node's core: send to rank ``peer`` ``on`` its ``"tree"`` tag (a node),
    its ``"request"`` tag (a server) or the ``"reply"`` tag of ``request_id``, with the header
    (:class:`_Headed`); ``payload`` a tensor, a received buffer or None. ``track``: the node's
    leave waits until the send is complete (``keep`` stays alive until then)."""

    peer: int
    on: str
    payload: Any = None
    request_id: int | None = None
    track: bool = True
    keep: Any = None


@dataclass(frozen=True, kw_only=True)
class Deliver(_Headed):
    """An action of a tree node's core: hand its own worker the answer to its pull
    ``request_id`` as from rank ``src`` (the server the node stands for): an error header, or
    the ``meta`` and ``payload`` of the model copy."""

    src: int
    request_id: int
    payload: Any = None


Action = Union[Send, Deliver]


class TreeCore:
    """A worker's node in every server's tree, without I/O (MLNET §3; module docstring): its
    worker's events, its children's messages, the answers from above, the peers lost and the
    time go in (``event``, ``from_child``, ``copy_arrived``, ``attached``, ``watch``,
    ``forward``); what it decides comes out as :class:`Send` and :class:`Deliver` actions in
    ``outbox``, in order (what to sum and when to forward it, what to answer from its copy and
    what to ask above, how to repair, re-attach or fall back). The runtime's
    :class:`TreeNode` drives it on a thread over the transport; the simulator's MLNET model
    (``sim/mlnet.py``) drives the same class over its network. ``lost``: the peers lost with
    why, as the driver sees them (the runtime hands the transport's live mapping)."""

    def __init__(self, port: TreePort, parents: np.ndarray, *, rejoining: bool = False) -> None:
        self.port = port
        self.layout = port.layout
        me = port.index
        self.parents = parents  # the trees as built: repairs walk them (first live ancestor)
        # clocks kept to send again: BSP runs a round or two ahead of the server, SSP(s) s + 1
        self.history = 4 + 2 * int(min(port.pull_staleness, 16))
        self.fallen_back = False
        self.lost: Mapping[int, str] = {}
        self._loss_seen: dict[int, float] = {}  # lost interior node rank -> when this node saw it
        self._attaching: dict[int, tuple[int, int]] = {}  # request id -> (tree, new parent rank)
        #: A restarted worker's node (:meth:`enter`): it re-enters every tree as a leaf, its
        #: children as built having been adopted when its old process was lost.
        self.rejoining = rejoining
        #: A restarted node: the clock the servers count it from (None until they have), and
        #: the re-entries of other restarted nodes asked of it meanwhile.
        self.rejoining_clock: int | None = None
        self._deferred: list[tuple[_Tree, int, dict[str, Any]]] = []
        #: Workers whose restarted process re-entered the trees as a leaf (their ``Reentered``
        #: note): repairs pass over them as over the lost, for their place as built is gone.
        self.reentered: set[int] = set()
        self.trees = [_Tree(server=j, parent=int(parents[j, me]),
                            members=[me] if rejoining else [me, *children_of(parents[j], me)],
                            through={m: -1 for m in ([me] if rejoining else [me, *children_of(parents[j], me)])},
                            server_rank=port.server_rank(j))
                      for j in range(self.layout.servers)]
        self.stats = NodeStats()
        self.error: PeerLostError | None = None
        self._ids = itertools.count(_NODE_IDS)
        self._asking: dict[int, tuple[int, str, int]] = {}  # request id -> (tree, model, upstream rank)
        self.outbox: list[Action] = []

    @property
    def who(self) -> str:
        return self.port.who

    def take_actions(self) -> list[Action]:
        out, self.outbox = self.outbox, []
        return out

    def waiting_replies(self) -> list[tuple[int, int]]:
        """(request id, rank) of every answer this node waits for: copies asked upstream and
        re-attachments (the driver hands each one to :meth:`copy_arrived` or :meth:`attached`)."""
        return [(rid, src) for rid, (_, _, src) in self._asking.items()] + \
            [(rid, src) for rid, (_, src) in self._attaching.items()]

    def finished(self) -> bool:
        return all(t.done for t in self.trees)

    # -- in: the worker's events, the children's messages, the answers from above ------------------

    def event(self, kind: str, *args: Any) -> None:
        me = self.port.index
        if kind == "push":
            j, model, clock, component, header = args
            self._add(self.trees[j], clock, me, model, component, [me], [int(header["version"])])
        elif kind == "clock":
            (clock,) = args
            for tree in self.trees:
                tree.pending.setdefault(clock, _Clock()).clocked[me] = [me]
                tree.through[me] = clock
        elif kind == "pull":
            j, header = args
            self._pull(self.trees[j], header["model"], ("own", int(header["id"]), int(header["clock"])),
                       int(header["clock"]) - self._staleness(header))
        elif kind == "leave":
            for tree in self.trees:
                tree.final.add(me)
                tree.leaves.append((tree.through[me], [me]))
        elif kind == "enter":
            self._enter_all(*args)
        elif kind == "rejoined":
            self._rejoined(*args)

    _event = event  # the hand-driven repair tests' name for it

    def _staleness(self, header: dict[str, Any]) -> float:
        s = header.get("staleness")
        return self.port.pull_staleness if s is None else float(s)

    def from_child(self, src: int, header: dict[str, Any], part: torch.Tensor | None = None) -> None:
        """A message from rank ``src``'s node on this node's tag (``part``: a sum's tensor)."""
        tree = self.trees[int(header["tree"])]
        child = self.layout.worker_index(src)
        if header["op"] == protocol.Reentered.OP:
            self.reentered.add(child)
            self._loss_seen.pop(src, None)  # its next loss is a new one (the fall-back window)
            return
        if header["op"] == protocol.ATTACH:
            if header.get("rejoin"):
                self._take_back(tree, child, header)
            else:
                self._attach_request(tree, child, header)
            return
        if header["op"] == FALL_BACK:
            if not self.fallen_back:
                self._fall_back(f"{self.layout.describe(src)} fell back ({header['why']})")
            return
        if child not in tree.members[1:]:
            log.error("%s: ignored mlnet %r from %s, not its child in server %d's tree", self.who,
                      header["op"], self.layout.describe(src), tree.server)
            return
        op = header["op"]
        if op in (protocol.PUSH, protocol.CLOCK) and int(header["clock"]) < tree.next_clock:
            # Never in the protocol (a member's clock c holds back c here); kept out of
            # `pending`, where it would hold the node's leave to the timeout.
            log.error("%s: dropped mlnet %s of clock %s from %s in server %d's tree: this node already sent "
                      "that clock up without it (its updates there are lost)", self.who, op, header["clock"],
                      self.layout.describe(src), tree.server)
            return
        if op == protocol.PUSH:
            assert part is not None
            self._add(tree, int(header["clock"]), child, header["model"], part, header["workers"], header["versions"])
        elif op == protocol.CLOCK:
            clock = int(header["clock"])
            tree.pending.setdefault(clock, _Clock()).clocked[child] = [int(w) for w in header["workers"]]
            tree.through[child] = clock
        elif op == protocol.LEAVE:
            if header["workers"]:
                tree.leaves.append((tree.through[child], [int(w) for w in header["workers"]]))
            if header.get("final"):
                tree.final.add(child)
        elif op == protocol.PULL:
            self._pull(tree, header["model"], ("child", src, int(header["id"])), float(header["need"]))
        else:
            log.error("%s: ignored unknown mlnet op %r from %s", self.who, op, self.layout.describe(src))

    def _add(self, tree: _Tree, clock: int, source: int, model: str, part: torch.Tensor, workers: list[int],
             versions: list[int]) -> None:
        """A member's sum of ``model`` for ``clock`` (it counts once the member's clock is in)."""
        parts = tree.pending.setdefault(clock, _Clock()).parts.setdefault(source, {})
        if model in parts:
            raise ValueError(f"{self.who}: two sums of {model!r} for clock {clock} from "
                             f"{self.layout.describe(self.layout.worker_rank(source))} in server {tree.server}'s tree")
        parts[model] = _Sum(part.clone(), list(workers), list(versions))

    def copy_arrived(self, request_id: int, header: dict[str, Any], meta: bytes, payload: Any) -> None:
        """The answer to a copy this node asked upstream (``header``: its decoded ``meta``)."""
        j, model, _ = self._asking.pop(request_id)
        tree = self.trees[j]
        waiting = tree.waiting.pop(model, [])
        tree.asked.pop(model, None)
        if header["op"] == "error":  # passed down: a lost ancestor is named to the whole subtree
            lost = header.get("lost_peer")
            message = header["message"] if lost is None else \
                f"{self.who}: its mlnet tree above it in server {tree.server}'s tree failed: {header['message']}"
            for _, reply_to in waiting:
                self._answer(tree, reply_to, None, error=message, lost_peer=lost)
            return
        clock = header.get("model_clock")
        copy = tree.cache[model] = _Copy(math.inf if clock is None else float(clock), meta, payload)
        still = []
        for need, reply_to in waiting:
            if copy.model_clock >= need:
                self._answer(tree, reply_to, copy)
            else:
                still.append((need, reply_to))
        if still:
            tree.waiting[model] = still
            self._ask(tree, model)

    # -- up the tree -------------------------------------------------------------------------------

    def _complete(self, tree: _Tree, clock: int) -> bool:
        return all(m in tree.final or tree.through[m] >= clock for m in tree.members)

    def forward(self) -> None:
        """Every tree: send up the clocks complete (:meth:`_forward`)."""
        for tree in self.trees:
            self._forward(tree)

    def _forward(self, tree: _Tree) -> None:
        """Send up every clock all members finished, then the leaves they cover (nothing while
        a re-attachment waits for its answer)."""
        if tree.attaching is not None:
            return
        me = self.port.index
        while tree.pending and tree.next_clock <= max(tree.pending) and self._complete(tree, tree.next_clock):
            clock = tree.next_clock
            entry = tree.pending.pop(clock)
            # the sources whose clock message for it came (a part counts only then), in the
            # members' order (same bits for the same tree); a member lost after its clock still
            # counts for that clock (its adopted children send only the later ones)
            counted = [m for m in tree.members if m in entry.clocked]
            counted += [m for m in entry.clocked if m not in tree.members]
            sums: dict[str, _Sum] = {}
            for m in counted:
                for model, part in entry.parts.get(m, {}).items():
                    total = sums.get(model)
                    if total is None:
                        sums[model] = _Sum(part.total.clone(), list(part.workers), list(part.versions))
                    else:
                        total.total.add_(part.total)
                        total.workers += part.workers
                        total.versions += part.versions
            clocked = [w for m in counted for w in entry.clocked.get(m, [])]
            self._send_clock(tree, clock, sums, clocked)
            self._keep(tree.sent, clock, (sums, clocked))
            if me in counted and me in entry.parts:
                self._keep(tree.own, clock, entry.parts[me])
            tree.next_clock += 1
        ready = [workers for after, workers in tree.leaves if after < tree.next_clock]
        tree.leaves = [(after, workers) for after, workers in tree.leaves if after >= tree.next_clock]
        if ready:
            self._up(tree, protocol.TreeLeave(workers=[w for ws in ready for w in ws], final=False))
        if not tree.done and len(tree.final) == len(tree.members) and not tree.pending and not tree.leaves:
            tree.done = True
            if tree.parent >= 0:
                self._up(tree, protocol.TreeLeave(workers=[], final=True))

    def _send_clock(self, tree: _Tree, clock: int, sums: dict[str, _Sum], clocked: list[int]) -> None:
        """One clock up: its sums (one per model), then the clock naming the workers it covers."""
        for model, entry in sums.items():
            to_server = tree.parent < 0  # as an aggregate update
            self._up(tree, protocol.TreeSum(
                model=model, clock=clock, workers=entry.workers, versions=entry.versions,
                dtype=str(entry.total.dtype).removeprefix("torch."),
                version=min(entry.versions) if to_server else None,
                norm=float(torch.linalg.vector_norm(entry.total)) if to_server else None), entry.total)
            self.stats.sums_forwarded += 1
            self.stats.updates_aggregated += len(entry.workers)
        if clocked:
            self._up(tree, protocol.TreeClock(clock=clock, workers=clocked))

    def _keep(self, kept: dict[int, Any], clock: int, what: Any) -> None:
        kept[clock] = what
        for old in [c for c in kept if c <= clock - self.history]:
            del kept[old]

    def _up(self, tree: _Tree, header: protocol.Header, payload: torch.Tensor | None = None) -> None:
        if tree.parent < 0:
            # the server this node is attached to, not the worker's current one: a sum and its
            # clock must reach the same server (a failover re-attaches, then sends them again)
            peer, on, which = tree.server_rank, "request", None
        else:
            peer, on, which = self.layout.worker_rank(tree.parent), "tree", tree.server
        if peer in self.lost:
            return  # watch() reports it
        self.outbox.append(Send(peer=peer, on=on, header=header, tree=which, payload=payload, keep=payload))

    # -- down the tree -----------------------------------------------------------------------------

    def _pull(self, tree: _Tree, model: str, reply_to: Any, need: float) -> None:
        copy = tree.cache.get(model)
        if copy is not None and copy.model_clock >= need:
            self.stats.pulls_from_cache += 1
            self._answer(tree, reply_to, copy)
            return
        tree.waiting.setdefault(model, []).append((need, reply_to))
        self._ask(tree, model)

    def _ask(self, tree: _Tree, model: str) -> None:
        """One request upstream for what the most demanding waiting pull needs (none if one
        already on the way asks for as much)."""
        need = max(n for n, _ in tree.waiting[model])
        if tree.asked.get(model, -math.inf) >= need:
            return
        request_id = next(self._ids)
        tree.asked[model] = need
        self.stats.pulls_upstream += 1
        if tree.parent < 0:
            src = tree.server_rank
            self._up(tree, protocol.Pull(id=request_id, model=model, clock=math.ceil(need), staleness=0))
        else:
            src = self.layout.worker_rank(tree.parent)
            self._up(tree, protocol.TreePull(id=request_id, model=model, need=need))
        self._asking[request_id] = (tree.server, model, src)

    def _answer(self, tree: _Tree, reply_to: Any, copy: _Copy | None, error: str | None = None,
                lost_peer: int | None = None) -> None:
        """Answer with ``copy`` (or ``error``; ``lost_peer``: the worker raises PeerLostError naming it)."""
        header = None if copy is not None else protocol.ErrorReply(message=str(error), lost_peer=lost_peer)
        meta = copy.meta if copy is not None else None
        payload = None if copy is None else copy.payload
        if reply_to[0] == "own":
            _, request_id, clock = reply_to
            if copy is not None:
                self.stats.pull_clocks.append((clock, None if math.isinf(copy.model_clock) else int(copy.model_clock)))
            # To the worker as from the server this node stands for (what its pull waits on).
            self.outbox.append(Deliver(src=self.port.server_rank(tree.server), request_id=request_id, header=header,
                                       meta=meta, payload=payload))
            return
        _, rank, request_id = reply_to
        if rank not in self.lost:  # the received buffer stays alive until sent
            self.outbox.append(Send(peer=rank, on="reply", header=header, meta=meta, payload=payload,
                                    request_id=request_id, keep=copy))

    # -- failures ----------------------------------------------------------------------------------

    def watch(self, gone: dict[int, str], now: float) -> None:
        """Repair (MLNET §3): a lost child's children are adopted; a lost parent is replaced by
        the first live ancestor (or the server); two tree nodes lost within FALLBACK_WINDOW_S
        tear the trees down (:meth:`_fall_back`). A lost server, or a peer that closed its
        transport without leaving the tree, fails the worker's next call, naming it (a lost server
        a replica takes over is re-attached to instead). ``gone``: every peer gone with why
        (lost, or closed without leaving), as the driver saw them before handing this node the
        messages that had arrived (their last messages are in); ``now``: a monotonic time."""
        if self.error is not None:
            return
        for rank in self.lost:
            if self.layout.role(rank) == "worker" and self._interior(self.layout.worker_index(rank)):
                self._loss_seen.setdefault(rank, now)
        recent = [t for t in self._loss_seen.values() if now - t <= FALLBACK_WINDOW_S]
        if not self.fallen_back and len(recent) >= 2:
            self._fall_back(f"{len(recent)} tree nodes lost within {FALLBACK_WINDOW_S:g} s")
        for tree in self.trees:
            for child in list(tree.members[1:]):
                rank = self.layout.worker_rank(child)
                why = None if child in tree.final else gone.get(rank)
                if why is None:
                    continue
                if rank in self.lost:
                    self._adopt(tree, child, why)
                else:
                    tree.final.add(child)
                    self.stats.lost_children.append(child)
                    log.warning("%s: mlnet child %s in server %d's tree is gone (%s); going on without its "
                                "subtree's later updates", self.who, self.layout.describe(rank), tree.server, why)
            if tree.done:
                continue
            parent = tree.server_rank if tree.parent < 0 else self.layout.worker_rank(tree.parent)
            why = gone.get(parent)
            if why is None:
                continue
            if tree.parent >= 0 and parent in self.lost:
                if tree.entering:  # its answer will never come: the next live ancestor
                    self._enter(tree)
                elif self.rejoining:
                    # A re-entered leaf: the subtree its lost parent's adopter takes over is the
                    # one as built, without it; a second failure here tears the trees down.
                    self._fall_back(f"the parent {self.layout.describe(parent)} of re-entered "
                                    f"{self.layout.describe(self.port.rank)} in server {tree.server}'s tree is gone")
                else:
                    self._reattach(tree, tree.parent, why)
                continue
            if tree.parent < 0 and parent in self.lost and self.port.fail_over(parent):
                # MLNET §3's failed root, waited for and reconnected: a replica takes the server's
                # place (ps/replica.py); the node attaches to it and sends the clocks it lacks.
                # (The worker's own thread may have failed over first: True here too.)
                log.warning("%s: mlnet server %s of tree %d is gone (%s); re-attaching to %s, which takes over",
                            self.who, self.layout.describe(parent), tree.server, why,
                            self.layout.describe(self.port.server_rank(tree.server)))
                self.stats.repairs += 1
                self._attach(tree)
                continue
            role = "server" if tree.parent < 0 else "parent node"
            self.fail(PeerLostError(
                f"{self.who}: its mlnet {role} {self.layout.describe(parent)} in server {tree.server}'s "
                f"tree is gone ({why}); restart the job", rank=self.port.rank, peer=parent))
            return


    def _interior(self, worker: int) -> bool:
        """Whether ``worker`` has children in some server's tree (as built)."""
        return any(children_of(self.parents[j], worker) for j in range(len(self.trees)))

    def _gone_as_built(self, worker: int) -> bool:
        """Whether ``worker``'s place in the trees as built is empty: lost, or re-entered as a
        leaf elsewhere (its children as built were adopted when it was lost)."""
        return self.layout.worker_rank(worker) in self.lost or worker in self.reentered

    def _live_below(self, tree: _Tree, worker: int) -> list[int]:
        """The children of ``worker`` in ``tree`` as built, a gone one (lost or re-entered)
        replaced by its own."""
        out = []
        for child in children_of(self.parents[tree.server], worker):
            if self._gone_as_built(child):
                out += self._live_below(tree, child)
            else:
                out.append(child)
        return out

    def _adopt(self, tree: _Tree, lost: int, why: str) -> None:
        """Child ``lost`` is gone: its children (or theirs, if lost too) become this node's
        members, counted as through the lost child's last clock here; its later parts are
        dropped (the adopted subtrees send them again, :meth:`attached`)."""
        last = tree.through.pop(lost)
        tree.members.remove(lost)
        tree.final.discard(lost)
        for clock, entry in tree.pending.items():
            if clock > last:
                entry.parts.pop(lost, None)
                entry.clocked.pop(lost, None)
        # a re-entered leaf has no subtree here (its children as built went elsewhere)
        orphans = [] if self.fallen_back or lost in self.reentered else \
            [o for o in self._live_below(tree, lost) if o not in tree.members]
        for orphan in orphans:
            tree.members.append(orphan)
            tree.through[orphan] = last
        self.stats.lost_children.append(lost)
        self.stats.adopted += len(orphans)
        log.warning("%s: mlnet child %s in server %d's tree is gone (%s); adopting %s (from clock %d on)",
                    self.who, self.layout.describe(self.layout.worker_rank(lost)), tree.server, why,
                    ", ".join(self.layout.describe(self.layout.worker_rank(o)) for o in orphans) or "nobody",
                    last + 1)

    def _reattach(self, tree: _Tree, lost: int, why: str) -> None:
        """The parent node is lost: attach to its first live ancestor as built (or the server)."""
        new = self._live_ancestor(tree, lost)
        log.warning("%s: mlnet parent %s in server %d's tree is gone (%s); re-attaching to %s", self.who,
                    self.layout.describe(self.layout.worker_rank(lost)), tree.server, why,
                    "the server" if new < 0 else self.layout.describe(self.layout.worker_rank(new)))
        tree.parent = new
        self.stats.repairs += 1
        self._attach(tree)

    def _live_ancestor(self, tree: _Tree, worker: int) -> int:
        """The first ancestor of ``worker`` as built whose place is not gone (-1: the server)."""
        new = int(self.parents[tree.server, worker])
        while new >= 0 and self._gone_as_built(new):
            new = int(self.parents[tree.server, new])
        return new

    def _attach(self, tree: _Tree) -> None:
        """Ask the new parent (node or server) for the last clock it has of this subtree;
        nothing goes up until the answer (:meth:`attached`). Pulls asked of the old parent are
        asked again."""
        lost_asks = [rid for rid, (j, _, _) in self._asking.items() if j == tree.server]
        for rid in lost_asks:
            del self._asking[rid]
        tree.asked.clear()
        request_id = next(self._ids)
        tree.attaching = request_id
        if tree.parent < 0:
            dest = tree.server_rank = self.port.server_rank(tree.server)
            covered = tree.sent[max(tree.sent)][1] if tree.sent and not self.fallen_back else [self.port.index]
            self.outbox.append(Send(peer=dest, on="request", header=protocol.Attach(id=request_id, workers=covered),
                                    track=False))
        else:
            dest = self.layout.worker_rank(tree.parent)
            self.outbox.append(Send(peer=dest, on="tree", header=protocol.Attach(id=request_id), tree=tree.server,
                                    track=False))
        self._attaching[request_id] = (tree.server, dest)

    def _attach_request(self, tree: _Tree, child: int, header: dict[str, Any]) -> None:
        """A node re-attaches here: adopt the lost members above it if this node has not seen
        them go yet, and answer with the last clock this node has of its subtree."""
        while child not in tree.members:
            above = next((m for m in tree.members[1:] if m not in self.reentered
                          and child in subtree_of(self.parents[tree.server], m)), None)
            if self.fallen_back:
                log.error("%s: ignored an mlnet re-attachment of %s in server %d's tree (the trees fell back)",
                          self.who, self.layout.describe(self.layout.worker_rank(child)), tree.server)
                return
            if above is None:
                # Not below this node as the trees are now (failures around a re-entered node):
                # rather than leave the subtree waiting, tear the trees down (MLNET §3).
                self._fall_back(f"{self.layout.describe(self.layout.worker_rank(child))} re-attached in server "
                                f"{tree.server}'s tree to a node it is not below")
                return
            self._adopt(tree, above, "its child re-attached here")
        self.outbox.append(Send(peer=self.layout.worker_rank(child), on="reply", request_id=int(header["id"]),
                                header=protocol.Attached(through=tree.through[child]), track=False))

    def attached(self, request_id: int, through: int, wall: float, *, fell_back: bool = False) -> None:
        """The new parent has this subtree's clocks up to ``through``: send the later ones
        again (the sums kept; after a fall back, this worker's own pushes), then go on.
        ``wall``: the wall-clock time (``stats.attached_at``). To a re-entering node
        (:meth:`enter`): the parent takes it from clock ``through + 1``, or (``fell_back``) the
        trees are torn down and it goes directly to the servers."""
        j, _ = self._attaching.pop(request_id)
        tree = self.trees[j]
        if tree.attaching != request_id:
            return  # superseded by a later re-attachment
        tree.attaching = None
        if tree.entering:
            tree.entering = False
            if fell_back and not self.fallen_back:
                self._fall_back_alone()
            elif not fell_back:
                tree.entry = through + 1
            return
        self.stats.attached_at.append(wall)
        kept = tree.own if self.fallen_back else tree.sent
        missing = list(range(through + 1, tree.next_clock))
        if any(c not in kept for c in missing):
            self.fail(PeerLostError(
                f"{self.who}: re-attached in server {tree.server}'s mlnet tree, which has this subtree's "
                f"clocks up to {through}, but this node kept only clocks {min(kept, default='none')}.."
                f"{max(kept, default='none')}: the updates in between are lost; restart the job",
                rank=self.port.rank))
            return
        me = self.port.index
        for clock in missing:
            if self.fallen_back:
                self._send_clock(tree, clock, kept[clock], [me] if tree.through.get(me, -1) >= clock else [])
            else:
                self._send_clock(tree, clock, *kept[clock])
            self.stats.resent_clocks += 1
        for model in list(tree.waiting):
            self._ask(tree, model)

    # -- a restarted worker re-enters the trees (MLNET §3) ------------------------------------------

    def _enter_all(self, endpoints: dict[str, str]) -> None:
        """This node's worker was restarted (``rejoining``): tell every reachable worker it is
        back at ``endpoints`` (they send to it again and pass over its place as built in their
        repairs), then ask each tree's first live ancestor to take it as a leaf. The peers lost
        when it came back are old losses: they do not count toward the fall-back window."""
        for rank in self.lost:
            self._loss_seen[rank] = -math.inf
        note = protocol.Reentered(tree=0, endpoints=dict(endpoints))
        for rank in self.layout.worker_ranks:
            if rank != self.port.rank and rank not in self.lost:
                self.outbox.append(Send(peer=rank, on="tree", header=note, track=False))
        for tree in self.trees:
            self._enter(tree)

    def _enter(self, tree: _Tree) -> None:
        """Ask the first live ancestor as built (none: the server, which takes the worker back
        itself) to take this node as a leaf of ``tree``."""
        self._forget_attach(tree)  # asked of a parent lost since: its answer will not come
        tree.parent = self._live_ancestor(tree, self.port.index)
        tree.entering = tree.parent >= 0 and not self.fallen_back
        if not tree.entering:
            return
        request_id = next(self._ids)
        tree.attaching = request_id
        dest = self.layout.worker_rank(tree.parent)
        self.outbox.append(Send(peer=dest, on="tree", header=protocol.Attach(id=request_id, rejoin=True),
                                tree=tree.server, track=False))
        self._attaching[request_id] = (tree.server, dest)

    def entered(self) -> bool:
        """Whether every tree's new parent answered (:meth:`enter`)."""
        return not any(tree.entering for tree in self.trees)

    def entering_parents(self) -> list[int]:
        """The ranks whose answer a re-entering node still waits for."""
        return [self.layout.worker_rank(t.parent) for t in self.trees if t.entering]

    def entry_clock(self) -> int:
        """The first clock every new parent can take this node at (0: none asked)."""
        return max((t.entry for t in self.trees if t.entry is not None), default=0)

    def _rejoined(self, clock: int) -> None:
        """The servers count this worker from ``clock``: each new parent gets an empty clock
        for every clock from its entry to there (it forwards them without this worker), and
        the node's own clocks start at ``clock``."""
        me = self.port.index
        for tree in self.trees:
            if tree.parent >= 0 and tree.entry is not None:
                for filler in range(tree.entry, clock):
                    self._up(tree, protocol.TreeClock(clock=filler, workers=[]))
            tree.next_clock = clock
            tree.through[me] = clock - 1
        self.rejoining_clock = clock
        self._answer_deferred()

    def _take_back(self, tree: _Tree, child: int, header: dict[str, Any]) -> None:
        """A restarted worker's node asks to re-enter ``tree`` below this node: it becomes a leaf
        member from the next clock this node sends up (what its old process left here counts
        as for any lost child), answered with the last clock sent up without it."""
        if self.rejoining and self.rejoining_clock is None and not self.fallen_back:
            # Restarted itself and not yet counted again: its first clock is not known, so the
            # child's would be guessed; it is answered once the servers have counted this one.
            self._deferred.append((tree, child, header))
            return
        rank = self.layout.worker_rank(child)
        reply = {"peer": rank, "on": "reply", "request_id": int(header["id"]), "track": False}
        if self.fallen_back:
            self.outbox.append(Send(**reply, header=protocol.Attached(through=-1, fell_back=True)))
            return
        if child in tree.members:  # its old process's loss not handled yet: handle it first
            self._adopt(tree, child, "restarted")
        tree.members.append(child)
        tree.through[child] = tree.next_clock - 1
        tree.final.discard(child)
        self.stats.taken_back.append(child)
        log.warning("%s: restarted %s re-enters server %d's mlnet tree here, as a leaf, from clock %d", self.who,
                    self.layout.describe(rank), tree.server, tree.next_clock)
        self.outbox.append(Send(**reply, header=protocol.Attached(through=tree.next_clock - 1)))

    def _fall_back_alone(self) -> None:
        """A re-entering node learns the trees fell back: it goes directly to the servers
        (its rejoin asks them for its clock), telling nobody (everyone else already did)."""
        self.fallen_back = True
        self.stats.fallbacks += 1
        for tree in self.trees:
            tree.parent, tree.entering, tree.entry = -1, False, None
            self._forget_attach(tree)
        self._answer_deferred()

    def _forget_attach(self, tree: _Tree) -> None:
        """Stop waiting for the answer to ``tree``'s attachment (it will not come, or no longer
        matters)."""
        if tree.attaching is not None:
            self._attaching.pop(tree.attaching, None)
            tree.attaching = None

    def _answer_deferred(self) -> None:
        """Answer the re-entries held while this node was not yet counted (:meth:`_take_back`):
        now that it is, or that the trees fell back (they are told so)."""
        deferred, self._deferred = self._deferred, []
        for tree, child, header in deferred:
            self._take_back(tree, child, header)

    def _fall_back(self, why: str) -> None:
        """Several tree nodes lost at once (MLNET §3): tear the trees down; every worker pushes
        and pulls directly to the servers from now on, sending again what they lack of its own
        updates. Every other node is told to do the same."""
        self.fallen_back = True
        self.stats.fallbacks += 1
        me = self.port.index
        log.warning("%s: %s: the mlnet trees are torn down, every worker pushes and pulls directly to the servers",
                    self.who, why)
        for tree in self.trees:
            children = tree.members[1:]
            tree.members = [me]
            tree.entering, tree.entry = False, None
            for entry in tree.pending.values():
                for child in children:
                    entry.parts.pop(child, None)
                    entry.clocked.pop(child, None)
            for child in children:
                tree.through.pop(child, None)
                tree.final.discard(child)
            if tree.done:
                continue
            tree.parent = -1
            self._attach(tree)
        for rank in self.layout.worker_ranks:
            if rank != self.port.rank and rank not in self.lost:
                self.outbox.append(Send(peer=rank, on="tree", header=protocol.FallBack(tree=0, why=why), track=False))
        self._answer_deferred()

    def fail(self, error: PeerLostError) -> None:
        """Every waiting pull and the worker's next call get ``error``."""
        self.error = error
        for tree in self.trees:
            for waiting in tree.waiting.values():
                for _, reply_to in waiting:
                    self._answer(tree, reply_to, None, error=str(error), lost_peer=error.peer)
            tree.waiting.clear()
            tree.done = True



class _WorkerTreePort:
    """The runtime's :class:`TreePort`: the worker the node runs in."""

    def __init__(self, worker: "WorkerPort") -> None:
        self.worker = worker
        self.layout = worker.layout
        self.index = worker.index
        self.rank = worker.transport.rank
        self.who = worker.who
        self.pull_staleness = worker.config.consistency.pull_staleness

    def server_rank(self, server: int) -> int:
        return self.worker.server_rank(server)

    def fail_over(self, peer: int) -> bool:
        return self.worker.fail_over(peer)


class TreeNode:
    """The runtime's driver of a worker's :class:`TreeCore` (the host proxy, module docstring):
    a thread that hands the core its worker's events, its children's messages (decoded once
    here), the answers from above and the peers gone, and carries out the core's actions over
    the transport (headers encoded once here)."""

    def __init__(self, worker: "WorkerPort", parents: np.ndarray, *, rejoining: bool = False) -> None:
        self.worker = worker
        self.transport = worker.transport
        self.layout = worker.layout
        self.session = worker.config.session
        self.channel = worker.channel
        self.tag = protocol.tag(protocol.TREE, self.session)
        self.core = TreeCore(_WorkerTreePort(worker), parents, rejoining=rejoining)
        self.core.lost = self.transport.lost_peers  # the transport's live mapping
        self._entered = threading.Event()
        if rejoining:  # before the thread runs: the peers lost by now are old losses
            self.core.event("enter", dict(getattr(self.transport, "endpoints", {})))
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        #: Sends not yet complete: (peer, handle, what must stay alive until then).
        self._sending: list[tuple[int, SendHandle, Any]] = []
        #: Every action carried out, when set (a test compares them with the simulator's driver).
        self.record: list[Action] | None = None
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mlfabric-mlnet-node-{worker.index}", daemon=True)
        self._thread.start()

    @property
    def trees(self) -> list[_Tree]:
        return self.core.trees

    @property
    def stats(self) -> NodeStats:
        return self.core.stats

    @property
    def error(self) -> PeerLostError | None:
        return self.core.error

    # -- from the worker's thread --------------------------------------------------------------

    def submit(self, *event: Any) -> None:
        if self.core.error is not None:
            raise self.core.error
        self._events.append(event)
        self.transport.mailbox.notify()

    def wait_entered(self, timeout: float) -> int:
        """A restarted worker's node: wait until every tree's new parent took it back
        (:meth:`TreeCore._enter_all`); returns the first clock they all can take it at. Raises
        PeerLostError naming a parent that did not answer within ``timeout``."""
        self.transport.mailbox.notify()
        if not self._entered.wait(timeout):
            if self.core.error is not None:
                raise self.core.error
            waiting = self.core.entering_parents()
            raise PeerLostError(f"{self.worker.who}: rejoin: no answer within {timeout:g} s from its new mlnet "
                                f"parent(s) {', '.join(self.layout.describe(r) for r in waiting)}; restart it again "
                                "or the job", rank=self.transport.rank, peer=waiting[0] if waiting else None)
        if self.core.error is not None:
            raise self.core.error
        return self.core.entry_clock()

    def leave(self, timeout: float) -> None:
        """The worker leaves: serve the children until their subtrees left, then stop."""
        self._events.append(("leave",))
        self.transport.mailbox.notify()
        if not self._finished.wait(timeout):
            waiting = sorted({self.layout.describe(self.layout.worker_rank(m)) for t in self.trees
                              for m in t.members[1:] if m not in t.final})
            log.error("%s: mlnet node stopped after %g s with children still in the job (%s); their later "
                      "updates are lost", self.worker.who, timeout, ", ".join(waiting) or "none")
        self._stop.set()
        self.transport.mailbox.notify()
        self._thread.join(timeout)

    # -- the node's thread -------------------------------------------------------------------------

    def _run(self) -> None:
        mailbox = self.transport.mailbox
        try:
            while not self._stop.is_set():
                version = mailbox.version
                if self._pass():
                    self._finished.set()
                    return
                if not self._events:  # submit() bumps the mailbox's version: no wake-up is missed
                    self.transport.progress(version, _IDLE_S)
        except TransportError:
            if not self.transport.closed:  # closed under it: the worker's process is going away
                raise
            self._finished.set()
        except BaseException as exc:  # noqa: BLE001 - reported to the worker's next call
            log.exception("%s: mlnet node failed", self.worker.who)
            error = PeerLostError(f"{self.worker.who}: its mlnet tree node failed ({exc!r}); restart the job",
                                  rank=self.transport.rank)
            try:
                self.core.fail(error)  # the waiting pulls get it at once
                self._carry_out()
            except Exception:  # noqa: BLE001 - the worker's next call still raises it
                self.core.error = error
            self._finished.set()

    def _pass(self) -> bool:
        """One turn of the node: the worker's events, the children's messages, the replies,
        the peers gone, then every clock ready goes up. True once every tree is done."""
        mailbox = self.transport.mailbox
        core = self.core
        # Taken before the mailbox is drained: a peer's messages reach the mailbox before its
        # goodbye or its connection's end, so every message of a peer seen gone here is
        # handled below before watch() acts on its going.
        gone = self._gone_peers()
        while self._events:
            core.event(*self._events.popleft())
        readmitted = []
        while (msg := mailbox.take(self.channel, self.tag)) is not None:
            readmitted += self._from_child(msg)
        for rank in readmitted:  # back since the snapshot: not gone
            gone.pop(rank, None)
        for request_id, src in core.waiting_replies():
            msg = mailbox.take(self.channel, protocol.reply_tag(self.session, request_id), src)
            if msg is None:
                continue
            header = protocol.decode(msg.meta)
            if header["op"] == "attached":
                core.attached(request_id, int(header["through"]), time.time(), fell_back=bool(header.get("fell_back")))
            else:
                core.copy_arrived(request_id, header, bytes(msg.meta), msg.payload)
        core.watch(gone, time.monotonic())
        if core.entered() or core.error is not None:
            self._entered.set()
        core.forward()
        self._carry_out()
        # A send to a peer gone never completes (the transports' contract): forget it.
        gone_now = self.transport.gone_peers
        self._sending = [(p, h, x) for p, h, x in self._sending if not h.done() and p not in gone_now]
        return core.finished() and not self._sending

    def _from_child(self, msg: Message) -> list[int]:
        """A message on the tree tag: decoded once, a sum's payload viewed as its tensor; a
        restarted worker's note that it is back readmits it on the transport first (returned:
        the rank readmitted, if so)."""
        header = protocol.decode(msg.meta)
        if header["op"] == protocol.Reentered.OP:
            try:
                self.transport.readmit(msg.src, header["endpoints"])
            except (TransportError, AttributeError) as exc:  # AttributeError: not a tcp transport
                log.error("%s: cannot send to restarted %s (%s); it stays lost here", self.worker.who,
                          self.layout.describe(msg.src), exc)
                return []
            self.core.from_child(msg.src, header)
            return [msg.src]
        part = None
        if header["op"] == protocol.PUSH:
            dtype = getattr(torch, header["dtype"])
            numel = msg.payload.nbytes // torch.empty((), dtype=dtype).element_size()
            part = payload_tensor(msg.payload, dtype, numel, f"mlnet sum from {self.layout.describe(msg.src)}")
        self.core.from_child(msg.src, header, part)
        return []

    def _carry_out(self) -> None:
        """The core's actions, in order, over the transport."""
        for action in self.core.take_actions():
            if self.record is not None:
                self.record.append(action)
            if isinstance(action, Deliver):
                meta = action.encode()
                payload = memoryview(b"") if action.payload is None else action.payload
                self.transport.mailbox.put(Message(src=action.src, tag=protocol.reply_tag(self.session,
                                                                                          action.request_id),
                                                   channel=self.channel, meta=meta, payload=payload))
                continue
            tag = {"tree": self.tag, "request": protocol.request_tag(self.session)}.get(action.on)
            if tag is None:
                tag = protocol.reply_tag(self.session, action.request_id)
            meta = action.encode()
            payload = action.payload
            data = b"" if payload is None else tensor_bytes(payload) if isinstance(payload, torch.Tensor) else payload
            handle = self.transport.send(action.peer, tag, data, meta=meta, channel=self.channel)
            if action.track:
                self._sending.append((action.peer, handle, action.keep))

    def _gone_peers(self) -> dict[int, str]:
        """Every peer gone now, with why (lost, or closed before its subtree's final leave)."""
        gone = {rank: f"lost: {why}" for rank, why in self.transport.lost_peers.items()}
        for rank in self.transport.departed_peers:
            gone.setdefault(rank, "it closed its transport without leaving the tree")
        return gone


class MLNetRouting(Policy):
    """The ``mlnet`` routing policy (module docstring). On a worker, its tree node carries the
    pushes, clocks and pulls; on a server, a node's sums are staged until that node's clock
    comes (a node that dies between the two leaves nothing half-applied: its subtree sends
    them again), and servers answer the pulls that reach them (the root-level nodes') as with
    direct routing."""

    name = "mlnet"
    commits_on_clock = True
    #: A restarted worker re-enters the trees as a leaf (MLNET §3; :meth:`before_rejoin`).
    takes_back_workers = True
    rejoin_reaches_workers = True

    def __init__(self, settings: MLNetSettings | None = None) -> None:
        self.settings = settings or MLNetSettings()
        self.node: TreeNode | None = None
        self._lock = threading.Lock()
        #: A server's tree sums per (node rank, clock) waiting for that node's clock message.
        self._staged: dict[tuple[int, int], list[tuple[dict[str, Any], memoryview]]] = {}

    def validate(self, config: "PSConfig") -> None:
        if config.consistency.kind not in ("bsp", "ssp"):
            raise ValueError(f"routing 'mlnet' runs on MLNET's clocks: consistency bsp or ssp:S, got {config.consistency}")

    def tree_parents(self, workers: int, servers: int, worker_ranks: list[int]) -> np.ndarray:
        return self.settings.parents(workers, servers, worker_ranks)

    # -- worker side -----------------------------------------------------------------------------

    def _node(self, worker: "WorkerPort", *, rejoining: bool = False) -> TreeNode:
        with self._lock:
            if self.node is None:
                if worker.config.consistency.kind not in ("bsp", "ssp"):
                    raise ValueError(f"{worker.who}: mlnet routing runs BSP or SSP (MLNET's clocks), got "
                                     f"consistency {worker.config.consistency}")
                layout = worker.layout
                self.node = TreeNode(worker, self.settings.parents(layout.workers, layout.servers,
                                                                   list(layout.worker_ranks)), rejoining=rejoining)
            return self.node

    def send_push(self, worker: "WorkerPort", model: str, components: list[torch.Tensor],
                  pushes: list[protocol.Push]) -> list[SendHandle]:
        node = self._node(worker)
        for j, (component, push) in enumerate(zip(components, pushes)):
            node.submit("push", j, model, push.clock, component.detach().clone(), push.fields())
        return []  # the node holds copies: the worker may reuse its tensors at once

    def send_clock(self, worker: "WorkerPort", clock: int) -> bool:
        """The worker finished iteration ``clock``: its node sends it up with the sums."""
        self._node(worker).submit("clock", clock)
        return True

    def send_pull(self, worker: "WorkerPort", pulls: list[protocol.Pull], *,
                  clocks: list[bytes] | None = None) -> None:
        if clocks is not None:  # the worker hands clocks to send_clock here (they go with the sums)
            raise ValueError(f"{worker.who}: under mlnet a clock travels up the trees, not with a pull")
        node = self._node(worker)
        for j, pull in enumerate(pulls):
            node.submit("pull", j, pull.fields())

    def after_failover(self, worker: "WorkerPort", replica: int) -> None:
        """The worker's tree node re-attaches to the replica and tells it the clocks (no ADOPT)."""

    def before_rejoin(self, worker: "WorkerPort", incarnation: int) -> int:
        """MLNET §3's recovered node: the restarted worker's node re-enters every tree as a leaf
        of its first live ancestor and returns the first clock they all take it at."""
        if self.node is not None:
            raise ValueError(f"{worker.who}: rejoin must come before any push, pull or clock")
        return self._node(worker, rejoining=True).wait_entered(worker.config.timeout_s)

    def after_rejoin(self, worker: "WorkerPort", clock: int) -> None:
        self._node(worker).submit("rejoined", clock)

    def flush(self, timeout: float) -> None:
        """The worker leaves: its node forwards what it holds and serves its children until
        they have left (at most ``timeout`` s)."""
        if self.node is not None:
            self.node.leave(timeout)

    @property
    def stats(self) -> NodeStats:
        return self.node.stats if self.node is not None else NodeStats()

    def worker_report(self) -> dict[str, Any] | None:
        return {"mlnet": self.stats.as_dict()} if self.node is not None else None

    # -- server side -----------------------------------------------------------------------------

    def claim_push(self, server: "ServerPort", worker: int, header: dict[str, Any], payload: memoryview) -> bool:
        """A node's sum (it names its ``workers``) counts once the node's clock for it arrives."""
        if "workers" not in header or header.get("committed"):
            return False
        rank = server.layout.worker_rank(worker)
        self._staged.setdefault((rank, int(header["clock"])), []).append((header, memoryview(bytes(payload))))
        return True

    def before_clock(self, server: "ServerPort", rank: int, worker: int, clock: int) -> None:
        for staged_header, staged in self._staged.pop((rank, clock), []):
            server.receive_push(worker, {**staged_header, "committed": True}, staged)

    def after_clock(self, server: "ServerPort", workers: list[int], clock: int) -> None:
        # the replicas learn the clocks behind the updates they hold: one that takes over
        # tells re-attaching tree nodes which clocks to send again
        for replica in server.replicas:
            server.send_replica(replica, protocol.TreeClock(clock=clock, workers=workers).encode(), b"")

    def on_lost(self, server: "ServerPort", rank: int) -> None:
        for key in [k for k in self._staged if k[0] == rank]:  # sums whose clock never came: sent again
            del self._staged[key]

    def claim_message(self, server: "ServerPort", src: int, header: dict[str, Any], payload: memoryview) -> bool:
        """ATTACH: a node re-attaching here after a repair or fall back learns the last clock
        this server has of its subtree (it sends the later ones again)."""
        if header.get("op") != protocol.ATTACH:
            return False
        book = server.book
        workers = [int(w) for w in header["workers"]]
        alive = [w for w in workers if w not in book.departed and w not in book.lost_at] or workers
        through = min(book.clocks[w] for w in alive) - 1
        server.transport.send(src, protocol.reply_tag(server.config.session, int(header["id"])), b"",
                              meta=protocol.Attached(through=through).encode(), channel=server.channel)
        return True


def _factory(config: "PSConfig") -> Policy:
    return MLNetRouting(config.mlnet)


register_policy("mlnet", _factory)

__all__ = ["Deliver", "MLNetRouting", "MLNetSettings", "NodeStats", "Send", "TreeCore", "TreeNode", "TreePort"]
