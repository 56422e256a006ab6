"""User-space rate limiting of a transport's channels: the emulator's fallback without root.

When ``mlfabric launch`` cannot build namespaces and ``tc`` shapers (no root), ranks run as
plain processes on loopback and the zmq or tcp transport paces its sends instead: every channel is
a virtual NIC of ``rate`` bits per second. A message of ``B`` bytes occupies the channel for
``8 B / rate`` seconds after the previous one and is handed to the socket at the *end* of that
time, like a store-and-forward link, so a stream of messages arrives at exactly ``rate``.
Pacing is per message: a message is never split, so for fair sharing or latency studies a
kernel shaper (the emulator) is the real thing; for throughput it is within a few percent.

``MLFABRIC_PACE="100mbit"`` paces every channel, ``"0=1gbit,1=500mbit"`` per channel.

Exercise it with ``python -m pytest tests/unit/test_pacing.py tests/local/test_pacing_transports.py``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Mapping

from mlfabric.units import parse_rate

__all__ = ["PACE_ENV", "ChannelClock", "Pacer", "parse_pace"]

PACE_ENV = "MLFABRIC_PACE"
log = logging.getLogger("mlfabric.transport.pacing")


def parse_pace(text: str, channels: tuple[str, ...], *, what: str = PACE_ENV) -> dict[str, float]:
    """``"100mbit"`` (every channel) or ``"0=1gbit,1=500mbit"`` -> bits/s per channel.
    ``what`` names the setting in error messages."""
    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        rate = parse_rate(text)
        return {name: rate for name in channels}
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, rate = item.strip().partition("=")
        if not sep or not name or not rate:
            raise ValueError(f"{what} item {item!r} is not CHANNEL=RATE (e.g. 0=1gbit)")
        if name not in channels:
            raise ValueError(f"{what} names channel {name!r}, but the channels are {channels}")
        out[name] = parse_rate(rate)
    return out


class ChannelClock:
    """When each message may leave: a virtual link per channel (pure logic, no threads)."""

    def __init__(self, rates_bps: Mapping[str, float]) -> None:
        for name, rate in rates_bps.items():
            if rate <= 0:
                raise ValueError(f"channel {name!r}: pacing rate must be positive, got {rate}")
        self.rates = dict(rates_bps)
        self._free_at: dict[str, float] = {}

    def paced(self, channel: str) -> bool:
        return channel in self.rates

    def departure(self, channel: str, nbytes: int, now: float) -> float:
        """The time the message is delivered: when the link has finished serializing it."""
        start = max(now, self._free_at.get(channel, now))
        finish = start + nbytes * 8.0 / self.rates[channel]
        self._free_at[channel] = finish
        return finish


class Pacer:
    """Runs ``send()`` callables at their departure times from one background thread."""

    def __init__(self, rates_bps: Mapping[str, float], *, name: str = "mlfabric-pacer") -> None:
        self.clock = ChannelClock(rates_bps)
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, channel: str, nbytes: int, send: Callable[[], None]) -> None:
        """Schedule ``send`` for when ``nbytes`` have crossed ``channel``'s virtual link."""
        with self._cond:
            due = self.clock.departure(channel, nbytes, time.monotonic())
            heapq.heappush(self._heap, (due, next(self._order), send))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else self._heap[0][0] - time.monotonic()
                    self._cond.wait(wait)
                if self._stop:
                    return
                _, _, send = heapq.heappop(self._heap)
            try:
                send()
            except Exception:  # a socket closed under us at shutdown: nothing left to pace
                log.debug("paced send failed", exc_info=True)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._heap.clear()
            self._cond.notify()
        self._thread.join(timeout=5)
