"""Run a whole set of per-rank schedules in one thread on numpy arrays.

A reference interpreter for tests of builders: no transport, no threads, deterministic.
Ops fire in the order of the validator's ``walk`` (eager sends, consumable ops).

Exercise it with ``python -m pytest tests/unit/test_collectives.py``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .ir import Copy, Op, Recv, Reduce, Schedule, Send, Slice
from .validate import ScheduleError, walk

_NUMPY_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def interpret(schedules: Sequence[Schedule], data: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute ``schedules`` with ``data[r]`` as rank r's ``"data"`` buffer; returns the
    final ``"data"`` buffers (copies of the inputs, inputs are left untouched)."""
    buffers = []
    for sched, arr in zip(schedules, data, strict=True):
        bufs = {name: np.zeros(size, dtype=arr.dtype) for name, size in sched.buffers.items()}
        bufs["data"] = np.array(arr, copy=True).reshape(-1)
        if bufs["data"].size != sched.buffers["data"]:
            raise ValueError(
                f"rank {sched.rank}: data has {bufs['data'].size} elements, schedule expects "
                f"{sched.buffers['data']}"
            )
        buffers.append(bufs)

    def view(rank: int, sl: Slice) -> np.ndarray:
        return buffers[rank][sl.buffer][sl.offset:sl.end]

    in_flight: dict[tuple[int, int, str, int], np.ndarray] = {}

    def fire(rank: int, index: int, op: Op) -> None:
        if isinstance(op, Send):
            # Copied at send time: the sender may overwrite the slice afterwards.
            in_flight[(rank, op.peer, op.channel, op.tag)] = view(rank, op.src).copy()
        elif isinstance(op, Recv):
            payload = in_flight.pop((op.peer, rank, op.channel, op.tag))
            dst = view(rank, op.dst)
            if op.reduce:
                _NUMPY_REDUCE[op.reduce](dst, payload, out=dst)
            else:
                dst[:] = payload
        elif isinstance(op, Reduce):
            dst = view(rank, op.dst)
            _NUMPY_REDUCE[op.op](dst, view(rank, op.src), out=dst)
        elif isinstance(op, Copy):
            view(rank, op.dst)[:] = view(rank, op.src)

    done = walk(schedules, fire)
    if not all(all(flags) for flags in done):
        raise ScheduleError("interpretation stalled: the schedule set deadlocks")
    return [bufs["data"] for bufs in buffers]
