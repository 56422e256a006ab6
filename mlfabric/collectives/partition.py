"""How a flat buffer of ``count`` elements is cut into pieces shared by every builder.

Pieces differ in size by at most one element (the first ``count % parts`` get the extra one),
the same rule as ``torch.tensor_split``, so ``reduce_scatter`` shards line up with it.

Exercise it with ``python -m pytest tests/unit/test_collectives.py``.
"""

from __future__ import annotations

from functools import lru_cache

from mlfabric.schedule import Slice


def piece_sizes(count: int, parts: int) -> list[int]:
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def piece_offsets(count: int, parts: int) -> list[int]:
    offsets = [0]
    for size in piece_sizes(count, parts)[:-1]:
        offsets.append(offsets[-1] + size)
    return offsets


def pieces(count: int, parts: int, buffer: str = "data", base: int = 0) -> list[Slice]:
    """``parts`` consecutive slices covering ``count`` elements starting at ``base``."""
    return list(_pieces(count, parts, buffer, base))


@lru_cache(maxsize=64)
def _pieces(count: int, parts: int, buffer: str, base: int) -> tuple[Slice, ...]:
    # Every rank of a collective cuts the same buffer: the simulator builds 8,192 ranks'
    # schedules, and 8,192 fresh slices per rank were most of a halving-doubling's build
    # (14 ms a rank, 2 min in all; #37). Slices are immutable, so ranks can share them.
    return tuple(Slice(buffer, base + off, size)
                 for off, size in zip(piece_offsets(count, parts), piece_sizes(count, parts)))


def subdivide(sl: Slice, parts: int) -> list[Slice]:
    """Split one slice into ``parts`` pipelining chunks (some may be empty)."""
    return pieces(sl.length, parts, sl.buffer, sl.offset)


def chunks_for(elements: int, min_chunk_elements: int, max_chunks: int) -> int:
    """How many pipelining chunks a segment of ``elements`` gets: enough to overlap transfer
    with reduction, never so many that per-message overhead dominates."""
    if elements <= 0:
        return 1
    return max(1, min(max_chunks, elements // max(1, min_chunk_elements)))
