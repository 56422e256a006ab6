"""Run a whole set of per-rank schedules in one thread on numpy arrays.

A reference interpreter for tests of builders: no transport, no threads, deterministic.
Messages are delivered in the order the validator's progress check would deliver them.

Exercise it with ``python -m pytest tests/unit/test_collectives.py``.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from .ir import Copy, DepMode, Recv, Reduce, Schedule, Send, Slice
from .validate import ScheduleError

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
    parked: dict[tuple[int, int, str, int], tuple[int, int]] = {}
    done = [[False] * len(s.ops) for s in schedules]
    waiting = [[len(op.deps) for op in s.ops] for s in schedules]
    dependents = [s.dependents() for s in schedules]
    ready = deque((r, i) for r, s in enumerate(schedules) for i, op in enumerate(s.ops) if not op.deps)
    while ready:
        rank, i = ready.popleft()
        if done[rank][i]:
            continue
        op = schedules[rank].ops[i]
        if isinstance(op, Recv):
            key = (op.peer, rank, op.channel, op.tag)
            if key not in in_flight:
                parked[key] = (rank, i)
                continue
            payload = in_flight.pop(key)
            dst = view(rank, op.dst)
            if op.reduce:
                _NUMPY_REDUCE[op.reduce](dst, payload, out=dst)
            else:
                dst[:] = payload
        elif isinstance(op, Send):
            key = (rank, op.peer, op.channel, op.tag)
            in_flight[key] = view(rank, op.src).copy()
            if key in parked:
                ready.append(parked.pop(key))
        elif isinstance(op, Reduce):
            dst = view(rank, op.dst)
            _NUMPY_REDUCE[op.op](dst, view(rank, op.src), out=dst)
        elif isinstance(op, Copy):
            view(rank, op.dst)[:] = view(rank, op.src)
        done[rank][i] = True
        for j in dependents[rank][i]:
            if schedules[rank].ops[j].mode is DepMode.ANY:
                ready.append((rank, j))
            else:
                waiting[rank][j] -= 1
                if waiting[rank][j] == 0:
                    ready.append((rank, j))
    if not all(all(flags) for flags in done):
        raise ScheduleError("interpretation stalled: the schedule set deadlocks")
    return [bufs["data"] for bufs in buffers]
