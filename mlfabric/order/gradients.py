"""The order a rank allreduces its gradient partitions in (ByteScheduler-style), as a pure plan.

    .venv/bin/python -m pytest tests/unit/test_order_gradients.py -q

TicTac's priorities say which parameter the next forward needs first. In allreduce-based
training the backward produces gradients in the *reverse* of that order, so DDP's default
(reduce each bucket as the backward hands it over, first come first served) reduces the
first layer's gradient last, and the next forward cannot start before every allreduce is
done. ByteScheduler (Peng et al., SOSP 2019) cuts tensors into partitions and sends the
ready partition with the highest priority next, so the first layers' gradients overtake
the queue of the later layers' and the next forward overlaps the rest.

Every rank must issue the same collectives in the same order, but their backward passes
finish layers at slightly different times, so "the best ready partition" is not the same
on every rank. ByteScheduler asks Horovod's coordinator each time; this module instead
decides the whole order once, from a time oracle (TicTac's TAO idea, applied to the
gradients): when each parameter's gradient is ready after the backward starts and how
long each partition's allreduce takes, measured in a calibration iteration. The runtime
(:mod:`mlfabric.torch.ordered_allreduce`) then issues the partitions in that fixed order,
waiting for each one's gradient if it is late, and every rank agrees by construction.

* :func:`partition_params`: each parameter cut into pieces of at most ``partition_bytes``.
* :func:`fifo_order`: DDP's order, by when each gradient is ready.
* :func:`priority_order`: a serial link that, whenever it is free, takes the ready partition
  of the highest priority (lowest number; ties: the earlier-ready, then the earlier
  parameter), as ByteScheduler's scheduler does at run time.
* :func:`finish_times`: when each parameter's last partition is reduced, the order run as
  given on a serial link (what the next forward waits for).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

__all__ = ["Partition", "fifo_order", "finish_times", "partition_params", "priority_order"]


@dataclass(frozen=True)
class Partition:
    """Elements ``[offset, offset + numel)`` of parameter ``param``'s flattened gradient."""

    param: str
    offset: int
    numel: int
    nbytes: int


def partition_params(params: Sequence[tuple[str, int, int]], partition_bytes: int) -> list[Partition]:
    """``params``: (name, numel, element size) in a fixed order (the model's); each cut into
    partitions of at most ``partition_bytes`` (at least one element each), in that order."""
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
    names = [name for name, _, _ in params]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    out: list[Partition] = []
    for name, numel, element_size in params:
        if numel < 1 or element_size < 1:
            raise ValueError(f"parameter {name!r} has {numel} elements of {element_size} bytes")
        step = max(1, partition_bytes // element_size)
        out.extend(Partition(name, offset, min(step, numel - offset), min(step, numel - offset) * element_size)
                   for offset in range(0, numel, step))
    return out


def _ready(parts: Sequence[Partition], ready_s: Mapping[str, float]) -> None:
    missing = sorted({p.param for p in parts} - set(ready_s))
    if missing:
        raise ValueError(f"no ready time for parameter(s) {missing[:5]}")


def fifo_order(parts: Sequence[Partition], ready_s: Mapping[str, float]) -> list[Partition]:
    """First come, first served: by ready time, then the parameters' order (stable)."""
    _ready(parts, ready_s)
    return sorted(parts, key=lambda p: ready_s[p.param])


def priority_order(parts: Sequence[Partition], ready_s: Mapping[str, float], priority: Mapping[str, float],
                   service_s: Callable[[Partition], float]) -> list[Partition]:
    """The order a serial link serves ``parts`` in when, each time it is free, it takes the
    ready partition with the lowest ``priority`` (module docstring); ``service_s``: how long
    one partition's allreduce holds the link."""
    _ready(parts, ready_s)
    missing = sorted({p.param for p in parts} - set(priority))
    if missing:
        raise ValueError(f"no priority for parameter(s) {missing[:5]}")
    first_index = {}
    for i, p in enumerate(parts):
        first_index.setdefault(p.param, i)
    arrivals = sorted(range(len(parts)), key=lambda i: (ready_s[parts[i].param], i))
    queue: list[tuple[float, float, int, int]] = []
    out: list[Partition] = []
    now, nxt = (ready_s[parts[arrivals[0]].param] if parts else 0.0), 0
    while len(out) < len(parts):
        while nxt < len(arrivals) and ready_s[parts[arrivals[nxt]].param] <= now:
            i = arrivals[nxt]
            heapq.heappush(queue, (priority[parts[i].param], ready_s[parts[i].param], first_index[parts[i].param], i))
            nxt += 1
        if not queue:  # the link idles until the next gradient is ready
            now = ready_s[parts[arrivals[nxt]].param]
            continue
        p = parts[heapq.heappop(queue)[3]]
        out.append(p)
        now += service_s(p)
    return out


def finish_times(order: Sequence[Partition], ready_s: Mapping[str, float],
                 service_s: Callable[[Partition], float]) -> dict[str, float]:
    """Parameter -> when its last partition's allreduce ends, ``order`` served as given by a
    serial link that starts each partition once the link is free and its gradient is ready."""
    _ready(order, ready_s)
    now = -math.inf
    out: dict[str, float] = {}
    for p in order:
        now = max(now, ready_s[p.param]) + service_s(p)
        out[p.param] = max(out.get(p.param, -math.inf), now)
    return out
