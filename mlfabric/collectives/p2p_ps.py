"""The P2P parameter server as an allreduce (BML §2, the baseline of BML's experiments).

Every rank is both a worker and a parameter server: rank ``j`` serves shard ``j`` (the
buffer cut into N pieces as in ``partition``). *Push*: every rank sends shard ``j`` of its
gradient to rank ``j``, which reduces the N-1 shards it receives into its own. *Pull*: every
rank sends its reduced shard to every other rank. Each rank talks to every other rank
directly, so on a non-blocking network the GST is ``2 (N-1)/N * T_F`` like the ring's, in 2
steps instead of ``2 (N-1)``; on BCube its flows cross several hops and it needs twice
BML's time (BML §3.3).

**Parts.** A rank's pull can leave only when all N-1 pushes of its shard have arrived and
been reduced, so every NIC idles between the two steps (on the emulated 9-host star, PS took
1.14x its simulated time in one part). With ``parts=P`` the buffer is cut into P slices,
each a push and a pull of its own: a connection carries the pushes of every slice before any
pull, and slice 0's pull is ready while slice 1's push is on the wire. The simulated time of
a non-blocking network does not change.

Cost per rank (count elements, N ranks, shards ``s_i``): 2 steps, ``count + (N-2) s_rank``
elements sent (``2 (N-1)/N * count`` when N divides count; ``s_rank`` summed over the parts).

Exercise it with ``python -m pytest tests/unit/test_bcube.py -k ps``.
"""

from __future__ import annotations

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

from .partition import pieces

PUSH_TAG, PULL_TAG = 0, 1


def p2p_ps_allreduce(world_size: int, rank: int, count: int, *, op: str = "sum",
                     channel: str = DEFAULT_CHANNEL, parts: int = 1) -> Schedule:
    """``parts``: cut the buffer into that many consecutive slices, each pushed and pulled on
    its own; every connection carries all pushes before any pull, so a slice's pull leaves
    while later slices' pushes are still on the wire ("Parts" above)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    b = ScheduleBuilder("p2p_ps_allreduce", rank, world_size)
    b.buffer("data", count)
    # Per part, the N shards of that part (rank j serves shard j of every part).
    shard_slices = [[Slice("data", part.offset + shard.offset, shard.length)
                     for shard in pieces(part.length, world_size)] for part in pieces(count, parts)]
    # Start with the next rank so that not every rank pushes to rank 0 first.
    peers = [(rank + shift) % world_size for shift in range(1, world_size)]
    pushes = [{peer: b.send(peer, shards[peer], PUSH_TAG + 2 * p, channel=channel) for peer in peers}
              for p, shards in enumerate(shard_slices)]
    for p, shards in enumerate(shard_slices):
        reduced: list[int] = []
        for peer in peers:
            # Chained: the reductions of one shard would race otherwise.
            reduced.append(b.recv(peer, shards[rank], PUSH_TAG + 2 * p, reduced[-1:], channel=channel, reduce=op))
        for peer in peers:
            b.send(peer, shards[rank], PULL_TAG + 2 * p, reduced[-1:], channel=channel)
        for peer in peers:
            # Overwrites the shard pushed to this peer: wait until that send has read it.
            b.recv(peer, shards[peer], PULL_TAG + 2 * p, [pushes[p][peer]], channel=channel)
    # Push everything but the own shard, pull the own shard to N-1 ranks.
    own = sum(shards[rank].length for shards in shard_slices)
    sent = count + (world_size - 2) * own if world_size > 1 else 0
    # Push and pull each send to all N-1 peers at once: each gets 1/(N-1) of the NIC.
    shares = {(peer, channel): 1 / len(peers) for peer in peers} if len(peers) > 1 else {}
    return b.build(Cost(steps=2 if world_size > 1 else 0, elements_sent={channel: sent}, link_shares=shares))
