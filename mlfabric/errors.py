"""The exceptions mlfabric raises; every message names the rank, the peer and the op."""

from __future__ import annotations


class MlfabricError(RuntimeError):
    """Base class of mlfabric's runtime errors."""


class TransportError(MlfabricError):
    """A transport could not send, receive or connect."""


class CollectiveError(MlfabricError):
    """A collective failed; ``rank`` is where it was raised, ``peer`` the culprit if known."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


class PeerLostError(CollectiveError):
    """A peer process died or disconnected while a collective needed it."""


class PeerLeftError(PeerLostError):
    """A peer closed its communicator (or its process exited) before finishing a collective
    the others still run or start; ``peer`` is the rank that left."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called a collective with different sizes, dtypes, ops, roots or algorithms
    (raised on every rank, with both descriptions)."""


class RendezvousError(MlfabricError):
    """The ranks could not find each other: a rank missing, world sizes that disagree, a
    rendezvous port held by another program."""
