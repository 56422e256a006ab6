"""Capacity traces: piecewise-constant host-link rates, in the emulator's CSV format.

The emulator applies bandwidth churn to host NICs and records it; the simulator replays the
same file. Format: CSV with header ``time_s,host,nic,direction,rate_bps``; one row per change,
``direction`` is ``egress`` (host -> network) or ``ingress`` (network -> host), ``host`` and
``nic`` are integers (``nic`` 0 on single-NIC hosts), ``rate_bps`` is bit/s (a unit string such
as ``10Gbps`` is accepted too). From ``time_s`` on, that link runs at ``rate_bps`` until its
next row. Rows are applied in time order; rows with equal times keep their file order (the
last one wins).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k trace
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlfabric.topo.topology import DIRECTIONS, Topology
from mlfabric.units import parse_duration, parse_rate

__all__ = ["CAPACITY_TRACE_ENV", "TRACE_HEADER", "TraceRow", "CapacityTrace", "capacity_trace_env", "load_capacity_trace",
           "parse_trace_row", "read_capacity_trace", "trace_offset_s", "write_capacity_trace"]

TRACE_HEADER = ("time_s", "host", "nic", "direction", "rate_bps")

#: Set by the emulator for its ranks under churn (:func:`mlfabric.emu.launcher.emulated_launch`):
#: JSON ``{"path": trace CSV, "start": time.monotonic() of the trace's time 0, "hosts": the
#: host of each rank}``. Network namespaces share the monotonic clock, so a rank turns a row's
#: time into its own clock by adding ``start``.
CAPACITY_TRACE_ENV = "MLFABRIC_CAPACITY_TRACE"


def capacity_trace_env(path: str, start: float, rank_hosts: Sequence[int]) -> dict[str, str]:
    """The ranks' environment entry that lets their network monitor (:class:`mlfabric.ps.monitor.TraceFeed`)
    follow the trace at ``path`` as the emulator appends to it."""
    return {CAPACITY_TRACE_ENV: json.dumps({"path": str(path), "start": float(start),
                                            "hosts": [int(h) for h in rank_hosts]})}


def trace_offset_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds since the capacity trace's time 0 that this rank follows (``MLFABRIC_CAPACITY_TRACE``),
    on the shared monotonic clock; None without one (no churn, or not on the emulator)."""
    text = (os.environ if environ is None else environ).get(CAPACITY_TRACE_ENV)
    if not text:
        return None
    try:
        return time.monotonic() - float(json.loads(text)["start"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{CAPACITY_TRACE_ENV}={text!r}: expected JSON with path, start and hosts "
                         f"(the emulator sets it): {exc}") from None


@dataclass(frozen=True, kw_only=True)
class TraceRow:
    """One capacity change of one host NIC direction."""

    time_s: float
    host: int
    nic: int
    direction: str
    rate_bps: float


@dataclass(frozen=True, eq=False, kw_only=True)
class CapacityTrace:
    """Capacity changes of topology links, sorted by time (stable)."""

    times: np.ndarray  # float64 seconds
    link_ids: np.ndarray  # int64
    rates: np.ndarray  # float64 bit/s

    def __len__(self) -> int:
        return int(self.times.size)

    def change_points(self) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
        """``(time, link ids, new rates)`` per distinct time, in order (for an event engine)."""
        if self.times.size == 0:
            return
        boundaries = np.flatnonzero(np.diff(self.times)) + 1
        for start, stop in zip(np.r_[0, boundaries], np.r_[boundaries, self.times.size]):
            links = self.link_ids[start:stop]
            rates = self.rates[start:stop]
            # Within one time the last row for a link wins.
            last = np.unique(links[::-1], return_index=True)[1]
            keep = np.sort(links.size - 1 - last)
            yield float(self.times[start]), links[keep], rates[keep]

    def capacity_at(self, time_s: float, base_capacity: np.ndarray) -> np.ndarray:
        """Link capacities in force at ``time_s``: ``base_capacity`` with every change at or before it applied."""
        capacity = np.array(base_capacity, dtype=np.float64, copy=True)
        upto = int(np.searchsorted(self.times, time_s, side="right"))
        links = self.link_ids[:upto]
        # The last change of each link wins (explicitly: fancy assignment with repeats is unordered).
        last = links.size - 1 - np.unique(links[::-1], return_index=True)[1]
        capacity[links[last]] = self.rates[:upto][last]
        return capacity


def _rows_from_csv(path: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(cell.strip() for cell in header) != TRACE_HEADER:
            raise ValueError(f"trace {str(path)!r}: first line must be the header {','.join(TRACE_HEADER)}, got {header}")
        for number, cells in enumerate(reader, start=2):
            if not cells or all(not cell.strip() for cell in cells):
                continue
            rows.append(parse_trace_row(cells, f"trace {str(path)!r} line {number}"))
    return rows


def parse_trace_row(cells: list[str], where: str) -> TraceRow:
    """One CSV row of a capacity trace (``where`` names it in the error)."""
    if len(cells) != len(TRACE_HEADER):
        raise ValueError(f"{where}: expected {len(TRACE_HEADER)} columns, got {len(cells)}")
    time_text, host_text, nic_text, direction, rate_text = (cell.strip() for cell in cells)
    try:
        time_s = parse_duration(time_text)
        host, nic = int(host_text), int(nic_text)
        rate = parse_rate(rate_text)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if direction not in DIRECTIONS:
        raise ValueError(f"{where}: direction {direction!r} must be one of {', '.join(DIRECTIONS)}")
    return TraceRow(time_s=time_s, host=host, nic=nic, direction=direction, rate_bps=rate)


def read_capacity_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a trace CSV, in file order."""
    return _rows_from_csv(Path(path))


def load_capacity_trace(path: str | Path | Iterable[TraceRow], topology: Topology) -> CapacityTrace:
    """Read a trace CSV (or rows) and map each row to the topology link it changes."""
    rows = _rows_from_csv(Path(path)) if isinstance(path, (str, Path)) else list(path)
    times = np.array([row.time_s for row in rows], dtype=np.float64)
    links = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        try:
            links[i] = topology.host_link(row.host, row.nic, row.direction)
        except ValueError as error:
            raise ValueError(f"trace row {i} ({row}): {error}") from None
    rates = np.array([row.rate_bps for row in rows], dtype=np.float64)
    order = np.argsort(times, kind="stable")
    return CapacityTrace(times=times[order], link_ids=links[order], rates=rates[order])


def write_capacity_trace(path: str | Path, rows: Iterable[TraceRow]) -> None:
    """Write rows in the shared CSV format (the emulator's writer should produce the same)."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TRACE_HEADER)
        for row in rows:
            if row.direction not in DIRECTIONS:
                raise ValueError(f"direction {row.direction!r} must be one of {', '.join(DIRECTIONS)}")
            writer.writerow([repr(float(row.time_s)), row.host, row.nic, row.direction, repr(float(row.rate_bps))])
