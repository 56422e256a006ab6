"""An iteration's timeline (compute ops and transfers with start/end) and its Chrome/Perfetto export.

    .venv/bin/python -m pytest tests/unit/test_order.py -q -k trace

One :class:`Trace` type serves both sides of TicTac's §3: the simulator in
:mod:`mlfabric.order.metrics` produces one from a DAG, an oracle and a transfer order, and a
measured iteration (the tracer in :mod:`mlfabric.order.oracle`, or a PS worker's log of
(op, start, end) and (transfer, start, end)) is one. :func:`to_chrome` writes the JSON that
chrome://tracing and ui.perfetto.dev open: one process, thread 0 = the compute resource,
thread 1 = the channel, complete ("X") events in microseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Span", "Trace", "to_chrome", "write_chrome"]

Span = tuple[str, float, float]  # (name, start, end), seconds


@dataclass(frozen=True, kw_only=True)
class Trace:
    """What ran when in one iteration. Times are seconds from any common origin."""

    compute: tuple[Span, ...] = ()
    transfers: tuple[Span, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(compute: Sequence[Span], transfers: Sequence[Span], **meta: Any) -> Trace:
        for name, s, e in (*compute, *transfers):
            if e < s:
                raise ValueError(f"Trace: span {name!r} ends ({e}) before it starts ({s})")
        return Trace(compute=tuple((str(n), float(s), float(e)) for n, s, e in compute),
                     transfers=tuple((str(n), float(s), float(e)) for n, s, e in transfers), meta=dict(meta))

    @property
    def start(self) -> float:
        spans = (*self.compute, *self.transfers)
        return min((s for _, s, _ in spans), default=0.0)

    @property
    def end(self) -> float:
        spans = (*self.compute, *self.transfers)
        return max((e for _, _, e in spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def durations(self) -> dict[str, float]:
        """Per-op time as measured (a name seen twice adds up: same op, split execution)."""
        out: dict[str, float] = {}
        for n, s, e in (*self.compute, *self.transfers):
            out[n] = out.get(n, 0.0) + (e - s)
        return out

    def transfer_order(self) -> tuple[str, ...]:
        """The transfers by start time (ties by end, then name): the order the channel served."""
        return tuple(n for n, _, _ in sorted(self.transfers, key=lambda t: (t[1], t[2], t[0])))


def to_chrome(trace: Trace, *, process: str = "worker", pid: int = 0, origin: float | None = None) -> dict[str, Any]:
    """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...]}``). Several
    traces (workers, iterations) share one file when each gets its ``pid`` and all the same
    ``origin`` (seconds; default: this trace's start), their events concatenated."""
    t0 = trace.start if origin is None else origin
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "channel"}},
    ]
    for tid, cat, spans in ((0, "compute", trace.compute), (1, "recv", trace.transfers)):
        for name, s, e in spans:
            events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                           "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))}}


def write_chrome(trace: Trace, path: str | Path, *, process: str = "worker") -> Path:
    p = Path(path)
    p.write_text(json.dumps(to_chrome(trace, process=process)))
    return p
