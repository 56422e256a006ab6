"""The compiled scheduler loops (``_sched.c``): conversion to and from the Python results.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler_native.py -q

``ordering.order_updates``, ``ordering.list_order`` and ``aggregation.aggregate`` call
into here when the kernel is built and the batch has one server (``native=None``, the
default), or always (``native=True``: an error if that is impossible); ``native=False``
keeps the Python loops. Both paths make the same float operations in the same order, so
their results are identical (tests/unit/test_ps_scheduler_native.py checks it on random
instances, and the bench checks both against the plain reference).

Why the loops are in C: the timelines the scheduler walks hold ~2-20 segments, so a walk
is a few hundred nanoseconds of arithmetic but 5-20 us of interpreter; a batch of 1,000
updates costs ~50k of them (docs/mlfabric_scheduler.md). What stays in Python is building
the result objects (one :class:`~mlfabric.ps.scheduler.netstate.Transfer` per reservation
kept), ~1 us each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from mlfabric.ps.scheduler.netstate import NetState

if TYPE_CHECKING:
    from mlfabric.ps.scheduler.ordering import Batch

try:  # built by setup.py when a C compiler is there (optional)
    from mlfabric.ps.scheduler import _sched
except ImportError:  # pragma: no cover - exercised where the kernel is not built
    _sched = None

__all__ = ["REASONS", "aggregate_raw", "available", "list_order_raw", "order_raw", "use"]

REASONS = {1: "doomed", 2: "look-ahead", 3: "no-capacity"}


def available() -> bool:
    return _sched is not None


def use(batch: "Batch", native: bool | None) -> bool:
    """Whether to run the compiled loop for ``batch`` (see the module docstring)."""
    if native is False:
        return False
    ok = _sched is not None and len(batch.servers) == 1
    if native and not ok:
        why = "is not built (reinstall with a C compiler)" if _sched is None else "handles one server only"
        raise RuntimeError(f"native=True but the compiled scheduler (mlfabric.ps.scheduler._sched) {why}")
    return ok


def _inputs(batch: "Batch", net: NetState) -> tuple:
    ptr, times, rates = net.to_csr()
    src = np.asarray(batch.src, dtype=np.int64)
    sizes = np.ascontiguousarray(batch.sizes[:, 0], dtype=float)
    return ptr, times, rates, src, sizes, int(batch.servers[0])


def order_raw(batch: "Batch", net: NetState, *, start: float) -> list:
    """``ordering.order_updates`` (Alg. 2 / Alg. 1), compiled: per update ``(g, kind, pos,
    end, begin, profile times, profile rates)`` (``kind``: 0 kept, else a :data:`REASONS` key)."""
    ptr, times, rates, src, sizes, server = _inputs(batch, net)
    dl = None if batch.deadlines is None else np.asarray(batch.deadlines, dtype=np.int64)
    return _sched.order(ptr, times, rates, src, sizes, server, dl, float(start))


def list_order_raw(batch: "Batch", net: NetState, order: Sequence[int], *, start: float) -> list:
    """``ordering.list_order``, compiled (the raw form of :func:`order_raw`)."""
    ptr, times, rates, src, sizes, server = _inputs(batch, net)
    return _sched.order_list(ptr, times, rates, src, sizes, server, np.asarray(order, dtype=np.int64), float(start))


def aggregate_raw(batch: "Batch", snapshot: NetState, order: Sequence[int], ends: np.ndarray, prof_ptr: np.ndarray,
                  prof_t: np.ndarray, prof_r: np.ndarray, hosts: Sequence[int], sync: bool, start: float) -> tuple:
    """``aggregation.aggregate`` (Alg. 3) for one server, compiled: ``(split, tried, obj_async,
    obj_sync, members, groups)`` as ``_sched.aggregate`` returns them."""
    ptr, times, rates, src, sizes, server = _inputs(batch, snapshot)
    return _sched.aggregate(ptr, times, rates, src, sizes, server, np.asarray(order, dtype=np.int64), ends, prof_ptr,
                            prof_t, prof_r, np.asarray(hosts, dtype=np.int64), sync, start)
