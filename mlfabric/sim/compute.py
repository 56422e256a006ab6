"""Compute models for the simulator: per-worker speeds and seeded stragglers.

A :class:`ComputeModel` says how long the non-network work of a simulated job takes:

* ``compute_s``: the base compute time of one iteration (a worker computing its gradient
  before a push, or a rank reaching a collective), divided by the worker's relative speed;
* per-worker relative speeds: explicit (``speeds``) or drawn uniformly from ``speed_range``
  with the simulation seed (MLNET §4: workers process data at 100-200 MB/s, i.e.
  ``speed_range=(1.0, 2.0)``);
* a straggler model (MLfabric §7): in every iteration each worker independently has
  probability ``probability`` of being slowed down by ``slowdown``; presets
  ``C1 = (10%, 2x)``, ``C2 = (10%, 4x)``, ``C3 = (4%, 2x)``;
* ``reduce_bytes_per_s`` / ``copy_bytes_per_s``: the time of the schedule IR's Reduce, Copy and
  fused receive-reduce ops (bytes touched / rate / speed); infinite by default, i.e. the
  network dominates and these ops take zero time.

Every draw is made from a numpy generator seeded with ``(seed, stream)``, so a seed gives the
same speeds and stragglers on every machine, and changing the number of iterations does not
change the draws of earlier iterations.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py -q -k compute
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mlfabric.emu.stragglers import STRAGGLER_PRESETS, StragglerModel

__all__ = ["ComputeModel", "StragglerModel", "STRAGGLER_PRESETS", "straggler_preset"]

# Independent random streams derived from the simulation seed (stragglers use stream 2,
# inside the one StragglerModel shared with the emulator).
_SPEED_STREAM = 1


def straggler_preset(name: str) -> StragglerModel | None:
    """``"C1"``/``"C2"``/``"C3"``, ``"none"``, or ``"r,s"`` (probability, slowdown)."""
    key = name.strip()
    if key.lower() in ("", "none", "off"):
        return None
    if key.upper() in STRAGGLER_PRESETS:
        return STRAGGLER_PRESETS[key.upper()]
    parts = key.split(",")
    if len(parts) == 2:
        try:
            return StragglerModel(probability=float(parts[0]), slowdown=float(parts[1]))
        except ValueError as exc:
            raise ValueError(f"straggler model {name!r}: {exc}") from None
    raise ValueError(f"unknown straggler model {name!r}; use C1, C2, C3, none, or 'probability,slowdown' like 0.1,4")


@dataclass(frozen=True, kw_only=True)
class ComputeModel:
    """How long compute takes in the simulator (see the module docstring)."""

    compute_s: float = 0.0
    speeds: tuple[float, ...] | None = None
    speed_range: tuple[float, float] | None = None
    straggler: StragglerModel | None = None
    reduce_bytes_per_s: float = math.inf
    copy_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not (self.compute_s >= 0 and math.isfinite(self.compute_s)):
            raise ValueError(f"compute_s must be a finite time >= 0, got {self.compute_s}")
        if self.speeds is not None and self.speed_range is not None:
            raise ValueError("give either speeds or speed_range, not both")
        if self.speeds is not None:
            object.__setattr__(self, "speeds", tuple(float(s) for s in self.speeds))
            if not self.speeds or any(not (s > 0 and math.isfinite(s)) for s in self.speeds):
                raise ValueError("speeds must be finite relative speeds > 0, one per worker")
        if self.speed_range is not None:
            low, high = (float(v) for v in self.speed_range)
            if not (0 < low <= high and math.isfinite(high)):
                raise ValueError(f"speed_range must be (low, high) with 0 < low <= high, got {self.speed_range}")
            object.__setattr__(self, "speed_range", (low, high))
        for name in ("reduce_bytes_per_s", "copy_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (inf for free), got {getattr(self, name)}")

    def worker_speeds(self, workers: int, seed: int) -> np.ndarray:
        """Relative speed of each worker (1 = nominal)."""
        if self.speeds is not None:
            if len(self.speeds) != workers:
                raise ValueError(f"compute model has {len(self.speeds)} speeds for {workers} workers")
            return np.asarray(self.speeds, dtype=np.float64)
        if self.speed_range is not None:
            rng = np.random.default_rng(np.random.SeedSequence([seed, _SPEED_STREAM]))
            low, high = self.speed_range
            return rng.uniform(low, high, workers)
        return np.ones(workers)

    def compute_times(self, iterations: int, workers: int, seed: int) -> np.ndarray:
        """``(iterations, workers)`` compute seconds: base / speed x straggler factor."""
        base = np.full((iterations, workers), self.compute_s) / self.worker_speeds(workers, seed)[None, :]
        if self.straggler is not None:
            base = base * self.straggler.factors(iterations, workers, seed)
        return base

    def op_seconds(self, nbytes: np.ndarray | float, *, kind: str, speed: np.ndarray | float = 1.0) -> np.ndarray:
        """Seconds of a Reduce (``kind="reduce"``) or Copy (``"copy"``) touching ``nbytes``."""
        rate = self.reduce_bytes_per_s if kind == "reduce" else self.copy_bytes_per_s
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if math.isinf(rate):
            return np.zeros_like(nbytes)
        return nbytes / (rate * np.asarray(speed, dtype=np.float64))
