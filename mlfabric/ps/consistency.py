"""Consistency models of the parameter server: BSP, SSP(s) and async with a delay bound.

    python -m pytest tests/unit/test_ps.py -k "consistency or clocks"

Pure bookkeeping, no networking: the server feeds it what arrives and asks it what may
happen now.

* **Clocks** (MLNET §2.1): a worker's clock counts its finished iterations; it sends
  ``clock(c)`` when it finishes iteration ``c`` (after its push of ``c``, on the same
  connection, so the push is in first). The *model clock* is the minimum clock over the
  workers still in the job. A pull by a worker at clock ``c`` with staleness ``s`` is
  answered once ``model clock >= c - s``.
* ``bsp``: the updates of iteration ``t`` are summed, and applied as *one* update (their
  mean) when every worker's clock passed ``t``: no one reads ``t + 1`` before all of ``t``
  is in. This is synchronous SGD, momentum included. Pulls wait with ``s = 0``.
* ``ssp:s``: every update is applied when it arrives; pulls wait with staleness ``s``.
* ``async`` / ``async:TAU``: every update is applied when it arrives, pulls are answered at
  once. With a delay bound ``TAU`` (MLfabric §3.1) an update whose *delay* (server version
  when applied - version it was computed from) would exceed ``TAU`` is dropped and counted;
  MLfabric's scheduler (the ``scheduled`` routing policy) avoids sending such updates at all.

Workers that leave cleanly are out of the clocks at once in every model. A worker *lost*
(killed, disconnected) is out at once in SSP and async; BSP waits ``lost_worker_wait_s`` for
it (the job's patience with a missing contribution) and then closes its rounds without it,
and the rounds say which workers were missing. A lost worker whose restarted process comes
back (:meth:`ClockBook.rejoin`) counts again from the slowest other worker's clock on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = ("bsp", "ssp", "async")


@dataclass(frozen=True, kw_only=True)
class Consistency:
    kind: str = "bsp"
    staleness: int = 0
    delay_bound: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown consistency {self.kind!r}; choose bsp, ssp:S or async[:TAU]")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.kind != "ssp" and self.staleness:
            raise ValueError(f"staleness applies to ssp only, got {self.kind} with staleness {self.staleness}")
        if self.delay_bound is not None and (self.kind != "async" or self.delay_bound < 0):
            raise ValueError(f"a delay bound applies to async only and must be >= 0, got {self.kind} with "
                             f"delay bound {self.delay_bound}")

    @classmethod
    def parse(cls, text: str) -> "Consistency":
        """``bsp``, ``ssp:2``, ``async`` or ``async:8`` (delay bound 8)."""
        kind, _, arg = text.strip().lower().partition(":")
        if kind == "ssp":
            if not arg:
                raise ValueError("ssp needs its staleness: ssp:S, e.g. ssp:2")
            return cls(kind="ssp", staleness=_int(arg, text))
        if kind == "async":
            return cls(kind="async", delay_bound=_int(arg, text) if arg else None)
        if arg:
            raise ValueError(f"{kind} takes no argument, got {text!r}")
        return cls(kind=kind)

    @property
    def pull_staleness(self) -> float:
        """How far behind the model clock a pull may be answered (inf: at once)."""
        return math.inf if self.kind == "async" else float(self.staleness)

    def __str__(self) -> str:
        if self.kind == "ssp":
            return f"ssp:{self.staleness}"
        if self.kind == "async" and self.delay_bound is not None:
            return f"async:{self.delay_bound}"
        return self.kind


def _int(arg: str, text: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"{text!r}: {arg!r} is not an integer") from None


@dataclass
class ClockBook:
    """Worker clocks, membership and BSP rounds of one server (see the module docstring).

    Workers are indices ``0..workers-1``. ``now`` arguments are monotonic seconds.
    """

    workers: int
    consistency: Consistency
    lost_worker_wait_s: float = 10.0
    clocks: list[int] = field(init=False)
    departed: set[int] = field(default_factory=set)
    lost_at: dict[int, float] = field(default_factory=dict)
    rounds_closed: int = 0
    #: Per closed BSP round with missing workers: (round, workers missing).
    missing: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("a clock book needs at least one worker")
        self.clocks = [0] * self.workers

    # -- events ------------------------------------------------------------------------------

    def tick(self, worker: int, clock: int) -> None:
        """Worker ``worker`` finished iteration ``clock`` (its clock becomes ``clock + 1``)."""
        if clock != self.clocks[worker]:
            raise ValueError(f"worker {worker} sent clock {clock} but its clock here is {self.clocks[worker]}: "
                             "clock() calls and messages must not be skipped or repeated")
        self.clocks[worker] = clock + 1

    def adopt(self, worker: int, clock: int) -> None:
        """A replica promoted to server learns a worker's clock from the worker (it never saw
        the clocks the lost server counted)."""
        self.clocks[worker] = max(self.clocks[worker], clock)

    def leave(self, worker: int) -> None:
        self.departed.add(worker)
        self.lost_at.pop(worker, None)

    def lose(self, worker: int, now: float) -> None:
        if worker not in self.departed:
            self.lost_at.setdefault(worker, now)

    def rejoin(self, worker: int, now: float, *, pushed: int = 0) -> int:
        """A lost (or departed) worker is back (a restarted process): it counts again, and its
        clock becomes the slowest other counted worker's (in BSP at least the rounds closed:
        it takes part from the first open round on), never below its own nor below
        ``pushed`` (one past the last open round holding its update, which its old process
        pushed without sending the clock): no round gets its update twice. Returns that clock."""
        others = [w for w in self.counted(now) if w != worker]
        clock = min((self.clocks[w] for w in others), default=max(self.clocks))
        if self.consistency.kind == "bsp":
            clock = max(clock, self.rounds_closed)
        clock = max(clock, self.clocks[worker], pushed)
        self.lost_at.pop(worker, None)
        self.departed.discard(worker)
        self.clocks[worker] = clock
        return clock

    # -- questions ---------------------------------------------------------------------------

    def counted(self, now: float) -> list[int]:
        """Workers whose clock still holds the others back: neither departed nor given up on
        (a lost worker is given up on at once, except in BSP after ``lost_worker_wait_s``)."""
        out = []
        for w in range(self.workers):
            if w in self.departed:
                continue
            lost = self.lost_at.get(w)
            if lost is not None and (self.consistency.kind != "bsp" or now - lost >= self.lost_worker_wait_s):
                continue
            out.append(w)
        return out

    def model_clock(self, now: float) -> float:
        """min clock over the counted workers (inf when none is left); in BSP, the rounds closed."""
        if self.consistency.kind == "bsp":
            return self.rounds_closed
        counted = self.counted(now)
        return min((self.clocks[w] for w in counted), default=math.inf)

    def closable_rounds(self, now: float, limit: int | None = None) -> list[int]:
        """BSP: the rounds that can close now, in order (each then counts as closed); none
        from ``limit`` on (rounds whose updates are still on the way, e.g. at an aggregator)."""
        if self.consistency.kind != "bsp":
            return []
        counted = self.counted(now)
        horizon = min((self.clocks[w] for w in counted), default=None)
        if horizon is None:
            # Nobody left to wait for: close what any worker reached.
            horizon = max(self.clocks, default=0)
        if limit is not None:
            horizon = min(horizon, limit)
        out = []
        while self.rounds_closed < horizon:
            t = self.rounds_closed
            absent = tuple(w for w in range(self.workers) if self.clocks[w] <= t and w not in self.departed)
            if absent:
                self.missing.append((t, absent))
            out.append(t)
            self.rounds_closed += 1
        return out

    def pull_ready(self, clock: int, staleness: float, now: float) -> bool:
        return self.model_clock(now) >= clock - staleness

    def next_deadline(self, now: float) -> float | None:
        """When a lost worker stops holding BSP back (None: nothing scheduled)."""
        if self.consistency.kind != "bsp":
            return None
        pending = [t + self.lost_worker_wait_s for w, t in self.lost_at.items()
                   if now - t < self.lost_worker_wait_s]
        return min(pending, default=None)

    def everyone_gone(self) -> bool:
        return all(w in self.departed or w in self.lost_at for w in range(self.workers))
