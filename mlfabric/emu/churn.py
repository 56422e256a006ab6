"""Bandwidth churn: seeded redraws of every host NIC's rate, applied with ``tc`` and traced.

    sudo .venv/bin/python -m pytest tests/emu/test_churn.py -q

MLfabric §7 emulates background traffic by redrawing each NIC's incoming and outgoing rate
every ``T`` seconds (independently) from ``{1, 2.5, 3.3, 5, 10}`` Gbps with probabilities:

====  =============================================
N1    5G: 0.1, 10G: 0.9 (the paper's default)
N2    2.5G: 0.1, 3.3G: 0.1, 5G: 0.1, 10G: 0.7
N3    1G: 0.5, 10G: 0.5
====  =============================================

:class:`ChurnModel` holds such a set as fractions of the top rate, so it scales to any base
rate (``N3`` at 100 Mbit/s draws 10 or 100 Mbit/s). :func:`churn_schedule` is pure and
deterministic under a seed: draw ``i`` happens at ``i * period_s`` (the first at time 0) and
gives one rate per (host, NIC, direction), in that order. :class:`ChurnRunner` applies the
schedule to a :class:`~mlfabric.emu.cluster.Cluster` on a background thread and writes
each applied change as a row of the capacity-trace CSV (:mod:`mlfabric.topo.trace`) that
the simulator replays (times relative to the start of the run, at their scheduled values).
"""

from __future__ import annotations

import csv
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from mlfabric.topo.trace import TRACE_HEADER, TraceRow
from mlfabric.units import parse_rate

__all__ = ["ChurnModel", "CHURN_MODELS", "churn_model", "churn_schedule", "ChurnRunner", "TraceWriter"]

_CHURN_STREAM = 3  # seed stream, distinct from the simulator's speed (1) and straggler (2) streams


@dataclass(frozen=True, kw_only=True)
class ChurnModel:
    """A discrete rate distribution, as fractions of the base rate (1.0 = the NIC's full rate)."""

    name: str
    fractions: tuple[float, ...]
    probabilities: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.fractions) != len(self.probabilities) or not self.fractions:
            raise ValueError(f"churn model {self.name!r}: need as many probabilities as rates (at least one)")
        if any(not (0 < f <= 1) for f in self.fractions):
            raise ValueError(f"churn model {self.name!r}: rates must be fractions in (0, 1] of the base rate")
        if any(p < 0 for p in self.probabilities) or not math.isclose(sum(self.probabilities), 1.0, abs_tol=1e-9):
            raise ValueError(f"churn model {self.name!r}: probabilities must be >= 0 and sum to 1, "
                             f"got {self.probabilities}")

    def rates(self, base_rate_bps: float) -> tuple[float, ...]:
        """The rates this model draws from at ``base_rate_bps`` (bit/s)."""
        return tuple(f * base_rate_bps for f in self.fractions)


def _paper(name: str, spec: Mapping[float, float]) -> ChurnModel:
    return ChurnModel(name=name, fractions=tuple(g / 10.0 for g in spec), probabilities=tuple(spec.values()))


#: MLfabric §7 network settings, as fractions of 10 Gbps.
CHURN_MODELS: Mapping[str, ChurnModel] = MappingProxyType({
    "N1": _paper("N1", {5.0: 0.1, 10.0: 0.9}),
    "N2": _paper("N2", {2.5: 0.1, 3.3: 0.1, 5.0: 0.1, 10.0: 0.7}),
    "N3": _paper("N3", {1.0: 0.5, 10.0: 0.5}),
})


def churn_model(text: str) -> ChurnModel:
    """``"N1"``/``"N2"``/``"N3"`` or a custom set ``"5G:0.1,10G:0.9"`` (rates relative to the largest)."""
    key = text.strip()
    if key.upper() in CHURN_MODELS:
        return CHURN_MODELS[key.upper()]
    items = [item.strip() for item in key.split(",") if item.strip()]
    pairs: list[tuple[float, float]] = []
    for item in items:
        rate, sep, prob = item.partition(":")
        if not sep:
            raise ValueError(f"churn model {text!r}: expected N1, N2, N3 or RATE:PROB pairs like 5G:0.1,10G:0.9")
        try:
            pairs.append((parse_rate(rate), float(prob)))
        except ValueError as exc:
            raise ValueError(f"churn model {text!r}: {exc}") from None
    if not pairs:
        raise ValueError(f"churn model {text!r} is empty; expected N1, N2, N3 or 5G:0.1,10G:0.9")
    top = max(rate for rate, _ in pairs)
    return ChurnModel(name=key, fractions=tuple(r / top for r, _ in pairs), probabilities=tuple(p for _, p in pairs))


def churn_schedule(model: ChurnModel, *, n_hosts: int, nics_per_host: int, base_rate_bps: float, period_s: float,
                   seed: int) -> Iterator[tuple[float, list[TraceRow]]]:
    """Endless ``(time_s, rows)`` per redraw: one row per host, NIC and direction (egress first).

    Deterministic for a seed; draw ``i`` does not depend on how many draws are taken.
    """
    if period_s <= 0 or not math.isfinite(period_s):
        raise ValueError(f"churn period must be a positive number of seconds, got {period_s}")
    if n_hosts < 1 or nics_per_host < 1:
        raise ValueError(f"churn needs at least one host and NIC, got {n_hosts} hosts, {nics_per_host} NICs")
    rng = np.random.default_rng(np.random.SeedSequence([seed, _CHURN_STREAM]))
    rates = np.array(model.rates(base_rate_bps))
    probs = np.array(model.probabilities)
    keys = [(h, l, d) for h in range(n_hosts) for l in range(nics_per_host) for d in ("egress", "ingress")]
    step = 0
    while True:
        draws = rng.choice(rates.size, size=len(keys), p=probs)
        t = step * period_s
        yield t, [TraceRow(time_s=t, host=h, nic=l, direction=d, rate_bps=float(rates[i]))
                  for (h, l, d), i in zip(keys, draws)]
        step += 1


class TraceWriter:
    """Appends rows to a capacity-trace CSV as they are applied (flushed, so a crash keeps them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("w", newline="")
        self._writer = csv.writer(self._handle)
        self._writer.writerow(TRACE_HEADER)
        self._handle.flush()

    def write(self, rows: Sequence[TraceRow]) -> None:
        for row in rows:
            self._writer.writerow([repr(float(row.time_s)), row.host, row.nic, row.direction, repr(float(row.rate_bps))])
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class _Applier:  # what ChurnRunner needs of a Cluster (a fake in unit tests)
    def set_rates(self, changes: Sequence[tuple[int, int, str, float]]) -> None: ...


@dataclass
class ChurnRunner:
    """Applies :func:`churn_schedule` to ``cluster`` on a thread; ``start()`` / ``stop()``.

    Each redraw is applied at its scheduled time (relative to ``start()``) and then written to
    ``trace_path``; ``applied`` keeps ``(scheduled time, wall-clock lag, rows)`` for checks.
    ``on_apply`` (optional) is called after each redraw, on the runner's thread.
    """

    cluster: _Applier
    model: ChurnModel
    n_hosts: int
    nics_per_host: int
    base_rate_bps: float
    period_s: float
    seed: int = 0
    trace_path: str | Path | None = None
    on_apply: Callable[[float, list[TraceRow]], None] | None = None
    applied: list[tuple[float, float, list[TraceRow]]] = field(default_factory=list)
    error: BaseException | None = None
    #: ``time.monotonic()`` of the schedule's time 0 (set by ``start()``): a trace row's
    #: ``time_s`` plus this is when it was due, on every process's monotonic clock.
    started_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ChurnRunner:
        schedule = churn_schedule(self.model, n_hosts=self.n_hosts, nics_per_host=self.nics_per_host,
                                  base_rate_bps=self.base_rate_bps, period_s=self.period_s, seed=self.seed)
        writer = TraceWriter(self.trace_path) if self.trace_path is not None else None
        start = self.started_at = time.monotonic()
        # The first redraw is applied before start() returns, so the job starts under it.
        try:
            self._apply(next(schedule), start, writer)
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        self._thread = threading.Thread(target=self._loop, args=(schedule, start, writer), name="mlfabric-churn",
                                        daemon=True)
        self._thread.start()
        return self

    def _apply(self, item: tuple[float, list[TraceRow]], start: float, writer: TraceWriter | None) -> None:
        t, rows = item
        self.cluster.set_rates([(r.host, r.nic, r.direction, r.rate_bps) for r in rows])
        lag = time.monotonic() - start - t
        if writer is not None:
            writer.write(rows)
        self.applied.append((t, lag, rows))
        if self.on_apply is not None:
            self.on_apply(t, rows)

    def _loop(self, schedule: Iterator[tuple[float, list[TraceRow]]], start: float, writer: TraceWriter | None) -> None:
        try:
            for item in schedule:
                if self._stop.wait(max(0.0, start + item[0] - time.monotonic())):
                    break
                self._apply(item, start, writer)
        except BaseException as exc:  # noqa: BLE001 - surfaced by stop()
            self.error = exc
        finally:
            if writer is not None:
                writer.close()

    def stop(self) -> None:
        """Stop redrawing; re-raise an error the thread hit (e.g. a failing ``tc`` command)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self.error is not None:
            raise RuntimeError(f"bandwidth churn failed: {self.error}") from self.error
