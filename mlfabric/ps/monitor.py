"""The scheduler's view of the network: NIC capacities reported with a lag, and the
reservations of earlier batches still on the wire.

    python -m pytest tests/unit/test_ps_scheduled.py -k monitor

MLfabric §4: a *network monitor* periodically measures each host's available bandwidth and
reports it to the scheduler, which sees it ``t_lag`` late (§7: 0.2 s by default). Here each
rank's :class:`NicProbe` measures its own NIC and sends the figure to the scheduler's rank;
:class:`NetworkMonitor` keeps the reports and answers, at time ``now``, the capacities
reported up to ``now - lag``. Probes:

* ``static``: the configured line rate (``MLFABRIC_NIC_RATE``, set by the emulator), no
  measurement — a network without churn;
* ``tc``: the rate of the host's egress shaper as ``tc`` reports it on its first NIC (on the
  emulator, the rate the bandwidth churn set last: what a probe saturating the link would
  measure, without the traffic). A host sees only its own egress shaper (its ingress one sits
  in the fabric's namespace), so this probe reports the up direction and leaves the down
  direction at its last known value;
* the emulator's capacity trace (:class:`TraceFeed`, what the runtime uses under churn): the
  emulator writes every redraw of the NICs' rates to a capacity-trace CSV as it applies it and
  tells the ranks where (``MLFABRIC_CAPACITY_TRACE``); the scheduler's rank follows the file
  and reports each row at the moment it was applied, both directions of every host -- what the
  simulator's monitor gets of the same churn (``sim/mlfabric.py``, ``_follow_churn``). Without
  it the scheduler planned every NIC at its default rate through all the churn (issue #35).

:class:`Ledger` turns the monitor's capacities and the transfers earlier batches reserved
(and that are still running) into the residual-capacity timelines of a fresh
:class:`~mlfabric.ps.scheduler.netstate.NetState` at ``now``: a batch never plans on bandwidth
an earlier batch holds.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable

from mlfabric.ps.scheduler.netstate import NetState, Transfer, down_link, up_link

log = logging.getLogger("mlfabric.ps")

DEFAULT_LAG_S = 0.2


@dataclass
class NetworkMonitor:
    """Per host ``(up, down)`` capacity in bytes/s, as reported over time; read with a lag."""

    hosts: int
    default_bps: float  # bytes/s assumed until a host reports
    lag_s: float = DEFAULT_LAG_S
    _reports: list[list[tuple[float, float, float]]] = field(default_factory=list)  # per host: (at, up, down)

    def __post_init__(self) -> None:
        if self.hosts < 1 or not self.default_bps > 0 or self.lag_s < 0:
            raise ValueError(f"monitor needs hosts >= 1, a positive default rate and lag >= 0, got {self.hosts}, "
                             f"{self.default_bps}, {self.lag_s}")
        self._reports = [[] for _ in range(self.hosts)]

    def report(self, host: int, up_bps: float | None, down_bps: float | None, at: float) -> None:
        """A measurement made at ``at``; None keeps a direction's previous figure."""
        if not 0 <= host < self.hosts:
            raise ValueError(f"host {host} is outside 0..{self.hosts - 1}")
        reports = self._reports[host]
        if reports and at < reports[-1][0]:
            return  # reordered: keep the latest
        last_up, last_down = (reports[-1][1], reports[-1][2]) if reports else (self.default_bps, self.default_bps)
        reports.append((at, last_up if up_bps is None else max(0.0, up_bps),
                        last_down if down_bps is None else max(0.0, down_bps)))
        del reports[:-64]  # a short history is enough for any lag

    def capacities(self, now: float) -> tuple[list[float], list[float]]:
        """Each host's last report made at or before ``now - lag`` (the default before any)."""
        cutoff = now - self.lag_s
        up, down = [], []
        for reports in self._reports:
            i = bisect.bisect_right([r[0] for r in reports], cutoff) - 1
            if i < 0:
                up.append(self.default_bps)
                down.append(self.default_bps)
            else:
                up.append(reports[i][1])
                down.append(reports[i][2])
        return up, down


class Ledger:
    """Transfers reserved by earlier batches, for the next batch's residual capacities."""

    def __init__(self) -> None:
        self._active: list[tuple[int, int, Transfer]] = []  # (up link, down link, transfer)

    def add(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            if t.src != t.dst and t.times:
                self._active.append((up_link(t.src), down_link(t.dst), t))

    def state(self, now: float, up: list[float], down: list[float]) -> NetState:
        """A NetState at ``now``: capacities minus what the still-running transfers hold."""
        self._active = [(u, d, t) for u, d, t in self._active if t.end > now]
        net = NetState(up, down, origin=now)
        per_link: dict[int, list[Transfer]] = {}
        for u, d, t in self._active:
            per_link.setdefault(u, []).append(t)
            per_link.setdefault(d, []).append(t)
        for link, transfers in per_link.items():
            capacity = (up if link % 2 == 0 else down)[link // 2]
            times, rates = _residual(now, capacity, transfers)
            net.set_timeline(link, times, rates)
        return net

    def __len__(self) -> int:
        return len(self._active)


def _residual(now: float, capacity: float, transfers: list[Transfer]) -> tuple[list[float], list[float]]:
    """``capacity`` minus the rate profiles of ``transfers`` from ``now`` on (>= 0: a link whose
    capacity dropped below its reservations has none left, not a negative amount)."""
    edges = {now}
    for t in transfers:
        edges.update(x for x in (*t.times, t.end) if x > now)
    times = sorted(edges)
    rates = [max(0.0, capacity - sum(t.rate_at(x) for t in transfers)) for x in times]
    return times, rates


# -- probes (run on every rank, report to the scheduler) ----------------------------------------


Probe = Callable[[], "tuple[float | None, float | None]"]


def static_probe(rate_bps: float) -> Probe:
    """The configured line rate (bits/s) in and out, in bytes/s."""
    return lambda: (rate_bps / 8, rate_bps / 8)


def tc_probe(device: str = "eth0") -> Probe | None:
    """The rate of the host's egress shaper on ``device`` in bytes/s (up only: see the module
    docstring); None where tc is missing."""
    tc = shutil.which("tc")
    if tc is None:
        return None

    def probe() -> tuple[float | None, float | None]:
        out = subprocess.run([tc, "-j", "class", "show", "dev", device], capture_output=True, text=True, timeout=2)
        if out.returncode != 0:
            raise RuntimeError(f"tc class show dev {device}: {out.stderr.strip()}")
        rates = [c.get("rate") for c in json.loads(out.stdout or "[]") if c.get("class") == "htb"]
        rates = [r for r in rates if isinstance(r, (int, float)) and r > 0]
        if not rates:
            raise RuntimeError(f"no htb class with a rate on {device}")
        return float(min(rates)), None  # bytes/s, as tc -j reports rates

    return probe


# -- the emulator's capacity trace (churn) -------------------------------------------------------

#: How often the scheduler's rank reads the trace for new rows: well inside the monitor's lag
#: (0.2 s), so a redraw is known by the time the lag lets the scheduler see it.
TRACE_POLL_S = 0.05


Report = Callable[[int, "float | None", "float | None", float], None]  # (rank, up, down bytes/s, at)


class TraceFeed:
    """Follows a capacity-trace CSV as the emulator appends to it: :meth:`poll` returns the
    reports of the rows written since the last call (complete lines only), one per rank on
    the row's host (NIC ``nic``), ``(rank, up, down, at)`` in bytes/s with the direction the
    row does not change as None, ``at`` on this process's ``time.monotonic()``."""

    def __init__(self, path: str, start: float, rank_hosts: Sequence[int], nic: int = 0) -> None:
        self.path, self.start, self.nic = str(path), float(start), nic
        self._ranks: dict[int, list[int]] = {}
        for rank, host in enumerate(rank_hosts):
            self._ranks.setdefault(int(host), []).append(rank)
        self._offset = 0
        self._line = 0
        self._rest = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TraceFeed | None:
        """The feed the emulator set up for this rank (``MLFABRIC_CAPACITY_TRACE``,
        :func:`mlfabric.topo.trace.capacity_trace_env`), None without."""
        from mlfabric.topo.trace import CAPACITY_TRACE_ENV

        text = environ.get(CAPACITY_TRACE_ENV)
        if not text:
            return None
        try:
            spec = json.loads(text)
            return cls(spec["path"], float(spec["start"]), [int(h) for h in spec["hosts"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{CAPACITY_TRACE_ENV}={text!r}: expected JSON with path, start and hosts "
                             f"(the emulator sets it): {exc}") from None

    def poll(self) -> list[tuple[int, float | None, float | None, float]]:
        from mlfabric.topo.trace import TRACE_HEADER, parse_trace_row

        try:
            with open(self.path, newline="") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
                self._offset = handle.tell()
        except FileNotFoundError:
            return []  # not written yet
        text = self._rest + chunk
        complete, _, self._rest = text.rpartition("\n")
        reports: list[tuple[int, float | None, float | None, float]] = []
        if not complete:
            return reports
        for cells in csv.reader(io.StringIO(complete + "\n")):
            self._line += 1
            if self._line == 1 and tuple(c.strip() for c in cells) == TRACE_HEADER:
                continue
            if not cells:
                continue
            row = parse_trace_row(cells, f"capacity trace {self.path!r} line {self._line}")
            if row.nic != self.nic:
                continue
            bps = row.rate_bps / 8
            up, down = (bps, None) if row.direction == "egress" else (None, bps)
            for rank in self._ranks.get(row.host, []):
                reports.append((rank, up, down, self.start + row.time_s))
        return reports

    def follow(self, report: Report, *, period_s: float = TRACE_POLL_S) -> Callable[[], None]:
        """Report every row now, then every ``period_s`` on a thread; returns the stop function."""
        stop = threading.Event()

        def turn() -> None:
            for rank, up, down, at in self.poll():
                report(rank, up, down, at)

        def loop() -> None:
            while not stop.wait(period_s):
                try:
                    turn()
                except (OSError, ValueError) as exc:  # the trace is a measurement: planning goes on without it
                    log.error("network monitor: reading the capacity trace %s failed (%s); the scheduler keeps "
                              "the rates it knows", self.path, exc)
                    return

        turn()  # the rates in force before the first batch is planned
        thread = threading.Thread(target=loop, name="mlfabric-ps-trace-monitor", daemon=True)
        thread.start()

        def stop_following() -> None:
            stop.set()
            thread.join(1.0)

        return stop_following
