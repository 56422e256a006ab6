"""The schedule IR: a per-rank DAG of communication and computation ops.

Every algorithm in mlfabric is written once as a *schedule builder*: a pure function that
returns, for one rank, a :class:`Schedule` — a list of ops (send, recv, reduce, copy, nop)
whose dependencies are all-of or any-of (eager-SGD §4.1.1). The same object is executed by
``mlfabric.runtime``, simulated by ``mlfabric.sim`` and checked by
``mlfabric.schedule.validate``.

Buffers are named flat arrays of elements; ops address them through :class:`Slice`
(element offsets, never bytes, so one schedule serves every dtype). By convention
``"data"`` is the user's tensor; builders may declare scratch buffers.

Exercise it with ``python -m pytest tests/unit/test_schedule.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Callable, Iterable, Sequence

DEFAULT_CHANNEL = "0"
REDUCE_OPS = ("sum", "max", "min", "prod")

# Builders tag every send/recv pair with a small integer; the runtime widens it with the
# collective's sequence number, so builder tags only need to be unique inside one schedule set.
MAX_OP_TAG = (1 << 24) - 1


class DepMode(str, Enum):
    """How an op's dependencies combine: wait for all of them, or fire on the first one."""

    ALL = "all"
    ANY = "any"


@dataclass(frozen=True, slots=True)
class Slice:
    """``length`` elements of buffer ``buffer`` starting at element ``offset``."""

    buffer: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"slice {self} has a negative offset or length")

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, other: "Slice") -> bool:
        return (
            self.buffer == other.buffer
            and self.length > 0
            and other.length > 0
            and self.offset < other.end
            and other.offset < self.end
        )


@dataclass(frozen=True, slots=True)
class Op:
    """Common fields of every op. ``deps`` are indices of earlier ops of the same schedule."""

    deps: tuple[int, ...] = ()
    mode: DepMode = DepMode.ALL

    def reads(self) -> tuple[Slice, ...]:
        return ()

    def writes(self) -> tuple[Slice, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class Send(Op):
    """Send ``src`` to ``peer`` on ``channel``; matched by the peer's Recv with the same tag."""

    peer: int = -1
    src: Slice = Slice("data", 0, 0)
    tag: int = 0
    channel: str = DEFAULT_CHANNEL

    def reads(self) -> tuple[Slice, ...]:
        return (self.src,)


@dataclass(frozen=True, slots=True)
class Recv(Op):
    """Receive from ``peer`` into ``dst``. With ``reduce`` set, combine into ``dst`` instead
    of overwriting it (the fused receive-reduce of gloo/NCCL, which saves a scratch buffer
    and a memory pass)."""

    peer: int = -1
    dst: Slice = Slice("data", 0, 0)
    tag: int = 0
    channel: str = DEFAULT_CHANNEL
    reduce: str | None = None

    def reads(self) -> tuple[Slice, ...]:
        return (self.dst,) if self.reduce else ()

    def writes(self) -> tuple[Slice, ...]:
        return (self.dst,)


@dataclass(frozen=True, slots=True)
class Reduce(Op):
    """``dst = dst <op> src`` element-wise."""

    dst: Slice = Slice("data", 0, 0)
    src: Slice = Slice("data", 0, 0)
    op: str = "sum"

    def reads(self) -> tuple[Slice, ...]:
        return (self.dst, self.src)

    def writes(self) -> tuple[Slice, ...]:
        return (self.dst,)


@dataclass(frozen=True, slots=True)
class Copy(Op):
    """``dst = src``."""

    dst: Slice = Slice("data", 0, 0)
    src: Slice = Slice("data", 0, 0)

    def reads(self) -> tuple[Slice, ...]:
        return (self.src,)

    def writes(self) -> tuple[Slice, ...]:
        return (self.dst,)


@dataclass(frozen=True, slots=True)
class Nop(Op):
    """Completes immediately; only used to shape dependencies (e.g. an activation point)."""

    label: str = ""


@dataclass(frozen=True, kw_only=True)
class Cost:
    """Closed-form cost of one rank's schedule, as the builder states it.

    ``elements_sent`` per channel; multiply by the dtype's item size for bytes.
    ``steps`` is the number of communication rounds on the critical path.

    ``link_shares`` maps a connection ``(peer, channel)`` to the fraction of this rank's NIC
    the closed form gives it while it carries data, for algorithms whose steps send to several
    peers at once on one NIC (BML: ``1/(n-1)`` to each neighbour of a level; the P2P parameter
    server: ``1/(N-1)`` to every peer). The runtime paces such connections at their share when
    it knows the NIC's rate, so that TCP's flows end together as the closed form assumes
    (``runtime/fair_share.py``). Connections not listed send one at a time: the whole NIC.

    ``elements_across_hosts``: of ``elements_sent``, what leaves this rank's host (the rest
    stays on the host-internal hop: shared memory), stated by builders that know the ranks'
    hosts (hierarchical collectives); the validator checks it against the ops when given the
    hosts (``validate(..., hosts=...)``). None: not stated.
    """

    steps: int
    elements_sent: dict[str, int]
    link_shares: dict[tuple[int, str], float] = field(default_factory=dict)
    elements_across_hosts: int | None = None

    def __post_init__(self) -> None:
        for connection, share in self.link_shares.items():
            if not 0 < share <= 1:
                raise ValueError(f"link share of connection {connection} must be in (0, 1], got {share}")

    @property
    def total_elements_sent(self) -> int:
        return sum(self.elements_sent.values())

    def bytes_sent(self, itemsize: int) -> int:
        return self.total_elements_sent * itemsize


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One rank's part of a collective.

    ``persistent``: after every op has completed the schedule re-arms itself (eager-SGD
    §4.1.1 "persistent schedules"), so the runtime may execute it again without the
    application rebuilding it. Ops are always consumable: one execution runs each op once.

    ``triggers``: dependency-free Nops that fire on an external event — the application
    calling the collective (eager-SGD §4.1.1's *internal activation*) — instead of at start.
    The validator and the interpreter treat them as fired (every rank initiating);
    ``walk(..., triggered=...)`` explores other initiator sets.
    """

    name: str
    rank: int
    world_size: int
    buffers: dict[str, int]
    ops: tuple[Op, ...]
    cost: Cost
    persistent: bool = False
    triggers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for index in self.triggers:
            if not (0 <= index < len(self.ops) and isinstance(self.ops[index], Nop) and not self.ops[index].deps):
                raise ValueError(f"{self.name} rank {self.rank}: trigger {index} is not a dependency-free Nop")
        for index, op in enumerate(self.ops):
            for dep in op.deps:
                if not 0 <= dep < index:
                    raise ValueError(
                        f"{self.name} rank {self.rank}: op {index} depends on op {dep}; "
                        "dependencies must point to earlier ops"
                    )
            if op.mode is DepMode.ANY and not op.deps:
                raise ValueError(f"{self.name} rank {self.rank}: op {index} is any-of with no deps")
            for sl in (*op.reads(), *op.writes()):
                size = self.buffers.get(sl.buffer)
                if size is None:
                    raise ValueError(
                        f"{self.name} rank {self.rank}: op {index} uses undeclared buffer {sl.buffer!r}"
                    )
                if sl.end > size:
                    raise ValueError(
                        f"{self.name} rank {self.rank}: op {index} slice {sl} exceeds buffer size {size}"
                    )
            if isinstance(op, (Send, Recv)):
                if not 0 <= op.peer < self.world_size or op.peer == self.rank:
                    raise ValueError(f"{self.name} rank {self.rank}: op {index} has bad peer {op.peer}")
                if not 0 <= op.tag <= MAX_OP_TAG:
                    raise ValueError(f"{self.name} rank {self.rank}: op {index} tag {op.tag} out of range")
            reduce_op = op.op if isinstance(op, Reduce) else getattr(op, "reduce", None)
            if reduce_op is not None and reduce_op not in REDUCE_OPS:
                raise ValueError(f"{self.name} rank {self.rank}: op {index} has unknown reduction {reduce_op!r}")

    def dependents(self) -> list[list[int]]:
        """For each op, the ops that list it as a dependency (computed once per schedule:
        the runtime asks at every execution). Treat the lists as read-only."""
        return self._dependents

    @cached_property
    def _dependents(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.ops]
        for index, op in enumerate(self.ops):
            for dep in op.deps:
                out[dep].append(index)
        return out

    def dependency_counts(self) -> tuple[int, ...]:
        """For each op, how many dependencies it lists (computed once, like ``dependents``)."""
        return self._dependency_counts

    @cached_property
    def _dependency_counts(self) -> tuple[int, ...]:
        return tuple(len(op.deps) for op in self.ops)

    def start_state(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        """(for each op whether it starts fired, the ops ready at the start): the ops without
        dependencies (computed once, like ``dependents``)."""
        return self._start_state

    @cached_property
    def _start_state(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        counts = self._dependency_counts
        return tuple(count == 0 for count in counts), tuple(i for i, count in enumerate(counts) if count == 0)

    def sends(self) -> Iterable[Send]:
        return (op for op in self.ops if isinstance(op, Send))

    def recvs(self) -> Iterable[Recv]:
        return (op for op in self.ops if isinstance(op, Recv))

    def elements_sent_by_channel(self) -> dict[str, int]:
        """What the ops actually send, to compare against the stated :attr:`cost`."""
        out: dict[str, int] = {}
        for op in self.sends():
            out[op.channel] = out.get(op.channel, 0) + op.src.length
        return out

    def elements_sent_by_hop(self, hosts: Sequence[int]) -> tuple[int, int]:
        """(elements sent to ranks on this rank's host, elements sent to other hosts), with
        ``hosts[r]`` the host of rank ``r``."""
        mine = hosts[self.rank]
        within = across = 0
        for op in self.sends():
            if hosts[op.peer] == mine:
                within += op.src.length
            else:
                across += op.src.length
        return within, across

    def channels(self) -> set[str]:
        return {op.channel for op in self.ops if isinstance(op, (Send, Recv))}


class ScheduleBuilder:
    """Accumulates ops for one rank; ``add`` returns the new op's index for use in deps."""

    def __init__(self, name: str, rank: int, world_size: int) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.buffers: dict[str, int] = {}
        self.ops: list[Op] = []
        self.triggers: list[int] = []

    def buffer(self, name: str, size: int) -> str:
        self.buffers[name] = size
        return name

    def add(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def send(self, peer: int, src: Slice, tag: int, deps: Sequence[int] = (), *,
             channel: str = DEFAULT_CHANNEL) -> int:
        return self.add(Send(peer=peer, src=src, tag=tag, channel=channel, deps=_deps(deps)))

    def recv(self, peer: int, dst: Slice, tag: int, deps: Sequence[int] = (), *,
             channel: str = DEFAULT_CHANNEL, reduce: str | None = None) -> int:
        return self.add(Recv(peer=peer, dst=dst, tag=tag, channel=channel, reduce=reduce, deps=_deps(deps)))

    def reduce(self, dst: Slice, src: Slice, op: str, deps: Sequence[int] = ()) -> int:
        return self.add(Reduce(dst=dst, src=src, op=op, deps=_deps(deps)))

    def copy(self, dst: Slice, src: Slice, deps: Sequence[int] = ()) -> int:
        return self.add(Copy(dst=dst, src=src, deps=_deps(deps)))

    def nop(self, deps: Sequence[int] = (), *, mode: DepMode = DepMode.ALL, label: str = "") -> int:
        return self.add(Nop(deps=_deps(deps), mode=mode, label=label))

    def trigger(self, label: str) -> int:
        """A Nop fired by an external event (see :attr:`Schedule.triggers`)."""
        index = self.nop(label=label)
        self.triggers.append(index)
        return index

    def append(self, schedule: Schedule, *, after: Sequence[int] | Callable[[Op], Sequence[int]] = (),
               tag_offset: int = 0, ranks: Sequence[int] | None = None, offset: int = 0) -> list[int]:
        """Copy ``schedule``'s ops after the ops built so far, so one algorithm can follow
        another: its dependency-free ops wait for ``after`` (or for ``after(op)``, given each
        such op as it will be added, without dependencies), its tags move up by
        ``tag_offset``, its buffers are declared here. Returns the new indices.

        By default ``schedule`` is for this rank and world. With ``ranks`` it is one of a
        sub-group's (``ranks[i]`` is the rank here of its rank ``i``; hierarchical collectives
        run ring inside a host, then between hosts): peers are renamed. With ``offset`` its
        ``data`` lies at that element of this ``data`` (declared first, large enough)."""
        embedded = ranks is not None or offset != 0
        ranks = range(self.world_size) if ranks is None else ranks
        if len(ranks) != schedule.world_size or ranks[schedule.rank] != self.rank:
            raise ValueError(f"cannot append rank {schedule.rank}/{schedule.world_size} ops to "
                             f"rank {self.rank}/{self.world_size} with ranks {list(ranks)}")
        for name, size in schedule.buffers.items():
            if name == "data" and embedded and "data" in self.buffers:
                if offset < 0 or offset + size > self.buffers["data"]:
                    raise ValueError(f"{schedule.name}'s data ({size} elements at {offset}) does not fit in "
                                     f"data of {self.buffers['data']} elements")
                continue
            if self.buffers.get(name, size) != size:
                raise ValueError(f"buffer {name!r} has size {self.buffers[name]} here, {size} in {schedule.name}")
            self.buffers[name] = size

        def place(sl: Slice) -> Slice:
            return replace(sl, offset=sl.offset + offset) if offset and sl.buffer == "data" else sl

        base = len(self.ops)
        head = None if callable(after) else _deps(after)
        for op in schedule.ops:
            if isinstance(op, Send):
                op = replace(op, tag=op.tag + tag_offset, peer=ranks[op.peer], src=place(op.src))
            elif isinstance(op, Recv):
                op = replace(op, tag=op.tag + tag_offset, peer=ranks[op.peer], dst=place(op.dst))
            elif isinstance(op, (Reduce, Copy)):
                op = replace(op, dst=place(op.dst), src=place(op.src))
            if op.deps:
                self.add(replace(op, deps=tuple(base + d for d in op.deps)))
            else:
                start = head if head is not None else _deps(after(op))  # type: ignore[operator]
                self.add(replace(op, deps=start, mode=DepMode.ALL))
        return list(range(base, len(self.ops)))

    def build(self, cost: Cost, *, persistent: bool = False) -> Schedule:
        return Schedule(
            name=self.name,
            rank=self.rank,
            world_size=self.world_size,
            buffers=dict(self.buffers),
            ops=tuple(self.ops),
            cost=cost,
            persistent=persistent,
            triggers=tuple(self.triggers),
        )


def _deps(deps: Iterable[int | None]) -> tuple[int, ...]:
    """Dependencies without duplicates or Nones (builders pass ``None`` for 'no previous op')."""
    return tuple(sorted({d for d in deps if d is not None}))
