"""Seeded compute imbalance: MLfabric's straggler settings and eager-SGD's delay injections.

    .venv/bin/python -m pytest tests/emu/test_stragglers.py -q

Pure logic (no network, no root). Every model answers the same question, for iterations
``0 .. I-1`` and workers ``0 .. P-1``: how long is worker ``w`` held up in iteration ``i``?

* :class:`StragglerModel` (MLfabric §7): each worker, each iteration, independently, is slowed
  down by a factor ``slowdown`` with probability ``probability``; presets ``C1 = (10%, 2x)``,
  ``C2 = (10%, 4x)``, ``C3 = (4%, 2x)``. :meth:`~StragglerModel.factors` gives the factors; the
  extra time is ``(factor - 1) * compute_s``. The draws are the simulator's
  (``mlfabric.sim.compute.StragglerModel``: same seed stream, same order), so an emulated and a
  simulated run with one seed have the same stragglers.
* :class:`RandomDelay` (eager-SGD §6, hyperplane regression / ResNet-50): at every step
  ``count`` workers chosen uniformly at random are delayed by ``delay_s``.
* :class:`LinearSkew` (eager-SGD Fig. 8/9 and §6 ResNet-32): worker ``w`` is delayed by
  ``first_s + w * step_s`` (1 ms .. P ms by default); with ``rotate`` the amounts shift by one
  worker after each step.

Inside a training loop, :class:`ImbalanceInjector` turns a model into ``sleep()`` calls for
one rank (it reads rows lazily, so it costs O(P) per iteration whatever the run length).
``imbalance_model("C1")``, ``("random:200ms")``, ``("skew:1ms")``, ``("skew:50ms,50ms,rotate")``
parse the CLI spellings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mlfabric.units import parse_duration

__all__ = [
    "StragglerModel", "RandomDelay", "LinearSkew", "ImbalanceModel", "ImbalanceInjector", "STRAGGLER_PRESETS",
    "imbalance_model",
]

_STRAGGLER_STREAM = 2  # same stream as mlfabric.sim.compute
_RANDOM_DELAY_STREAM = 4


class ImbalanceModel(Protocol):
    def delays(self, iterations: int, workers: int, seed: int, *, compute_s: float = 0.0) -> np.ndarray:
        """``(iterations, workers)`` extra seconds each worker spends in each iteration."""

    def rows(self, workers: int, seed: int, *, compute_s: float = 0.0) -> Iterator[np.ndarray]:
        """The same delays, one iteration at a time (endless)."""


@dataclass(frozen=True, kw_only=True)
class StragglerModel:
    """Each worker, in each iteration, is slowed down by ``slowdown`` with ``probability``."""

    probability: float
    slowdown: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"straggler probability must be in [0, 1], got {self.probability}")
        if not (self.slowdown >= 1.0 and math.isfinite(self.slowdown)):
            raise ValueError(f"straggler slowdown must be a finite factor >= 1, got {self.slowdown}")

    def _rng(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([seed, _STRAGGLER_STREAM]))

    def factors(self, iterations: int, workers: int, seed: int) -> np.ndarray:
        """``(iterations, workers)`` slowdown factors (1 or ``slowdown``); prefixes do not depend on ``iterations``."""
        draws = self._rng(seed).random((iterations, workers))
        return np.where(draws < self.probability, self.slowdown, 1.0)

    def delays(self, iterations: int, workers: int, seed: int, *, compute_s: float = 0.0) -> np.ndarray:
        return (self.factors(iterations, workers, seed) - 1.0) * compute_s

    def rows(self, workers: int, seed: int, *, compute_s: float = 0.0) -> Iterator[np.ndarray]:
        rng = self._rng(seed)  # row-by-row draws equal the (iterations, workers) block's rows
        while True:
            yield (np.where(rng.random(workers) < self.probability, self.slowdown, 1.0) - 1.0) * compute_s


#: MLfabric §7 compute settings C1-C3: (probability, slowdown).
STRAGGLER_PRESETS: dict[str, StragglerModel] = {
    "C1": StragglerModel(probability=0.10, slowdown=2.0),
    "C2": StragglerModel(probability=0.10, slowdown=4.0),
    "C3": StragglerModel(probability=0.04, slowdown=2.0),
}


@dataclass(frozen=True, kw_only=True)
class RandomDelay:
    """Every step, ``count`` distinct workers chosen uniformly at random wait ``delay_s``."""

    delay_s: float
    count: int = 1

    def __post_init__(self) -> None:
        if not (self.delay_s >= 0 and math.isfinite(self.delay_s)):
            raise ValueError(f"delay must be a finite number of seconds >= 0, got {self.delay_s}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")

    def rows(self, workers: int, seed: int, *, compute_s: float = 0.0) -> Iterator[np.ndarray]:
        if self.count > workers:
            raise ValueError(f"cannot delay {self.count} workers out of {workers}")
        rng = np.random.default_rng(np.random.SeedSequence([seed, _RANDOM_DELAY_STREAM]))
        while True:
            row = np.zeros(workers)
            row[rng.permutation(workers)[: self.count]] = self.delay_s
            yield row

    def delays(self, iterations: int, workers: int, seed: int, *, compute_s: float = 0.0) -> np.ndarray:
        rows = self.rows(workers, seed)
        return np.array([next(rows) for _ in range(iterations)]).reshape(iterations, workers)


@dataclass(frozen=True, kw_only=True)
class LinearSkew:
    """Worker ``w`` waits ``first_s + w * step_s`` (default 1 ms .. P ms); ``rotate`` shifts it each step."""

    first_s: float = 0.001
    step_s: float = 0.001
    rotate: bool = False

    def __post_init__(self) -> None:
        if not (self.first_s >= 0 and self.step_s >= 0 and math.isfinite(self.first_s + self.step_s)):
            raise ValueError(f"skew first/step must be finite and >= 0, got {self.first_s}, {self.step_s}")

    def rows(self, workers: int, seed: int, *, compute_s: float = 0.0) -> Iterator[np.ndarray]:
        base = self.first_s + np.arange(workers) * self.step_s
        step = 0
        while True:
            # After `step` steps worker w has the amount of worker (w + step) mod P.
            yield np.roll(base, -step) if self.rotate else base.copy()
            step += 1

    def delays(self, iterations: int, workers: int, seed: int, *, compute_s: float = 0.0) -> np.ndarray:
        rows = self.rows(workers, seed)
        return np.array([next(rows) for _ in range(iterations)]).reshape(iterations, workers)


def imbalance_model(text: str) -> ImbalanceModel | None:
    """Parse ``C1``/``C2``/``C3``, ``none``, ``r,s`` (probability, slowdown), ``random:DELAY[,COUNT]``,
    ``skew:FIRST[,STEP][,rotate]``."""
    key = text.strip()
    lowered = key.lower()
    if lowered in ("", "none", "off"):
        return None
    if key.upper() in STRAGGLER_PRESETS:
        return STRAGGLER_PRESETS[key.upper()]
    try:
        if lowered.startswith("random:"):
            parts = [p.strip() for p in key[7:].split(",")]
            return RandomDelay(delay_s=parse_duration(parts[0]), count=int(parts[1]) if len(parts) > 1 else 1)
        if lowered.startswith("skew:"):
            parts = [p.strip() for p in key[5:].split(",") if p.strip()]
            rotate = bool(parts) and parts[-1].lower() == "rotate"
            if rotate:
                parts = parts[:-1]
            first = parse_duration(parts[0]) if parts else 0.001
            step = parse_duration(parts[1]) if len(parts) > 1 else first
            return LinearSkew(first_s=first, step_s=step, rotate=rotate)
        parts = key.split(",")
        if len(parts) == 2:
            return StragglerModel(probability=float(parts[0]), slowdown=float(parts[1]))
    except (ValueError, IndexError) as exc:
        raise ValueError(f"imbalance model {text!r}: {exc}") from None
    raise ValueError(f"unknown imbalance model {text!r}; use C1, C2, C3, none, 'probability,slowdown' (0.1,4), "
                     "random:200ms[,COUNT] or skew:1ms[,STEP][,rotate]")


@dataclass
class ImbalanceInjector:
    """One rank's view of a model: ``delay()`` gives, and ``sleep()`` waits, this iteration's extra time.

    ``compute_s`` is the base compute time a :class:`StragglerModel` factor multiplies.
    """

    model: ImbalanceModel
    rank: int
    world_size: int
    seed: int = 0
    compute_s: float = 0.0
    iteration: int = 0
    _rows: Iterator[np.ndarray] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")

    def delay(self) -> float:
        """Extra seconds for this rank in the next iteration (advances the iteration)."""
        if self._rows is None:
            self._rows = self.model.rows(self.world_size, self.seed, compute_s=self.compute_s)
        row = next(self._rows)
        self.iteration += 1
        return float(row[self.rank])

    def sleep(self) -> float:
        """Sleep for :meth:`delay` seconds; return them."""
        seconds = self.delay()
        if seconds > 0:
            time.sleep(seconds)
        return seconds
