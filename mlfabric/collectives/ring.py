"""Ring collectives: reduce-scatter, allgather and allreduce (= reduce-scatter + allgather).

The buffer is cut into N segments (N = world size). In each of N-1 steps every rank sends
one segment to its right neighbour and receives one from its left neighbour; segments are
further cut into pipelining chunks so that reducing chunk c overlaps with receiving c+1.

Cost per rank (count elements, N ranks, segments s_i as in ``partition.piece_sizes``):

* reduce-scatter: N-1 steps, sends ``count - s_own`` elements
* allgather:      N-1 steps, sends ``count - s_next`` elements
* allreduce:      2(N-1) steps, about ``2 (N-1)/N * count`` elements

Exercise it with ``python -m pytest tests/unit/test_collectives.py -k ring``.
"""

from __future__ import annotations

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

from .partition import chunks_for, piece_sizes, pieces, subdivide

# A pipelining chunk is at least 4 Mi elements (16 MB of float32); a segment gets at most 8.
# Measured (docs/results.md): every message costs the Python progress path a fixed amount
# (frames, trackers, wake-ups), and on CPU-bound hosts 2 MB chunks were 10-15% slower at
# 64 MB than one chunk per segment; ranks still overlap one another's steps.
MIN_CHUNK_ELEMENTS = 1 << 22
MAX_CHUNKS = 8


def default_chunks(count: int, world_size: int) -> int:
    """Chunks per segment; computed from global values so every rank agrees."""
    return chunks_for(count // max(1, world_size), MIN_CHUNK_ELEMENTS, MAX_CHUNKS)


def ring_allreduce(world_size: int, rank: int, count: int, *, op: str = "sum",
                   chunks: int | None = None, channel: str = DEFAULT_CHANNEL) -> Schedule:
    chunks = chunks or default_chunks(count, world_size)
    b = ScheduleBuilder("ring_allreduce", rank, world_size)
    b.buffer("data", count)
    segs = [subdivide(s, chunks) for s in pieces(count, world_size)]
    owned = (rank + 1) % world_size
    rs = _reduce_scatter_ops(b, segs, owned, op, channel, tag_base=0)
    _allgather_ops(b, segs, owned, channel, tag_base=world_size * chunks, after=rs)
    sizes = piece_sizes(count, world_size)
    sent = 0 if world_size == 1 else 2 * count - sizes[owned] - sizes[(owned + 1) % world_size]
    return b.build(Cost(steps=2 * (world_size - 1), elements_sent={channel: sent}))


def ring_reduce_scatter(world_size: int, rank: int, count: int, *, op: str = "sum",
                        chunks: int | None = None, channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Afterwards segment ``rank`` of ``data`` holds the reduction of everyone's segment."""
    chunks = chunks or default_chunks(count, world_size)
    b = ScheduleBuilder("ring_reduce_scatter", rank, world_size)
    b.buffer("data", count)
    segs = [subdivide(s, chunks) for s in pieces(count, world_size)]
    _reduce_scatter_ops(b, segs, rank, op, channel, tag_base=0)
    sent = 0 if world_size == 1 else count - piece_sizes(count, world_size)[rank]
    return b.build(Cost(steps=world_size - 1, elements_sent={channel: sent}))


def ring_allgather(world_size: int, rank: int, count: int, *, chunks: int | None = None,
                   channel: str = DEFAULT_CHANNEL) -> Schedule:
    """``data`` holds ``count`` elements; segment ``rank`` is this rank's contribution and
    afterwards every segment holds its owner's contribution."""
    chunks = chunks or default_chunks(count, world_size)
    b = ScheduleBuilder("ring_allgather", rank, world_size)
    b.buffer("data", count)
    segs = [subdivide(s, chunks) for s in pieces(count, world_size)]
    _allgather_ops(b, segs, rank, channel, tag_base=0, after=None)
    sent = 0 if world_size == 1 else count - piece_sizes(count, world_size)[(rank + 1) % world_size]
    return b.build(Cost(steps=world_size - 1, elements_sent={channel: sent}))


def _reduce_scatter_ops(b: ScheduleBuilder, segs: list[list[Slice]], owned: int, op: str,
                        channel: str, *, tag_base: int) -> dict[tuple[int, int], list[int]]:
    """Ring reduce-scatter ending with segment ``owned`` fully reduced on this rank.

    Returns, per (segment, chunk), the last op that read it and the last that wrote it, so a
    following phase can order itself after them.
    """
    n, chunks = b.world_size, len(segs[0])
    right, left = (b.rank + 1) % n, (b.rank - 1) % n
    last_recv: list[int | None] = [None] * chunks
    hazards: dict[tuple[int, int], list[int]] = {}
    for step in range(n - 1):
        send_seg = (owned - 1 - step) % n
        recv_seg = (owned - 2 - step) % n
        for c in range(chunks):
            tag = tag_base + step * chunks + c
            s = b.send(right, segs[send_seg][c], tag, [last_recv[c]], channel=channel)
            r = b.recv(left, segs[recv_seg][c], tag, channel=channel, reduce=op)
            hazards.setdefault((send_seg, c), []).append(s)
            hazards.setdefault((recv_seg, c), []).append(r)
            last_recv[c] = r
    return hazards


def _allgather_ops(b: ScheduleBuilder, segs: list[list[Slice]], owned: int, channel: str, *,
                   tag_base: int, after: dict[tuple[int, int], list[int]] | None) -> None:
    """Ring allgather starting from segment ``owned`` being complete on this rank.

    ``after`` maps (segment, chunk) to earlier ops touching it: a receive overwriting a
    segment must wait for them (e.g. the reduce-scatter send still reading it).
    """
    n, chunks = b.world_size, len(segs[0])
    right, left = (b.rank + 1) % n, (b.rank - 1) % n
    after = after or {}
    last_recv: list[int | None] = [None] * chunks
    for step in range(n - 1):
        send_seg = (owned - step) % n
        recv_seg = (owned - 1 - step) % n
        for c in range(chunks):
            tag = tag_base + step * chunks + c
            send_deps = [last_recv[c]] + (after.get((send_seg, c), []) if step == 0 else [])
            b.send(right, segs[send_seg][c], tag, send_deps, channel=channel)
            last_recv[c] = b.recv(left, segs[recv_seg][c], tag, after.get((recv_seg, c), []),
                                  channel=channel)
