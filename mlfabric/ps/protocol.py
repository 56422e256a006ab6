"""The parameter server's wire messages: tags, the small JSON header each one carries, and the typed headers.

    python -m pytest tests/unit/test_ps.py tests/unit/test_ps_protocol_typed.py -k protocol

Everything a worker sends a server rides one tag, ``request_tag(session)``, so that the
transport's per-(channel, tag) FIFO keeps a worker's push ahead of its ``clock`` and its
``leave`` (the server must see them in the order they were sent). What kind of request a
message is, and its fields, sit in the message's meta as JSON (a few hundred bytes at most);
the payload is the tensor, if any. Every header is typed here (:class:`Header`: the worker's
:class:`Push` and :class:`Pull`, its :class:`Init`, :class:`Clock`, :class:`Leave`; the
servers' answers :class:`ModelReply` (with a distributor's ``forward`` list; a multicast
:class:`ModelChunk`), :class:`Via`, :class:`Piece`, :class:`Ok`, :class:`ErrorReply`; the
replication feeds, :class:`Probe` and the network replication's :class:`Units`,
:class:`Unit`, :class:`Replicate`, :class:`ReplicaUnit`, :class:`ReplicaMember`; the scheduled
policy's requests, its scheduler's :class:`Order`, decisions (:class:`Dropped`,
:class:`Planned`, :class:`ToHost`) and :class:`GroupPlan`, its workers' and aggregators'
:class:`ScheduledPush`, :class:`Member`, :class:`HostPart`, :class:`GroupSum`,
:class:`TreeChunk`, :class:`TreeReroute`; MLNET's tree messages) and encoded once, by its
sender, with what the sending policy adds; a receiver decodes it once (:func:`decode`), and a
relay passes the bytes on as they came. Nothing in ``mlfabric/ps/`` outside this module calls
:func:`encode` (tests/unit/test_ps_protocol_typed.py checks it, and that the typed headers put
the same dicts on the wire as the ad-hoc ones they replaced). Answers go back on
``reply_tag(session, request_id)`` so that the thread waiting for one takes exactly its own.

Tags live in their own namespace (bit 60) apart from the collectives' (sequence << 24) and the
partial collectives' (bit 63); ``session`` keeps consecutive PS instances of one job (one per
training run) apart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mlfabric.errors import MlfabricError

NAMESPACE = 1 << 60
_KIND_SHIFT, _SESSION_SHIFT = 52, 40
_SEQ_MASK = (1 << _SESSION_SHIFT) - 1
MAX_SESSIONS = 1 << (_KIND_SHIFT - _SESSION_SHIFT)

REQUEST, REPLY, ALLREDUCE_PUSH, ALLREDUCE_RESULT, REPLICATE = 1, 2, 3, 4, 5
# The scheduled routing policy (MLfabric, ``ps/policies/scheduled/``): update requests and monitor
# reports to the scheduler, its decisions back (seq = the update's id), and the traffic of
# aggregators (group plans from the scheduler, members from workers).
SCHEDULE, DECISION, AGGREGATE = 6, 7, 8
# The mlnet routing policy (MLNET, ``ps/policies/mlnet.py``): what tree nodes send their parents
# (sums, clocks, leaves, pulls); answers come back on the reply tags.
TREE = 9

# Request kinds (meta["op"]).
INIT, PUSH, CLOCK, PULL, LEAVE, STATS = "init", "push", "clock", "pull", "leave", "stats"
ORDER = "order"  # from the scheduler to a server: a batch's application order
ADOPT = "adopt"  # from a worker to a replica promoted to server: the worker's clock
ATTACH = "attach"  # from an mlnet node to its new parent (node or server) after a repair
REJOIN = "rejoin"  # from a restarted worker (a new incarnation of its rank) to every server
FALL_BACK = "fall_back"  # from an mlnet node to every other: the trees are torn down


class PSRequestError(MlfabricError, ValueError):
    """A server refused a request (the message says which server, why and what to do)."""


def tag(kind: int, session: int, seq: int = 0) -> int:
    if not 0 <= session < MAX_SESSIONS:
        raise ValueError(f"PS session {session} is outside 0..{MAX_SESSIONS - 1}")
    return NAMESPACE | (kind << _KIND_SHIFT) | (session << _SESSION_SHIFT) | (seq & _SEQ_MASK)


def request_tag(session: int) -> int:
    return tag(REQUEST, session)


def reply_tag(session: int, request_id: int) -> int:
    return tag(REPLY, session, request_id)


class Header:
    """A typed header: ``OP`` its kind (``meta["op"]``), its dataclass fields the rest, in order.
    :meth:`encode` is the one JSON encoding of it (fields listed in ``OMIT_NONE`` are left out
    when None: the receiver tests for their presence); a receiver reads it back with
    :func:`decode` (a dict, as every header on the wire is)."""

    OP: ClassVar[str] = ""
    OMIT_NONE: ClassVar[tuple[str, ...]] = ()

    def fields(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.name in self.OMIT_NONE:
                continue
            out[f.name] = value
        return {**out, **extra}

    def body(self) -> dict[str, Any]:
        """The fields without ``op`` (for a sender that adds its own routing fields first)."""
        out = self.fields()
        del out["op"]
        return out

    def encode(self, **extra: Any) -> bytes:
        return encode(**self.fields(**extra))


@dataclass(frozen=True, slots=True)
class Push(Header):
    """A push's header before it is on the wire: the worker fills it, the policy encodes it
    once, with what it adds (a batch, an id), as it sends (never decoded on the sender)."""

    OP: ClassVar[str] = PUSH
    model: str
    clock: int
    version: int
    norm: float | None = None


@dataclass(frozen=True, slots=True)
class Pull(Header):
    """A pull's header before it is on the wire (see :class:`Push`). ``staleness``: the pull's
    own bound (None: the job's); ``order``: an ordered pull's order; ``direct``: answer from the
    server itself (the worker's distributor was lost)."""

    OP: ClassVar[str] = PULL
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("order", "direct")
    id: int
    model: str
    clock: int
    staleness: float | None = None
    order: str | None = None
    direct: bool | None = None


# -- worker -> server (besides Push and Pull) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init(Header):
    """A model's shard and its settings (the server answers :class:`Ok`)."""

    OP: ClassVar[str] = INIT
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("priorities",)
    id: int
    spec: dict[str, Any]
    lr: float
    momentum: float
    priorities: Any = None


@dataclass(frozen=True, slots=True)
class Clock(Header):
    OP: ClassVar[str] = CLOCK
    clock: int


@dataclass(frozen=True, slots=True)
class Leave(Header):
    OP: ClassVar[str] = LEAVE


@dataclass(frozen=True, slots=True)
class Adopt(Header):
    """To a replica promoted to server: this worker's clock."""

    OP: ClassVar[str] = ADOPT
    clock: int


@dataclass(frozen=True, slots=True)
class Rejoin(Header):
    """From a restarted worker (its rank's ``incarnation``-th process) to a server: take it back
    and send to it at ``endpoints`` (its new listeners); answered by :class:`Rejoined`.
    ``at_least``: the first clock its policy can take it at (mlnet: the clock its new parents
    in the trees send up next), never counted from below it."""

    OP: ClassVar[str] = REJOIN
    id: int
    incarnation: int
    endpoints: dict[str, str]
    at_least: int = 0


# -- server -> worker (answers on the reply tags) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelReply(Header):
    """A pull's answer: the shard follows as payload (or, ordered, in ``pieces`` messages)."""

    OP: ClassVar[str] = "model"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("pieces", "order", "forward")
    version: int
    model_clock: int | None
    pieces: int | None = None
    order: str | None = None
    # the scheduled policy's distributor (§10.3): the pullers ``[[rank, request id], ...]`` it
    # relays this answer to (the header goes on to them as it came; they ignore ``forward``)
    forward: list[list[int]] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelChunk(ModelReply):
    """One chunk of a shard multicast down the scheduled policy's model trees (#36): chunk
    ``chunk`` of ``chunks`` (``elems`` elements each, the last one shorter), the whole shard
    ``nbytes`` of ``itemsize``-byte elements; ``mtree`` the tree (host -> [[child, its request
    id], ...]) its relays pass it down."""

    mtree: dict[str, list[list[int]]]
    chunk: int
    chunks: int
    elems: int
    itemsize: int
    nbytes: int

    @classmethod
    def of(cls, reply: ModelReply, **chunk: Any) -> "ModelChunk":
        """``reply`` (the answer every puller gets) as one chunk of it."""
        return cls(**{f.name: getattr(reply, f.name) for f in dataclasses.fields(ModelReply)}, **chunk)


@dataclass(frozen=True, slots=True)
class Via(Header):
    """The scheduled policy's note to a puller: its answer comes relayed by ``distributor``
    (a multicast tree's parent, the tree ``mtree`` naming this puller's own children)."""

    OP: ClassVar[str] = "via"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("mtree",)
    distributor: int
    mtree: dict[str, list[list[int]]] | None = None


@dataclass(frozen=True, slots=True)
class Piece(Header):
    """One piece of an ordered pull's answer (TicTac): elements ``lo..hi`` of parameter ``key``."""

    OP: ClassVar[str] = "piece"
    key: str
    lo: int
    hi: int
    seq: int


@dataclass(frozen=True, slots=True)
class Ok(Header):
    OP: ClassVar[str] = "ok"
    version: int


@dataclass(frozen=True, slots=True)
class Rejoined(Header):
    """A server took a restarted worker back: it counts again from ``clock`` on."""

    OP: ClassVar[str] = "rejoined"
    clock: int


@dataclass(frozen=True, slots=True)
class ErrorReply(Header):
    """A refusal the worker raises (``lost_peer``: as a PeerLostError naming it)."""

    OP: ClassVar[str] = "error"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("lost_peer",)
    message: str
    lost_peer: int | None = None


@dataclass(frozen=True, slots=True)
class Refused(Header):
    OP: ClassVar[str] = "refused"
    message: str


# -- replication (server <-> replica) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register(Header):
    """A replica asks server ``server`` to replicate it."""

    OP: ClassVar[str] = "register"
    server: int


@dataclass(frozen=True, slots=True)
class ReplicaInit(Header):
    OP: ClassVar[str] = "init"
    spec: dict[str, Any]
    lr: float
    momentum: float
    version: int
    history: bool
    clocks: list[int]
    priorities: Any


@dataclass(frozen=True, slots=True)
class Applied(Header):
    """An update the server applied, as the replica applies it after it: ``update`` (chain: the
    gradient follows) or ``applied`` (network replication: the unit's key and members only)."""

    OP: ClassVar[str] = "update"
    model: str
    version: int
    workers: list[int]
    computed_from: list[int]
    weight: float
    norm: float | None
    t: float


@dataclass(frozen=True, slots=True)
class AppliedUnit(Applied):
    """Network replication: the unit ``unit`` the server applied (its ``members``: (rank,
    update id)); the replica has the update from the workers."""

    OP: ClassVar[str] = "applied"
    unit: int
    members: list[list[int]] | None


@dataclass(frozen=True, slots=True)
class Probe(Header):
    """A server's model at a batch's end (the payload), for its replica to measure how far its
    own is (``measure_divergence``)."""

    OP: ClassVar[str] = "probe"
    model: str
    batch: int
    version: int
    t: float


@dataclass(frozen=True, slots=True)
class Units(Header):
    """Network replication (§5.3): the scheduler tells replica which units (``units``, in the
    server's order) come its way and when each is due at the latest (``commit_in``, seconds)."""

    OP: ClassVar[str] = "units"
    model: str
    units: list[int]
    commit_in: list[float]


@dataclass(frozen=True, slots=True)
class Unit(Header):
    """A unit's update (the payload: one worker's copy, or a replica aggregator's sum) to the replica."""

    OP: ClassVar[str] = "unit"
    unit: int
    model: str


@dataclass(frozen=True, slots=True)
class Replicate(Header):
    """To a worker: send your copy of update ``id`` (component ``server``) of unit ``unit`` to
    ``dest`` (the replica ``replica`` itself, or the unit's replica aggregator) in
    ``start_in`` s at ``rate`` bytes/s (None: unpaced); ``recovery``: a replica taking over asks
    (the copy may be gone already)."""

    OP: ClassVar[str] = "replicate"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("recovery",)
    unit: int
    model: str
    id: int
    server: int
    dest: int
    replica: int
    start_in: float
    rate: float | None
    recovery: bool | None = None


@dataclass(frozen=True, slots=True)
class ReplicaUnit(Header):
    """To a unit's replica aggregator (its first member): sum the ``members``' copies
    ([rank, update id], in this order) and send the sum to ``dest`` at ``rate``."""

    OP: ClassVar[str] = "runit"
    unit: int
    model: str
    server: int
    dest: int
    members: list[list[int]]
    rate: float | None


@dataclass(frozen=True, slots=True)
class ReplicaMember(Header):
    """A member's copy (the payload) to its unit's replica aggregator."""

    OP: ClassVar[str] = "rmember"
    unit: int
    model: str
    server: int
    rank: int
    replica: int
    id: int


@dataclass(frozen=True, slots=True)
class Ack(Header):
    OP: ClassVar[str] = "ack"
    model: str
    version: int
    history_norm: float


@dataclass(frozen=True, slots=True)
class End(Header):
    OP: ClassVar[str] = "end"


# -- the scheduled policy's worker side (to the scheduler) -----------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduleRequest(Header):
    """An update asks to be scheduled: its component sizes, the version it was computed from."""

    OP: ClassVar[str] = "request"
    id: int
    model: str
    version: int
    norm: float
    clock: int
    sizes: list[int]


@dataclass(frozen=True, slots=True)
class Cancel(Header):
    OP: ClassVar[str] = "cancel"
    id: int
    model: str


# -- the scheduled policy's scheduler, aggregators and workers (ps/policies/scheduled/) ------------


@dataclass(frozen=True, slots=True)
class Order(Header):
    """The scheduler's order to a server (:meth:`~mlfabric.ps.policies.scheduled.core.BatchPlan.order`):
    batch ``batch`` of ``model`` applies ``entries`` in this order from version ``v_init``."""

    OP: ClassVar[str] = ORDER
    batch: int
    model: str
    v_init: int
    entries: list[Any]
    sync: bool
    clocks: Any


@dataclass(frozen=True, slots=True)
class Dropped(Header):
    """The scheduler's decision: the update is dropped (``reason``)."""

    OP: ClassVar[str] = "decision"
    reason: str | None
    batch: int
    drop: bool = True


@dataclass(frozen=True, slots=True)
class Planned(Header):
    """The scheduler's decision: send component j to ``hop[j]`` (a server, or an aggregator:
    group ``group``, at ``position``) in ``start_in`` s at ``rates[j]`` bytes/s. A member of a
    tree gets the tree (``tree``, ``chunk_bytes``) and keeps its update ``hold_in`` s; a host's
    leading worker gets its co-located members (``host_members``: [rank, request id]) to sum."""

    OP: ClassVar[str] = "decision"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("tree", "chunk_bytes", "hold_in", "host_members")
    batch: int
    group: int | None
    position: int | None
    hop: list[int]
    start_in: float
    rates: list[float]
    tree: list[list[Any]] | None = None
    chunk_bytes: int | None = None
    hold_in: float | None = None
    host_members: list[list[int]] | None = None
    drop: bool = False


@dataclass(frozen=True, slots=True)
class ToHost(Header):
    """The scheduler's decision for a co-located member of a host request (#36): hand the update
    to the host's leading worker ``host`` (its request ``host_id``), or it was dropped with it."""

    OP: ClassVar[str] = "decision"
    drop: bool
    reason: str | None
    batch: int
    host: int
    host_id: int


@dataclass(frozen=True, slots=True)
class GroupPlan(Header):
    """The scheduler's plan of an aggregation group to its aggregator (or, ``tree``: to every
    node of its tree, chunked by ``chunk_bytes``): its ``members`` ([rank, request id]) and
    ``servers``, forwarded within ``deadline_in`` s at ``rates``."""

    OP: ClassVar[str] = "group"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("tree", "chunk_bytes")
    batch: int
    slot: int
    model: str
    members: list[list[int]]
    servers: list[int]
    deadline_in: float
    rates: list[float]
    tree: list[list[Any]] | None = None
    chunk_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledPush(Push):
    """A push as the scheduled policy sends it straight to a server: the decision's ``batch``,
    the update's ``id`` and ``rank``; a host sum (#36) names every update in it (``workers``,
    ``versions``, ``members``: [rank, request id])."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("workers", "versions", "members")
    batch: int
    id: int
    rank: int
    workers: list[int] | None = None
    versions: list[int] | None = None
    members: list[list[int]] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Member(ScheduledPush):
    """A group member's component ``server`` to its aggregator (group ``slot``)."""

    OP: ClassVar[str] = "member"
    slot: int | None
    server: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSum(Push):
    """An aggregator's sum of group ``slot`` to the server: every update in it (``workers``,
    ``versions``, ``members``: [rank, request id])."""

    batch: int
    slot: int
    workers: list[int]
    versions: list[int]
    members: list[list[int]]


@dataclass(frozen=True, slots=True)
class HostPart(Header):
    """A co-located member's component ``server`` (the payload) to its host's leading worker."""

    OP: ClassVar[str] = "hostpart"
    server: int
    rank: int
    id: int
    version: int
    clock: int


@dataclass(frozen=True, slots=True)
class TreeChunk(Header):
    """One chunk of an aggregation tree toward a tree node (framing: ``policies/scheduled/
    aggregator.py``, "aggregation trees"): chunk ``chunk`` (``elems`` elements) of component
    ``server`` of group (``model``, ``batch``, ``slot``), from ``source`` (["m", rank, id] or
    ["c", host]), summing ``members`` ([rank, id, version]); ``lost``: the lost nodes it was
    re-routed around ([[host, its inputs], ...])."""

    OP: ClassVar[str] = "tchunk"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("lost",)
    model: str
    batch: int
    slot: int
    server: int
    chunk: int
    elems: int
    source: list[Any]
    members: list[list[int]]
    clock: int
    root: int
    lost: list[Any] | None = None

    def to_server(self) -> "TreeChunkPush":
        """The same chunk toward the server (the tree's root sends it, or a member whose every
        ancestor is lost)."""
        return TreeChunkPush(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True, slots=True)
class TreeChunkPush(TreeChunk):
    """A :class:`TreeChunk` to the server: its chunks count toward the group's entry there."""

    OP: ClassVar[str] = PUSH


@dataclass(frozen=True, slots=True)
class TreeReroute(Header):
    """To a live input of lost tree node ``lost``: send what you sent toward it (group
    ``batch``/``slot``) to ``dest``, its nearest live ancestor."""

    OP: ClassVar[str] = "treroute"
    batch: int
    slot: int
    lost: int
    dest: int


# -- mlnet (a tree node to its parent node; to a server the same without ``tree``) -----------------


@dataclass(frozen=True, slots=True)
class TreeClock(Header):
    OP: ClassVar[str] = CLOCK
    clock: int
    workers: list[int]


@dataclass(frozen=True, slots=True)
class TreeSum(Header):
    """A node's sum of one clock's updates of ``model`` (the payload, of ``dtype``), naming the
    ``workers`` in it and the ``versions`` they were computed from; to the server, as an
    aggregate update, with its ``version`` (the oldest) and ``norm``."""

    OP: ClassVar[str] = PUSH
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("version", "norm")
    model: str
    clock: int
    workers: list[int]
    versions: list[int]
    dtype: str
    version: int | None = None
    norm: float | None = None


@dataclass(frozen=True, slots=True)
class TreePull(Header):
    """A node asks its parent node (``id``: its answer's reply tag) for a copy of ``model`` of at
    least model clock ``need`` (to a server it asks a :class:`Pull`)."""

    OP: ClassVar[str] = PULL
    id: int
    model: str
    need: float


@dataclass(frozen=True, slots=True)
class FallBack(Header):
    """An mlnet node to every other: the trees are torn down (``why``); push and pull directly."""

    OP: ClassVar[str] = FALL_BACK
    tree: int
    why: str


@dataclass(frozen=True, slots=True)
class TreeLeave(Header):
    OP: ClassVar[str] = LEAVE
    workers: list[int]
    final: bool


@dataclass(frozen=True, slots=True)
class Attach(Header):
    """A node re-attaching asks its new parent (``id``: its answer's reply tag) what it has.
    ``rejoin``: a restarted worker's node re-entering the tree as a leaf (MLNET §3): the
    parent takes it from the next clock it sends up (its answer's ``through`` + 1)."""

    OP: ClassVar[str] = ATTACH
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("workers", "rejoin")
    id: int
    workers: list[int] | None = None
    rejoin: bool | None = None


@dataclass(frozen=True, slots=True)
class Attached(Header):
    """The answer to :class:`Attach`: the last clock the parent has of the subtree (to a
    re-entering node: the last it sent up without it). ``fell_back``: the trees are torn down
    (the re-entering node pushes and pulls directly)."""

    OP: ClassVar[str] = "attached"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("fell_back",)
    through: int
    fell_back: bool | None = None


@dataclass(frozen=True, slots=True)
class Reentered(Header):
    """From a restarted worker's tree node to every other worker's: it is back at
    ``endpoints`` (they send to it again) and sits as a leaf below its first live ancestor, not
    at its place as built (their repairs no longer count on it, MLNET §3)."""

    OP: ClassVar[str] = "reentered"
    tree: int
    endpoints: dict[str, str]


def encode(**fields: Any) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def decode(meta: bytes) -> dict[str, Any]:
    try:
        data = json.loads(bytes(meta).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed parameter-server header: {exc}") from None
    if not isinstance(data, dict) or "op" not in data:
        raise ValueError(f"malformed parameter-server header: {data!r}")
    return data


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
