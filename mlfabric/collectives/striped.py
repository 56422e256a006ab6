"""Striped copy: several ranks that hold the same buffer copy it to the others, chunk by chunk.

The state transfer of elastic training (``mlfabric/runtime/elastic.py``): a process joining a
running job (or a survivor that missed the last step) receives the model and optimizer state
from *every* live member that holds it, not from one, so the transfer is not bounded by one
sender's NIC (torchft's live recovery reads from one healthy peer). ``data`` is cut into
chunks of ``chunk`` elements; chunk ``j`` comes from ``sources[j % len(sources)]`` to every
receiver. Senders post all their chunks at once (the transport queues them per connection);
receivers post one receive per chunk.

Cost: a source sends its chunks (about ``count / len(sources)`` elements) to each receiver; a
receiver sends nothing; one step.

Exercise it with ``python -m pytest tests/unit/test_elastic_membership.py``.
"""

from __future__ import annotations

from mlfabric.schedule import DEFAULT_CHANNEL, MAX_OP_TAG, Cost, Schedule, ScheduleBuilder, Slice

#: Default chunk: large enough that a chunk's fixed cost is small, small enough that 100 MB
#: spreads over several senders.
DEFAULT_CHUNK_ELEMENTS = 4 << 20


def stripes(count: int, sources: tuple[int, ...], chunk: int) -> list[tuple[int, int, int]]:
    """``(offset, length, source)`` of every chunk of ``count`` elements, round-robin over
    ``sources``. The chunk grows when ``count / chunk`` would exceed the tag space."""
    if not sources:
        raise ValueError("a striped copy needs at least one source")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
    chunk = max(chunk, -(-count // (MAX_OP_TAG + 1)))
    return [(offset, min(chunk, count - offset), sources[(offset // chunk) % len(sources)])
            for offset in range(0, count, chunk)]


def striped_copy(world_size: int, rank: int, count: int, *, sources: tuple[int, ...],
                 receivers: tuple[int, ...], chunk: int = DEFAULT_CHUNK_ELEMENTS,
                 channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Rank ``rank``'s part of copying ``data`` (``count`` elements) from ``sources`` (which
    hold identical copies) to ``receivers``; ranks in neither take no part (an empty schedule)."""
    sources, receivers = tuple(sources), tuple(receivers)
    if set(sources) & set(receivers):
        raise ValueError(f"ranks {sorted(set(sources) & set(receivers))} are both sources and receivers")
    for who in (*sources, *receivers):
        if not 0 <= who < world_size:
            raise ValueError(f"rank {who} is outside world size {world_size}")
    plan = stripes(count, sources, chunk)
    b = ScheduleBuilder("striped_copy", rank, world_size)
    b.buffer("data", count)
    sent = 0
    for tag, (offset, length, source) in enumerate(plan):
        piece = Slice("data", offset, length)
        if rank == source:
            for receiver in receivers:
                b.send(receiver, piece, tag, channel=channel)
                sent += length
        elif rank in receivers:
            b.recv(source, piece, tag, channel=channel)
    return b.build(Cost(steps=1, elements_sent={channel: sent}))
