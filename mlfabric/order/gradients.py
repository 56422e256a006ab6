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

* :func:`partition_params`: large parameters cut into pieces of at most ``partition_bytes``,
  small consecutive ones fused up to it.
* :func:`fifo_order`: DDP's order, by when each gradient is ready.
* :func:`priority_order`: a serial link that, whenever it is free, takes the ready partition
  of the highest priority (lowest number; ties: the earlier-ready, then the earlier
  parameter), as ByteScheduler's scheduler does at run time.
* :func:`finish_times`: when each parameter's last partition is reduced, the order run as
  given on a serial link (what the next forward waits for).
* :func:`predicted_step`: the iteration that follows, with the next forward gated per op
  (OrderedAllreduce) or waiting for every update (DDP): how ``mlfabric bench grad-order``
  predicts each ordering and says what a link without a per-collective cost would give.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

__all__ = ["Partition", "fifo_order", "finish_times", "partition_params", "predicted_step", "priority_order"]


@dataclass(frozen=True)
class Partition:
    """One allreduce: ``segments`` of flattened gradients, (parameter, offset, numel) each; a
    piece of one large parameter, or several small consecutive parameters fused (as DDP's
    buckets: a collective per 100-byte bias would cost far more than its bytes)."""

    segments: tuple[tuple[str, int, int], ...]
    nbytes: int

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.segments)

    @property
    def name(self) -> str:
        """``a+b`` for fused parameters, ``w[0:1024]`` for a piece of one."""
        if len(self.segments) == 1:
            param, offset, numel = self.segments[0]
            return f"{param}[{offset}:{offset + numel}]"
        return "+".join(self.params)


def partition_params(params: Sequence[tuple[str, int, int, str]], partition_bytes: int) -> list[Partition]:
    """``params``: (name, numel, element size, dtype) in a fixed order (the model's). A
    parameter of ``partition_bytes`` or more is cut into pieces of at most that (at least
    one element each); consecutive smaller ones of one dtype are fused while the sum stays
    within it. The partitions follow the parameters' order."""
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
    names = [name for name, _, _, _ in params]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    out: list[Partition] = []
    bucket: list[tuple[str, int, int]] = []
    bucket_bytes, bucket_dtype = 0, ""

    def flush() -> None:
        nonlocal bucket, bucket_bytes
        if bucket:
            out.append(Partition(tuple(bucket), bucket_bytes))
        bucket, bucket_bytes = [], 0

    for name, numel, element_size, dtype in params:
        if numel < 1 or element_size < 1:
            raise ValueError(f"parameter {name!r} has {numel} elements of {element_size} bytes")
        nbytes = numel * element_size
        if nbytes >= partition_bytes:
            flush()
            step = max(1, partition_bytes // element_size)
            out.extend(Partition(((name, offset, min(step, numel - offset)),), min(step, numel - offset) * element_size)
                       for offset in range(0, numel, step))
            continue
        if bucket and (bucket_bytes + nbytes > partition_bytes or dtype != bucket_dtype):
            flush()
        bucket.append((name, 0, numel))
        bucket_bytes += nbytes
        bucket_dtype = dtype
    flush()
    return out


def _ready_times(parts: Sequence[Partition], ready_s: Mapping[str, float]) -> list[float]:
    """Each partition's ready time: its last parameter's."""
    missing = sorted({k for p in parts for k in p.params} - set(ready_s))
    if missing:
        raise ValueError(f"no ready time for parameter(s) {missing[:5]}")
    return [max(ready_s[k] for k in p.params) for p in parts]


def fifo_order(parts: Sequence[Partition], ready_s: Mapping[str, float]) -> list[Partition]:
    """First come, first served: by ready time, then the parameters' order (stable)."""
    ready = _ready_times(parts, ready_s)
    return [parts[i] for i in sorted(range(len(parts)), key=lambda i: ready[i])]


def priority_order(parts: Sequence[Partition], ready_s: Mapping[str, float], priority: Mapping[str, float],
                   service_s: Callable[[Partition], float]) -> list[Partition]:
    """The order a serial link serves ``parts`` in when, each time it is free, it takes the
    ready partition with the lowest ``priority`` (a fused partition: its most urgent
    parameter's; module docstring); ``service_s``: how long a partition's allreduce holds
    the link."""
    ready = _ready_times(parts, ready_s)
    missing = sorted({k for p in parts for k in p.params} - set(priority))
    if missing:
        raise ValueError(f"no priority for parameter(s) {missing[:5]}")
    urgency = [min(priority[k] for k in p.params) for p in parts]
    arrivals = sorted(range(len(parts)), key=lambda i: (ready[i], i))
    queue: list[tuple[float, float, int]] = []
    out: list[Partition] = []
    now, nxt = (ready[arrivals[0]] if parts else 0.0), 0
    while len(out) < len(parts):
        while nxt < len(arrivals) and ready[arrivals[nxt]] <= now:
            i = arrivals[nxt]
            heapq.heappush(queue, (urgency[i], ready[i], i))
            nxt += 1
        if not queue:  # the link idles until the next gradient is ready
            now = ready[arrivals[nxt]]
            continue
        i = heapq.heappop(queue)[2]
        out.append(parts[i])
        now += service_s(parts[i])
    return out


def finish_times(order: Sequence[Partition], ready_s: Mapping[str, float],
                 service_s: Callable[[Partition], float]) -> dict[str, float]:
    """Parameter -> when its last partition's allreduce ends, ``order`` served as given by a
    serial link that starts each partition once the link is free and its gradients are ready."""
    ready = _ready_times(order, ready_s)
    now = -math.inf
    out: dict[str, float] = {}
    for p, r in zip(order, ready):
        now = max(now, r) + service_s(p)
        for k in p.params:
            out[k] = max(out.get(k, -math.inf), now)
    return out


def predicted_step(order: Sequence[Partition], ready_s: Mapping[str, float],
                   service_s: Callable[[Partition], float], forward: Sequence[tuple[float, Sequence[str]]],
                   backward_s: float, *, overlap: bool) -> float:
    """One steady-state iteration (backward start to the next backward start) of a device
    that runs the backward for ``backward_s`` (gradients ready at ``ready_s`` after it
    starts), reduces ``order`` on a serial link (:func:`finish_times`) and runs ``forward``
    ((seconds, parameters it needs) per op, in program order). ``overlap``: each op starts
    once its own parameters are updated (OrderedAllreduce's gate); else the forward starts
    once every update is (DDP and ``optimizer.step()``)."""
    finish = finish_times(order, ready_s, service_s)
    if not overlap:
        return max([backward_s, *finish.values()]) + math.fsum(c for c, _ in forward)
    now = backward_s
    for compute, params in forward:
        now = max([now, *(finish[k] for k in params)]) + compute
    return now
