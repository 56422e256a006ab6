"""Hierarchical collectives: inside each host over shared memory, between hosts over the network.

``hosts[r]`` is the host of rank ``r`` (the tcp transport learns it at rendezvous:
ranks with the same boot and network namespace share memory). A host's ranks, in rank
order, have *local indices* 0, 1, ...; its lowest rank is its *leader*.

**Allreduce** (:func:`host_hierarchical_allreduce`), when every host has the same number
``L`` of ranks (all ranks work, each on a disjoint slice):

1. ring reduce-scatter inside each host: local rank ``i`` ends with segment ``i`` of the
   buffer (``partition.pieces(count, L)[i]``) reduced over its host;
2. the inter-host algorithm (``inter``: ring, halving-doubling, tree or BCube) allreduces
   segment ``i`` among the ``H`` ranks of local index ``i``, one per host: ``L`` independent
   allreduces of ``count / L`` elements;
3. ring allgather inside each host.

Each host's NIC carries ``L x 2(H-1)/H x count/L = 2(H-1)/H x count`` elements, what one
rank per host would send running ``inter`` on the whole buffer; a flat ring over all ``N =
L H`` ranks sends ``2(N-1)/N x count`` from *every* rank, ``L`` times as much per NIC when
neighbours sit on different hosts. Hosts of different sizes fall back to leaders: binomial
reduce into each host's leader, ``inter`` between the leaders, binomial broadcast back.

**Broadcast** (:func:`host_hierarchical_broadcast`): binomial broadcast from the root to one
rank per other host (its leader), then binomial broadcast inside every host. Each host
receives the buffer once over the network.

**Allgather** (:func:`host_hierarchical_allgather`): ``data`` holds ``N`` pieces, piece
``r`` rank ``r``'s contribution. Every rank hands its piece to its leader, leaders exchange
their hosts' pieces (each host's block crosses the network once per other host), and each
leader gives its host's ranks every piece they lack. Consecutive pieces of one host travel
as one message.

Phases follow one another per rank through their data, not as a whole: a phase's first op
on a slice waits for the earlier ops that touch it (one writing), so the network phase starts
on a segment's first chunk while the host is still reducing the rest, and the host's
allgather spreads each chunk as it comes back. Message tags of phases are kept apart by
:data:`PHASE_TAGS`. Every builder states its cost, including
``elements_across_hosts``, which ``schedule.validate(..., hosts=...)`` checks.

Exercise it with ``python -m pytest tests/unit/test_hierarchical.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Op, Schedule, ScheduleBuilder, Slice

from .bcube import bcube_allreduce
from .halving_doubling import halving_doubling_allreduce
from .partition import chunks_for, pieces
from .ring import MAX_CHUNKS, default_chunks, ring_allgather, ring_allreduce, ring_reduce_scatter
from .tree import binomial_broadcast, binomial_reduce, tree_allreduce

#: Tags of one phase live in ``[p * PHASE_TAGS, (p + 1) * PHASE_TAGS)``.
PHASE_TAGS = 1 << 20

#: The inter-host algorithms (builders of an allreduce over the hosts' ranks).
#: Called as ``(hosts, host, count, op, chunks, channel, **inter_shape)``.
INTER_ALGORITHMS: dict[str, Callable[..., Schedule]] = {
    "ring": lambda world, r, c, op, chunks, channel, **_: ring_allreduce(
        world, r, c, op=op, chunks=chunks, channel=channel),
    "halving_doubling": lambda world, r, c, op, chunks, channel, **_: halving_doubling_allreduce(
        world, r, c, op=op, channel=channel),
    "tree": lambda world, r, c, op, chunks, channel, **_: tree_allreduce(world, r, c, op=op, channel=channel),
    "bcube": lambda world, r, c, op, chunks, channel, **shape: bcube_allreduce(
        world, r, c, op=op, channels=(channel,) * int(shape["k"]), **shape),
}


class HostLayout:
    """Who is on which host: ``members[h]`` (ranks of host h, ascending), ``host_of[r]``."""

    def __init__(self, hosts: Sequence[int], world_size: int) -> None:
        if len(hosts) != world_size:
            raise ValueError(f"hosts names the host of {len(hosts)} ranks, but the world has {world_size}")
        order: dict[int, list[int]] = {}
        for rank, host in enumerate(hosts):
            order.setdefault(host, []).append(rank)
        # Hosts numbered by their lowest rank, whatever labels the caller used.
        self.members: list[list[int]] = sorted(order.values(), key=lambda ranks: ranks[0])
        self.host_of = [0] * world_size
        for h, ranks in enumerate(self.members):
            for rank in ranks:
                self.host_of[rank] = h

    @property
    def n_hosts(self) -> int:
        return len(self.members)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(ranks) for ranks in self.members}) == 1

    def local_index(self, rank: int) -> int:
        return self.members[self.host_of[rank]].index(rank)

    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.members]

    def spans_multi_rank_hosts(self) -> bool:
        """Several hosts, at least two of them with several ranks: where hierarchical
        collectives save network traffic (``algorithm="auto"`` picks them there)."""
        return self.n_hosts > 1 and sum(len(ranks) > 1 for ranks in self.members) >= 2


def _chunks(elements_per_segment: int, chunk_elements: int | None, group: int) -> int:
    """A ring phase's pipelining chunks: from the communicator's chunk, else the ring's default."""
    if chunk_elements is None:
        return default_chunks(elements_per_segment * group, group)
    return chunks_for(elements_per_segment, chunk_elements, MAX_CHUNKS)


class _Phases:
    """Builds one rank's schedule phase by phase, each op of a phase after the earlier
    phases' ops on its memory (module docstring)."""

    def __init__(self, name: str, world_size: int, rank: int, count: int) -> None:
        self.b = ScheduleBuilder(name, rank, world_size)
        self.b.buffer("data", count)
        self.phase = 0
        self.steps = 0
        self.sent = 0
        self.across = 0

    def _earlier(self, op: Op, before: int) -> list[int]:
        """The ops below ``before`` that ``op`` must follow: those touching memory it
        touches, one of the two writing."""
        reads, writes = op.reads(), op.writes()
        deps = []
        for index in range(before):
            other = self.b.ops[index]
            if any(w.overlaps(s) for w in writes for s in (*other.reads(), *other.writes())) or any(
                    r.overlaps(w) for r in reads for w in other.writes()):
                deps.append(index)
        return deps

    def add(self, sub: Schedule, ranks: Sequence[int], *, offset: int = 0, network: bool) -> None:
        """Append ``sub`` (a schedule of the group ``ranks``) as the next phase."""
        tags = max((op.tag for op in (*sub.sends(), *sub.recvs())), default=-1)
        if tags >= PHASE_TAGS:
            raise ValueError(f"{sub.name} uses tag {tags}: more than a hierarchical phase holds ({PHASE_TAGS})")
        before = len(self.b.ops)
        self.b.append(sub, after=lambda op: self._earlier(op, before), tag_offset=self.phase * PHASE_TAGS,
                      ranks=ranks, offset=offset)
        self.next_phase(sub.cost.steps if sub.world_size > 1 else 0)
        self.sent += sub.cost.total_elements_sent
        if network:
            self.across += sub.cost.total_elements_sent

    def next_phase(self, steps: int = 0) -> None:
        self.phase += 1
        self.steps += steps

    def build(self, channel: str) -> Schedule:
        return self.b.build(Cost(steps=self.steps, elements_sent={channel: self.sent},
                                 elements_across_hosts=self.across))


def allreduce_options(nbytes: int, hosts: Sequence[int], chunk_elements: int | None) -> dict[str, object]:
    """The options the runtime (and the simulator, for the same schedule) give
    :func:`host_hierarchical_allreduce` of ``nbytes``: the hosts, the inter-host algorithm
    by ``auto``'s rule on one rank's slice, the ring phases' chunk."""
    from mlfabric.collectives import choose_allreduce  # the registry imports this module

    layout = HostLayout(hosts, len(hosts))
    inter = choose_allreduce("auto", nbytes // len(layout.members[0]), layout.n_hosts)
    return {"hosts": tuple(hosts), "inter": inter, "chunk_elements": chunk_elements}


def host_hierarchical_allreduce(world_size: int, rank: int, count: int, *, hosts: Sequence[int],
                                inter: str = "ring", op: str = "sum", chunk_elements: int | None = None,
                                inter_shape: tuple[tuple[str, int], ...] = (),
                                channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Allreduce inside hosts, then between hosts, then inside hosts (module docstring).
    ``inter``: one of :data:`INTER_ALGORITHMS`; ``inter_shape``: BCube's ``(("n", n), ("k", k))``
    over the hosts. ``chunk_elements``: the ring phases' pipelining chunk (None: ring's default)."""
    if inter not in INTER_ALGORITHMS:
        raise ValueError(f"unknown inter-host algorithm {inter!r}; choose one of {', '.join(INTER_ALGORITHMS)}")
    layout = HostLayout(hosts, world_size)
    p = _Phases("host_hierarchical_allreduce", world_size, rank, count)
    host = layout.host_of[rank]
    local = layout.members[host]
    n_hosts = layout.n_hosts
    if layout.uniform:
        size, i = len(local), layout.local_index(rank)
        segment = pieces(count, size)[i]
        if size > 1:
            chunks = _chunks(count // size, chunk_elements, size)
            p.add(ring_reduce_scatter(size, i, count, op=op, chunks=chunks, channel=channel), local, network=False)
        if n_hosts > 1:
            peers = [ranks[i] for ranks in layout.members]
            chunks = _chunks(segment.length // n_hosts, chunk_elements, n_hosts)
            sub = INTER_ALGORITHMS[inter](n_hosts, host, segment.length, op, chunks, channel, **dict(inter_shape))
            p.add(sub, peers, offset=segment.offset, network=True)
        if size > 1:
            chunks = _chunks(count // size, chunk_elements, size)
            p.add(ring_allgather(size, i, count, chunks=chunks, channel=channel), local, network=False)
        return p.build(channel)
    # Hosts of different sizes: leaders reduce, allreduce among themselves, broadcast.
    # Every rank counts every phase, even one it has no part in, so that tags agree.
    i = layout.local_index(rank)
    if len(local) > 1:
        p.add(binomial_reduce(len(local), i, count, op=op, channel=channel), local, network=False)
    else:
        p.next_phase()
    if i == 0:
        chunks = _chunks(count // n_hosts, chunk_elements, n_hosts)
        p.add(INTER_ALGORITHMS[inter](n_hosts, host, count, op, chunks, channel, **dict(inter_shape)),
              layout.leaders(), network=True)
    else:
        p.next_phase()  # the leaders' phase: nothing for this rank, but tags stay apart
    if len(local) > 1:
        p.add(binomial_broadcast(len(local), i, count, channel=channel), local, network=False)
    return p.build(channel)


def host_hierarchical_broadcast(world_size: int, rank: int, count: int, *, hosts: Sequence[int], root: int = 0,
                                channel: str = DEFAULT_CHANNEL) -> Schedule:
    """``root``'s ``data`` to one rank of every other host, then inside every host."""
    if not 0 <= root < world_size:
        raise ValueError(f"broadcast root {root} is outside world size {world_size}")
    layout = HostLayout(hosts, world_size)
    p = _Phases("host_hierarchical_broadcast", world_size, rank, count)
    root_host = layout.host_of[root]
    # One rank per host carries the buffer across: the root on its host, the leader elsewhere.
    carriers = [root if h == root_host else ranks[0] for h, ranks in enumerate(layout.members)]
    host = layout.host_of[rank]
    local = layout.members[host]
    if rank == carriers[host] and layout.n_hosts > 1:
        p.add(binomial_broadcast(layout.n_hosts, host, count, root=root_host, channel=channel), carriers,
              network=True)
    else:
        p.next_phase()
    if len(local) > 1:
        p.add(binomial_broadcast(len(local), local.index(rank), count, root=local.index(carriers[host]),
                                 channel=channel), local, network=False)
    return p.build(channel)


def host_hierarchical_allgather(world_size: int, rank: int, count: int, *, hosts: Sequence[int],
                                channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Piece ``r`` of ``data`` (``partition.pieces(count, world_size)``) from rank ``r`` to
    every rank, through the hosts' leaders (module docstring)."""
    layout = HostLayout(hosts, world_size)
    b = ScheduleBuilder("host_hierarchical_allgather", rank, world_size)
    b.buffer("data", count)
    piece = pieces(count, world_size)
    host = layout.host_of[rank]
    local = layout.members[host]
    leader = local[0]
    sent = across = 0

    def block(ranks: Sequence[int]) -> list[Slice]:
        """The pieces of ``ranks`` as slices, one per run of consecutive ranks."""
        runs: list[Slice] = []
        for r in sorted(ranks):
            if runs and runs[-1].end == piece[r].offset and piece[r].length:
                runs[-1] = Slice("data", runs[-1].offset, runs[-1].length + piece[r].length)
            elif piece[r].length or not runs:
                runs.append(piece[r])
        return runs

    if rank != leader:
        # 1. hand my piece to the leader; 3. get back every piece I lack.
        b.send(leader, piece[rank], 0, channel=channel)
        sent += piece[rank].length
        others = [r for r in range(world_size) if r != rank]
        for index, sl in enumerate(block(others)):
            b.recv(leader, sl, 2 * PHASE_TAGS + index, channel=channel)
        return b.build(Cost(steps=2 + (layout.n_hosts > 1), elements_sent={channel: sent}, elements_across_hosts=0))
    gathered = [b.recv(member, piece[member], 0, channel=channel) for member in local[1:]]
    # 2. my host's block to every other leader (in runs), theirs to me.
    own_block = block(local)
    received = list(gathered)
    for other, ranks in enumerate(layout.members):
        if other == host:
            continue
        for index, sl in enumerate(own_block):
            b.send(ranks[0], sl, PHASE_TAGS + index, gathered, channel=channel)
            sent += sl.length
            across += sl.length
        for index, sl in enumerate(block(ranks)):
            received.append(b.recv(ranks[0], sl, PHASE_TAGS + index, channel=channel))
    # 3. every piece a member lacks, once everything is here.
    for member in local[1:]:
        for index, sl in enumerate(block([r for r in range(world_size) if r != member])):
            b.send(member, sl, 2 * PHASE_TAGS + index, received, channel=channel)
            sent += sl.length
    return b.build(Cost(steps=2 + (layout.n_hosts > 1), elements_sent={channel: sent}, elements_across_hosts=across))
