"""Recursive halving-doubling allreduce (Rabenseifner) for any world size.

With p = the largest power of two <= N and r = N - p:

1. *fold*: of the first 2r ranks, each even rank 2i sends its whole vector to rank 2i+1,
   which reduces it in place (fused receive-reduce). The even ranks then sit out; the p
   remaining ranks get virtual ranks 0..p-1 (rank 2i+1 -> i, rank j >= 2r -> j - r).
2. *recursive halving* (reduce-scatter): the buffer is cut into p pieces
   (``partition.pieces``, sizes differ by at most one). At distances p/2, p/4, ..., 1 a rank
   exchanges with virtual partner ``v ^ distance``: it sends the half of its current window
   the partner keeps and reduces the partner's copy of the half it keeps. Virtual rank v ends
   with piece v fully reduced.
3. *recursive doubling* (allgather): at distances 1, 2, ..., p/2 a rank sends its window (the
   aligned block of ``distance`` pieces holding piece v) and receives the partner's block.
4. *unfold*: rank 2i+1 sends the whole result back to rank 2i.

The fold sends the whole vector (not MPICH's variant that exchanges halves and reduces in
parallel): it costs one round instead of two and keeps the excluded ranks' part trivial; the
price is that the reduction of the folded pairs is not split between the two ranks.

Cost (count elements, L = log2 p, s_j = size of piece j of count split into p pieces,
B_k(v) = elements in the aligned block of 2^k pieces holding piece v):

* steps, every rank:               2L, plus 2 (fold + unfold) when r > 0
* rank j >= 2r (virtual v = j-r):  ``(count - s_v) + sum_{k<L} B_k(v)``  (= 2(p-1)/p * count
  when p divides count)
* odd rank 2i+1 < 2r (virtual i):  the same with v = i, plus ``count`` for the unfold
* even rank 2i < 2r:               ``count`` (the fold), receives the result

Non-power-of-two world sizes are therefore unbalanced: the odd ranks of the first 2r send
about ``count`` more than the rest, the even ones about ``count`` less.

Exercise it with ``python -m pytest tests/unit/test_collectives.py -k halving``.
"""

from __future__ import annotations

from typing import Callable

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

from .partition import pieces

TAG_FOLD = 0
TAG_CORE = 1  # halving uses TAG_CORE + k, doubling TAG_CORE + L + k, unfold TAG_CORE + 2L


def halving_doubling_allreduce(world_size: int, rank: int, count: int, *, op: str = "sum",
                               channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Allreduce ``data`` (``count`` elements) in place with recursive halving-doubling."""
    if not 0 <= rank < world_size:
        raise ValueError(f"halving_doubling_allreduce: rank {rank} outside world of {world_size}")
    if count < 0:
        raise ValueError(f"halving_doubling_allreduce: negative count {count}")
    b = ScheduleBuilder("halving_doubling_allreduce", rank, world_size)
    b.buffer("data", count)
    p2 = 1 << (world_size.bit_length() - 1)
    extra = world_size - p2
    levels = p2.bit_length() - 1
    whole = Slice("data", 0, count)
    tag_unfold = TAG_CORE + 2 * levels
    vrank = _virtual_rank(rank, extra)
    if vrank is None:
        # Even rank of a folded pair: hand the vector over, get the result back. The receive
        # overwrites what the fold send reads, so it waits for that send to complete.
        fold = b.send(rank + 1, whole, TAG_FOLD, channel=channel)
        b.recv(rank + 1, whole, tag_unfold, [fold], channel=channel)
    else:
        folded = rank < 2 * extra
        fold = b.recv(rank - 1, whole, TAG_FOLD, channel=channel, reduce=op) if folded else None
        last = _halving_doubling_ops(b, pieces(count, p2), vrank, lambda v: _real_rank(v, extra),
                                     op, channel, tag_base=TAG_CORE, after=fold)
        if folded:
            b.send(rank - 1, whole, tag_unfold, last, channel=channel)
    return b.build(Cost(steps=2 * levels + (2 if extra else 0),
                        elements_sent={channel: _elements_sent(world_size, rank, count)}))


def _virtual_rank(rank: int, extra: int) -> int | None:
    """Rank among the p ranks that run the power-of-two core; None for a folded-away rank."""
    if rank < 2 * extra:
        return None if rank % 2 == 0 else rank // 2
    return rank - extra


def _real_rank(vrank: int, extra: int) -> int:
    return 2 * vrank + 1 if vrank < extra else vrank + extra


def _span(segs: list[Slice], lo: int, hi: int) -> Slice:
    """Pieces ``lo..hi-1`` as one contiguous slice."""
    return Slice(segs[lo].buffer, segs[lo].offset, segs[hi - 1].end - segs[lo].offset)


def _halving_doubling_ops(b: ScheduleBuilder, segs: list[Slice], vrank: int,
                          real: Callable[[int], int], op: str, channel: str, *,
                          tag_base: int, after: int | None) -> list[int]:
    """Power-of-two core on ``len(segs)`` virtual ranks; returns the ops the result depends on.

    ``after``: an op every core op must follow (the fold's receive-reduce of the whole buffer).
    """
    p2 = len(segs)
    levels = p2.bit_length() - 1
    lo, hi = 0, p2
    last_reduce = after
    given: dict[int, tuple[int, tuple[int, int]]] = {}  # distance -> (send op, pieces sent)
    for k in range(levels):
        dist = p2 >> (k + 1)
        peer = real(vrank ^ dist)
        mid = lo + dist
        keep, give = ((mid, hi), (lo, mid)) if vrank & dist else ((lo, mid), (mid, hi))
        tag = tag_base + k
        s = b.send(peer, _span(segs, *give), tag, [last_reduce], channel=channel)
        last_reduce = b.recv(peer, _span(segs, *keep), tag, [last_reduce], channel=channel,
                             reduce=op)
        given[dist] = (s, give)
        lo, hi = keep
    gathered: list[int] = []
    for k in range(levels):
        dist = 1 << k
        peer = real(vrank ^ dist)
        tag = tag_base + levels + k
        b.send(peer, _span(segs, lo, hi), tag, [last_reduce, *gathered], channel=channel)
        # The partner's block is exactly what this rank gave away at the same distance while
        # halving; the receive overwrites it, so it waits for that send to complete.
        halving_send, region = given[dist]
        gathered.append(b.recv(peer, _span(segs, *region), tag, [halving_send], channel=channel))
        lo, hi = min(lo, region[0]), max(hi, region[1])
    return [d for d in (last_reduce, *gathered) if d is not None]


def _block_elements(count: int, parts: int, lo: int, hi: int) -> int:
    """Elements in pieces ``lo..hi-1`` of ``count`` split into ``parts`` (the first
    ``count % parts`` pieces hold one extra element)."""
    base, extra = divmod(count, parts)
    return (hi - lo) * base + max(0, min(hi, extra) - lo)


def _elements_sent(world_size: int, rank: int, count: int) -> int:
    """The closed form of the module docstring."""
    p2 = 1 << (world_size.bit_length() - 1)
    extra = world_size - p2
    levels = p2.bit_length() - 1
    vrank = _virtual_rank(rank, extra)
    if vrank is None:
        return count
    halving = count - _block_elements(count, p2, vrank, vrank + 1)
    doubling = sum(
        _block_elements(count, p2, (vrank >> k) << k, ((vrank >> k) << k) + (1 << k))
        for k in range(levels)
    )
    return halving + doubling + (count if rank < 2 * extra else 0)
