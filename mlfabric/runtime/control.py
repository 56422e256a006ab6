"""The runtime's control messages: what ranks tell each other about collectives, not data.

Three kinds ride the transport's control channel, tagged ``kind << KIND_SHIFT | seq`` (seq:
the collective they are about):

- **abort**: a collective failed on the sender; the receiver fails its own run of that
  collective with the same kind of error (a mismatch stays a ``CollectiveMismatchError``,
  a lost peer a ``PeerLostError`` naming the same culprit), with the sender's details.
- **query**: a collective has made no progress for a while; the sender asks a peer it waits
  for to compare its description of the collective (a mismatch is then found even when the
  two ranks' schedules exchange no message at all: different roots or algorithms) and to say
  what it is doing (the watchdog logs the answer).
- **status**: the answer to a query.

The goodbye a transport sends when it closes carries a :class:`Farewell`: why the rank left,
the last collective it called and those it left unfinished, so that peers fail exactly the
collectives it will never finish, at once, naming it.

Pure encoding and decoding; exercised by ``python -m pytest tests/unit/test_faults.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import IntEnum

from mlfabric.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLeftError,
    PeerLostError,
)

KIND_SHIFT = 56
_SEQ_MASK = (1 << KIND_SHIFT) - 1


class ControlKind(IntEnum):
    ABORT = 0
    QUERY = 1
    STATUS = 2


def control_tag(kind: ControlKind, seq: int) -> int:
    if not 0 <= seq <= _SEQ_MASK:
        raise ValueError(f"collective sequence number {seq} does not fit a control tag")
    return (int(kind) << KIND_SHIFT) | seq


def split_control_tag(tag: int) -> tuple[ControlKind | None, int]:
    """(kind, seq) of a control tag; kind None for one this version does not know."""
    try:
        kind = ControlKind(tag >> KIND_SHIFT)
    except ValueError:
        kind = None
    return kind, tag & _SEQ_MASK


# -- abort notices ---------------------------------------------------------------------------

# The error classes an abort notice can carry, by the name on the wire. Order matters:
# the first class the error is an instance of names it (PeerLeftError before PeerLostError).
_ABORT_KINDS: tuple[tuple[str, type[CollectiveError]], ...] = (
    ("mismatch", CollectiveMismatchError),
    ("left", PeerLeftError),
    ("lost", PeerLostError),
    ("timeout", CollectiveTimeoutError),
    ("error", CollectiveError),
)


def encode_abort(error: CollectiveError) -> bytes:
    kind = next(name for name, cls in _ABORT_KINDS if isinstance(error, cls))
    return json.dumps({"kind": kind, "peer": error.peer, "message": str(error)[:4000]}).encode()


def abort_error(payload: bytes, *, rank: int, src: int, seq: int) -> CollectiveError:
    """The error rank ``rank`` raises for collective ``seq`` on the abort notice ``payload``
    from ``src``: of the sender's kind, naming the sender's culprit."""
    try:
        note = json.loads(bytes(payload))
        kind, culprit, message = note["kind"], note.get("peer"), str(note["message"])
    except (ValueError, KeyError, TypeError):
        kind, culprit, message = "error", None, bytes(payload).decode(errors="replace")
    cls = dict(_ABORT_KINDS).get(kind, CollectiveError)
    return cls(f"rank {rank}: collective #{seq} aborted by rank {src}: {message}",
               rank=rank, peer=src if culprit is None else culprit)


# -- queries and status ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Status:
    """What a rank says about collective ``seq`` when asked."""

    seq: int
    state: str  # "not started" | "running" | "finished" | "unknown"
    last_seq: int  # the last collective this rank called
    waiting_on: str = ""  # for a running one: what it still waits for
    description: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Status":
        return cls(**json.loads(bytes(payload)))

    def explain(self, rank: int) -> str:
        """One line for the watchdog's log: what rank ``rank`` said."""
        if self.state == "not started":
            return (f"rank {rank} has not called collective #{self.seq} yet (its last call was "
                    f"#{self.last_seq}): it is computing, stuck, or calls collectives in another order")
        if self.state == "running":
            return f"rank {rank} runs collective #{self.seq} too, waiting for {self.waiting_on}"
        if self.state == "finished":
            return f"rank {rank} has finished collective #{self.seq}"
        return f"rank {rank} no longer remembers collective #{self.seq} (its last call was #{self.last_seq})"


# -- the goodbye's note ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Farewell:
    """Why a rank left, the last collective it called and those it had not finished."""

    reason: str
    last_seq: int
    unfinished: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return json.dumps({"reason": self.reason, "last_seq": self.last_seq,
                           "unfinished": list(self.unfinished)}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Farewell":
        """A goodbye without a readable note (a transport closed on its own) says nothing of
        the collectives: every one still running is treated as unfinished by the peer."""
        try:
            note = json.loads(bytes(payload))
            return cls(reason=str(note["reason"]), last_seq=int(note["last_seq"]),
                       unfinished=tuple(int(s) for s in note.get("unfinished", ())))
        except (ValueError, KeyError, TypeError):
            return cls(reason="closed its transport", last_seq=-1)

    def abandons(self, seq: int) -> bool:
        """Whether the rank that left will never finish its part of collective ``seq``."""
        return seq > self.last_seq or seq in self.unfinished
