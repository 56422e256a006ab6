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


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called a collective with different sizes, dtypes, ops or algorithms."""
