"""The PS runtime's one bounded wait (mlfabric/ps/waits.py): ready, a watched peer gone, or the deadline -- each named.

    .venv/bin/python -m pytest tests/unit/test_ps_waits.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from mlfabric.errors import CollectiveTimeoutError, PeerLostError
from mlfabric.ps.waits import sends_done, wait_until
from mlfabric.transport.base import SendHandle
from mlfabric.transport.local import LocalFabric


def _pair():  # type: ignore[no-untyped-def]
    fabric = LocalFabric(2)
    return fabric, fabric.transport(0), fabric.transport(1)


def test_it_returns_what_became_ready_while_it_progressed() -> None:
    _, a, b = _pair()
    threading.Timer(0.05, lambda: b.send(0, 7, b"x")).start()
    msg = wait_until(a, lambda: a.mailbox.take(a.channels[0], 7, 1), time.monotonic() + 5, who="rank 0",
                     what="a test message")
    assert msg is not None and bytes(msg.payload) == b"x"


def test_a_timeout_names_who_waited_for_what() -> None:
    _, a, _ = _pair()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="rank 0: the answer of rank 1: not done in time"):
        wait_until(a, lambda: None, time.monotonic() + 0.1, who="rank 0", what="the answer of rank 1")
    assert time.monotonic() - started < 1.0
    assert wait_until(a, lambda: None, time.monotonic() + 0.05, who="w", what="x", required=False) is None
    with pytest.raises(KeyError, match="custom"):
        wait_until(a, lambda: None, time.monotonic() + 0.05, who="w", what="x", on_timeout=lambda: KeyError("custom"))


def test_a_watched_peer_that_is_gone_ends_the_wait_at_once_naming_it() -> None:
    fabric, a, _ = _pair()
    fabric.kill(1)
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 0: a pull: rank 1 (was lost|left the job)"):
        wait_until(a, lambda: None, time.monotonic() + 10, who="rank 0", what="a pull", watch=[1])
    assert time.monotonic() - started < 2.0
    with pytest.raises(RuntimeError, match="gone: 1"):
        wait_until(a, lambda: None, time.monotonic() + 10, who="rank 0", what="a pull", watch=lambda: [1],
                   on_gone=lambda peer: RuntimeError(f"gone: {peer}"))


def test_sends_done_is_best_effort() -> None:
    _, a, _ = _pair()
    assert sends_done(a, [SendHandle(done=True)], 1.0, who="w", what="sends")
    assert not sends_done(a, [SendHandle(done=False)], 0.05, who="w", what="sends")
