"""User-space pacing (transport/pacing.py): the virtual link's clock, the spec strings and
the pacer thread's timing.

    python -m pytest tests/unit/test_pacing.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from mlfabric.transport.pacing import ChannelClock, Pacer, parse_pace


def test_parse_pace() -> None:
    assert parse_pace("100mbit", ("0", "1")) == {"0": 100e6, "1": 100e6}
    assert parse_pace("0=1gbit,1=500mbit", ("0", "1")) == {"0": 1e9, "1": 500e6}
    assert parse_pace("", ("0",)) == {}
    with pytest.raises(ValueError, match="CHANNEL=RATE"):
        parse_pace("0=1gbit,=5", ("0",))
    with pytest.raises(ValueError, match="channel '2'"):
        parse_pace("2=1gbit", ("0", "1"))
    with pytest.raises(ValueError):
        parse_pace("fast", ("0",))


def test_clock_serializes_messages_per_channel() -> None:
    clock = ChannelClock({"0": 8e6, "1": 16e6})  # 1 MB/s and 2 MB/s
    assert clock.departure("0", 1_000_000, now=10.0) == pytest.approx(11.0)
    # the link is busy until 11: the next message finishes a second later
    assert clock.departure("0", 500_000, now=10.2) == pytest.approx(11.5)
    # an idle link starts from now
    assert clock.departure("0", 1_000_000, now=20.0) == pytest.approx(21.0)
    # channels are independent
    assert clock.departure("1", 1_000_000, now=10.0) == pytest.approx(10.5)
    assert not clock.paced("2")
    with pytest.raises(ValueError, match="positive"):
        ChannelClock({"0": 0})


def test_pacer_runs_sends_in_order_at_the_rate() -> None:
    pacer = Pacer({"0": 80e6})  # 10 MB/s
    done: list[tuple[int, float]] = []
    finished = threading.Event()
    start = time.monotonic()
    for i in range(5):
        def send(i: int = i) -> None:
            done.append((i, time.monotonic() - start))
            if i == 4:
                finished.set()
        pacer.submit("0", 200_000, send)  # 20 ms each
    assert finished.wait(5)
    pacer.close()
    assert [i for i, _ in done] == list(range(5))
    # the 5th message leaves after 5 x 20 ms of serialization, not before
    assert done[-1][1] == pytest.approx(0.100, abs=0.03)
    assert done[0][1] >= 0.015
