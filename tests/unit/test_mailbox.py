"""The transport mailbox: matching by (channel, tag, source), lock-free misses, and dropping
messages nobody will take. Run with ``python -m pytest tests/unit/test_mailbox.py``."""

from __future__ import annotations

import threading

from mlfabric.transport.base import Mailbox, Message


def _msg(src: int, tag: int, channel: str = "0", payload: bytes = b"x") -> Message:
    return Message(src, tag, channel, b"", memoryview(payload))


def test_take_matches_channel_tag_and_source_in_arrival_order() -> None:
    box = Mailbox()
    box.put(_msg(1, 7, payload=b"a"))
    box.put(_msg(2, 7, payload=b"b"))
    box.put(_msg(1, 7, payload=b"c"))
    assert box.take("0", 8) is None and box.take("1", 7) is None
    assert bytes(box.take("0", 7, 2).payload) == b"b"
    assert bytes(box.take("0", 7).payload) == b"a"
    assert box.take("0", 7, 2) is None
    assert bytes(box.take("0", 7, 1).payload) == b"c"
    assert box.take("0", 7) is None and box.pending() == 0
    assert ("0", 7) not in box.queued


def test_take_channel_returns_only_that_channel_and_then_nothing() -> None:
    box = Mailbox()
    box.put(_msg(1, 1, "ctl"))
    box.put(_msg(2, 2, "ctl"))
    box.put(_msg(1, 1, "0"))
    assert sorted(m.src for m in box.take_channel("ctl")) == [1, 2]
    assert box.take_channel("ctl") == []
    box.put(_msg(3, 4, "ctl"))
    assert [m.src for m in box.take_channel("ctl")] == [3]
    assert box.take("0", 1, 1) is not None and box.pending() == 0


def test_discard_drops_the_queued_message_or_the_next_one_without_a_wake_up() -> None:
    box = Mailbox()
    box.put(_msg(1, 5))
    box.discard([("0", 5, 1), ("0", 6, 2)])
    assert box.pending() == 0  # the queued one went at once
    version = box.version
    box.put(_msg(2, 6))  # dropped on arrival: no message, no version change
    assert box.pending() == 0 and box.version == version
    box.put(_msg(2, 6))  # one message per key: the next one is kept
    assert box.take("0", 6, 2) is not None and box.version == version + 1


def test_forget_stops_dropping() -> None:
    box = Mailbox()
    box.discard([("0", 9, 3), ("0", 9, 4)])
    box.forget([("0", 9, 3)])
    box.put(_msg(3, 9))
    box.put(_msg(4, 9))
    assert box.take("0", 9, 3) is not None and box.take("0", 9, 4) is None


def test_a_message_put_while_a_taker_polls_is_never_lost() -> None:
    """take() misses without the lock; a message put meanwhile bumps the version after the
    taker read it, so a taker that looks again whenever the version moved finds it."""
    box = Mailbox()
    count = 2000
    got: list[int] = []

    def taker() -> None:
        version = -1
        while len(got) < count:
            version = box.wait(version, 1.0)
            while (msg := box.take("0", 1, 0)) is not None:
                got.append(msg.tag)

    thread = threading.Thread(target=taker)
    thread.start()
    for _ in range(count):
        box.put(_msg(0, 1))
    thread.join(timeout=30)
    assert not thread.is_alive() and len(got) == count
