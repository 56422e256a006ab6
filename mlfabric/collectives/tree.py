"""Binomial-tree collectives: reduce, broadcast and allreduce (= reduce + broadcast).

Ranks are relabelled relative to the root, v = (rank - root) mod N. In the binomial tree the
parent of v != 0 is v minus its lowest set bit, and the children of v are v + 2^k for every
2^k below that lowest bit (every k for the root) with v + 2^k < N. With L = ceil(log2 N):

* reduce: in round k (k = 0..L-1) every v whose lowest set bit is 2^k sends to its parent,
  which reduces it in place (fused receive-reduce); children are thus drained smallest
  subtree first and the root ends with the reduction.
* broadcast: the mirror image — in round j the ranks holding the data send to v + 2^(L-1-j),
  so the root sends to its children largest subtree first.

The buffer is cut into pipelining chunks; chunk c of a round depends only on chunk c of the
previous round, so a rank forwards chunk c while chunk c+1 is still arriving.

Cost per rank (count elements, N ranks, L = ceil(log2 N), children
``c(v) = min(tz(v), ceil(log2(N - v)))`` with tz the number of trailing zero bits and
``tz(0) = infinity``, so the root has ``c(0) = L`` children):

* reduce:    L steps, sends ``count`` (``0`` at the root)
* broadcast: L steps, sends ``c(v) * count``
* allreduce: 2L steps, sends ``(c(v) + [v != 0]) * count`` — leaves send ``count``, the root
  ``L * count``: the tree trades the ring's bandwidth balance for log-depth latency.

Exercise it with ``python -m pytest tests/unit/test_collectives.py -k tree``.
"""

from __future__ import annotations

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

from .partition import chunks_for, subdivide
from .ring import MAX_CHUNKS, MIN_CHUNK_ELEMENTS


def default_chunks(count: int) -> int:
    """Chunks of the whole buffer; computed from global values so every rank agrees."""
    return chunks_for(count, MIN_CHUNK_ELEMENTS, MAX_CHUNKS)


def tree_allreduce(world_size: int, rank: int, count: int, *, op: str = "sum",
                   chunks: int | None = None, channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Binomial reduce to rank 0 followed by binomial broadcast from rank 0."""
    _check(world_size, rank, count, 0)
    chunks = chunks or default_chunks(count)
    b = ScheduleBuilder("tree_allreduce", rank, world_size)
    b.buffer("data", count)
    parts = subdivide(Slice("data", 0, count), chunks)
    reduced = _reduce_ops(b, parts, 0, op, channel, tag_base=0)
    _broadcast_ops(b, parts, 0, channel, tag_base=chunks, after=reduced)
    levels = _ceil_log2(world_size)
    sent = (_children(world_size, rank) + (1 if rank != 0 else 0)) * count
    return b.build(Cost(steps=2 * levels, elements_sent={channel: sent}))


def binomial_reduce(world_size: int, rank: int, count: int, *, root: int = 0, op: str = "sum",
                    chunks: int | None = None, channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Afterwards ``root``'s ``data`` holds the reduction of everyone's; other ranks' ``data``
    holds partial reductions (their subtree's) and should be treated as scratch."""
    _check(world_size, rank, count, root)
    chunks = chunks or default_chunks(count)
    b = ScheduleBuilder("binomial_reduce", rank, world_size)
    b.buffer("data", count)
    _reduce_ops(b, subdivide(Slice("data", 0, count), chunks), root, op, channel, tag_base=0)
    sent = count if rank != root else 0
    return b.build(Cost(steps=_ceil_log2(world_size), elements_sent={channel: sent}))


def binomial_broadcast(world_size: int, rank: int, count: int, *, root: int = 0,
                       chunks: int | None = None, channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Afterwards every rank's ``data`` equals ``root``'s."""
    _check(world_size, rank, count, root)
    chunks = chunks or default_chunks(count)
    b = ScheduleBuilder("binomial_broadcast", rank, world_size)
    b.buffer("data", count)
    _broadcast_ops(b, subdivide(Slice("data", 0, count), chunks), root, channel, tag_base=0,
                   after=None)
    sent = _children(world_size, (rank - root) % world_size) * count
    return b.build(Cost(steps=_ceil_log2(world_size), elements_sent={channel: sent}))


def _check(world_size: int, rank: int, count: int, root: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    if not 0 <= root < world_size:
        raise ValueError(f"root {root} outside world of {world_size}")
    if count < 0:
        raise ValueError(f"negative count {count}")


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def _children(world_size: int, vrank: int) -> int:
    """Number of children of relative rank ``vrank``: the closed form of the docstring."""
    below = _ceil_log2(world_size - vrank)  # #{k : vrank + 2^k < world_size}
    if vrank == 0:
        return below
    trailing = (vrank & -vrank).bit_length() - 1
    return min(trailing, below)


def _lowbit(vrank: int, world_size: int) -> int:
    """Lowest set bit of ``vrank``; for the root, a bit above every child distance."""
    return vrank & -vrank if vrank else 1 << _ceil_log2(world_size)


def _reduce_ops(b: ScheduleBuilder, parts: list[Slice], root: int, op: str, channel: str, *,
                tag_base: int) -> list[int | None]:
    """Binomial reduce towards ``root``; returns per chunk the last op touching it (the send
    to the parent, or at the root the last receive-reduce), for a following phase."""
    n, chunks = b.world_size, len(parts)
    v = (b.rank - root) % n
    low = _lowbit(v, n)
    last: list[int | None] = [None] * chunks
    for k in range(_ceil_log2(n)):
        bit = 1 << k
        if bit == low and v:
            parent = (v - bit + root) % n
            for c in range(chunks):
                last[c] = b.send(parent, parts[c], tag_base + c, [last[c]], channel=channel)
        elif bit < low and v + bit < n:
            child = (v + bit + root) % n
            for c in range(chunks):
                # Receive-reduces into one chunk are read-modify-writes: chain them.
                last[c] = b.recv(child, parts[c], tag_base + c, [last[c]], channel=channel,
                                 reduce=op)
    return last


def _broadcast_ops(b: ScheduleBuilder, parts: list[Slice], root: int, channel: str, *,
                   tag_base: int, after: list[int | None] | None) -> None:
    """Binomial broadcast from ``root``. ``after[c]``: an earlier op touching chunk c that
    this phase must follow (the reduce phase's send still reading it, or its last reduce)."""
    n, chunks = b.world_size, len(parts)
    v = (b.rank - root) % n
    low = _lowbit(v, n)
    levels = _ceil_log2(n)
    have: list[int | None] = list(after) if after else [None] * chunks
    for j in range(levels):
        bit = 1 << (levels - 1 - j)
        if bit == low and v:
            parent = (v - bit + root) % n
            for c in range(chunks):
                have[c] = b.recv(parent, parts[c], tag_base + c, [have[c]], channel=channel)
        elif bit < low and v + bit < n:
            child = (v + bit + root) % n
            for c in range(chunks):
                b.send(child, parts[c], tag_base + c, [have[c]], channel=channel)
