"""The parameter server's one bounded wait: progress the transport until something is ready, a watched peer is gone, or the deadline.

    .venv/bin/python -m pytest tests/unit/test_ps.py -q -k "timeout or lost"

Every wait of the PS runtime and its policies (a reply, the sends in flight at a leave, a
scheduler's decision, an ordered pull's pieces) is this loop: take what is ready, else check
the peers it depends on, else progress the transport until the mailbox changes (at most
``poll`` s), never past ``deadline``. What it says when it gives up names who waited, for what,
and on whom.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, TypeVar

from mlfabric.errors import CollectiveTimeoutError, PeerLostError
from mlfabric.transport.base import Transport

T = TypeVar("T")


def wait_until(transport: Transport, ready: Callable[[], T], deadline: float, *, who: str, what: str,
               watch: Iterable[int] | Callable[[], Iterable[int]] = (),
               on_gone: Callable[[int], BaseException] | None = None,
               on_timeout: Callable[[], BaseException] | None = None, required: bool = True,
               poll: float = 0.1) -> T | None:
    """``ready()``'s first truthy value, progressing ``transport`` in between.

    ``watch``: peers (or a function giving them, read at every turn) whose loss or departure
    ends the wait: ``on_gone(peer)`` is raised (default: a PeerLostError naming ``who``,
    ``what`` and the peer). At ``deadline`` (``time.monotonic()``): ``on_timeout()`` is raised
    (default: a CollectiveTimeoutError naming them), or None is returned when not ``required``
    (a best-effort wait: the sends in flight at a leave)."""
    mailbox = transport.mailbox
    while True:
        version = mailbox.version
        value = ready()
        if value:
            return value
        for peer in (watch() if callable(watch) else watch):
            if transport.is_gone(peer):
                if on_gone is not None:
                    raise on_gone(peer)
                how = transport.lost_peers.get(peer)
                raise PeerLostError(f"{who}: {what}: rank {peer} " + (f"was lost ({how})" if how else "left the job"),
                                    rank=transport.rank, peer=peer)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if not required:
                return None
            if on_timeout is not None:
                raise on_timeout()
            raise CollectiveTimeoutError(f"{who}: {what}: not done in time (the deadline passed)", rank=transport.rank)
        transport.progress(version, min(remaining, poll))


def sends_done(transport: Transport, handles: list, timeout: float, *, who: str, what: str,
               poll: float = 0.01) -> bool:
    """Wait (best effort, at most ``timeout`` s) until every send handle is done; True if they are."""
    return bool(wait_until(transport, lambda: all(h.done() for h in handles), time.monotonic() + timeout,
                           who=who, what=what, required=False, poll=poll))


__all__ = ["sends_done", "wait_until"]
