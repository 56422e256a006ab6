"""Direct collectives: gather, scatter and all-to-all, every message straight to its owner.

Gather and scatter move N-1 distinct pieces between one root and the others, and all-to-all
moves a distinct piece between every pair: no piece is ever forwarded, so a tree or ring
would only add hops (gloo's gather, scatter and alltoall are direct too). Every transfer is
posted at once; the root's (or every rank's) NIC shares its rate among the N-1 connections,
which the ``link_shares`` of each cost say so the runtime can pace them fairly.

Pieces may differ in size (``counts``; all-to-all's ``send_counts``/``recv_counts`` per peer,
as ``torch.distributed.all_to_all_single``'s splits). One buffer per rank, ``data``:

* gather: at the root the N pieces back to back (piece r at ``sum(counts[:r])``), the root's
  own piece already in place; elsewhere the rank's piece.
* scatter: the same layout; afterwards every non-root holds its piece.
* all-to-all: the input pieces (to peer 0, 1, ...) followed by the output pieces (from peer
  0, 1, ...); the rank's own piece is copied, the others exchanged pairwise, rank r sending to
  r+s while receiving from r-s for s = 1..N-1.

Cost per rank (N ranks): gather sends ``counts[rank]`` (0 at the root), scatter sends
``sum(counts) - counts[root]`` at the root (0 elsewhere), all-to-all sends
``sum(send_counts) - send_counts[rank]``; one step each.

Exercise it with ``python -m pytest tests/unit/test_direct_collectives.py``.
"""

from __future__ import annotations

from itertools import accumulate

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

TAG = 0  # one message per (sender, receiver) pair: the pair itself tells them apart


def direct_gather(world_size: int, rank: int, count: int, *, root: int = 0,
                  counts: tuple[int, ...], channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Rank r's ``counts[r]`` elements end in the root's ``data`` at ``sum(counts[:r])``."""
    offsets = _layout(world_size, rank, count, root, counts)
    b = ScheduleBuilder("direct_gather", rank, world_size)
    b.buffer("data", count)
    if rank == root:
        for peer in _others(world_size, rank):
            b.recv(peer, Slice("data", offsets[peer], counts[peer]), TAG, channel=channel)
        return b.build(Cost(steps=1, elements_sent={channel: 0}))
    b.send(root, Slice("data", 0, counts[rank]), TAG, channel=channel)
    return b.build(Cost(steps=1, elements_sent={channel: counts[rank]}))


def direct_scatter(world_size: int, rank: int, count: int, *, root: int = 0,
                   counts: tuple[int, ...], channel: str = DEFAULT_CHANNEL) -> Schedule:
    """The root's ``data`` at ``sum(counts[:r])`` (``counts[r]`` elements) ends in rank r's."""
    offsets = _layout(world_size, rank, count, root, counts)
    b = ScheduleBuilder("direct_scatter", rank, world_size)
    b.buffer("data", count)
    if rank != root:
        b.recv(root, Slice("data", 0, counts[rank]), TAG, channel=channel)
        return b.build(Cost(steps=1, elements_sent={channel: 0}))
    peers = _others(world_size, rank)
    for peer in peers:
        b.send(peer, Slice("data", offsets[peer], counts[peer]), TAG, channel=channel)
    return b.build(Cost(steps=1, elements_sent={channel: sum(counts) - counts[rank]},
                        link_shares=_shares(peers, channel)))


def pairwise_all_to_all(world_size: int, rank: int, count: int, *, send_counts: tuple[int, ...],
                        recv_counts: tuple[int, ...], channel: str = DEFAULT_CHANNEL) -> Schedule:
    """``send_counts[p]`` elements of the input go to peer p; ``recv_counts[p]`` come from it
    (and must equal p's ``send_counts[rank]``: the runtime checks each message's size)."""
    _check_rank(world_size, rank)
    for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        _check_counts(world_size, counts, name)
    sent_total = sum(send_counts)
    if count != sent_total + sum(recv_counts):
        raise ValueError(f"all-to-all buffer of {count} elements does not hold the {sent_total} "
                         f"sent and {sum(recv_counts)} received")
    send_at, recv_at = _offsets(send_counts), [sent_total + o for o in _offsets(recv_counts)]
    b = ScheduleBuilder("pairwise_all_to_all", rank, world_size)
    b.buffer("data", count)
    b.copy(Slice("data", recv_at[rank], recv_counts[rank]), Slice("data", send_at[rank], send_counts[rank]))
    for shift in range(1, world_size):
        to, frm = (rank + shift) % world_size, (rank - shift) % world_size
        b.send(to, Slice("data", send_at[to], send_counts[to]), TAG, channel=channel)
        b.recv(frm, Slice("data", recv_at[frm], recv_counts[frm]), TAG, channel=channel)
    peers = _others(world_size, rank)
    return b.build(Cost(steps=1, elements_sent={channel: sent_total - send_counts[rank]},
                        link_shares=_shares(peers, channel)))


def _layout(world_size: int, rank: int, count: int, root: int, counts: tuple[int, ...]) -> list[int]:
    """Check a rooted collective's arguments; the offset of every rank's piece at the root."""
    _check_rank(world_size, rank)
    if not 0 <= root < world_size:
        raise ValueError(f"root {root} is outside world size {world_size}")
    _check_counts(world_size, counts, "counts")
    expected = sum(counts) if rank == root else counts[rank]
    if count != expected:
        where = "the root holds every piece" if rank == root else f"rank {rank} holds its piece"
        raise ValueError(f"buffer of {count} elements, expected {expected} ({where}: counts {counts})")
    return _offsets(counts)


def _check_rank(world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")


def _check_counts(world_size: int, counts: tuple[int, ...], name: str) -> None:
    if len(counts) != world_size or any(c < 0 for c in counts):
        raise ValueError(f"{name} must be {world_size} non-negative sizes, got {counts}")


def _offsets(counts: tuple[int, ...]) -> list[int]:
    return [0, *accumulate(counts)][:-1]


def _others(world_size: int, rank: int) -> list[int]:
    """The other ranks, starting after this one (so not every rank talks to rank 0 first)."""
    return [(rank + shift) % world_size for shift in range(1, world_size)]


def _shares(peers: list[int], channel: str) -> dict[tuple[int, str], float]:
    """Concurrent connections to ``peers`` share the NIC equally."""
    return {(peer, channel): 1 / len(peers) for peer in peers}
