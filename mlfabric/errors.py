"""The exceptions mlfabric raises; every message names the rank, the peer and the op.

Each one is also the matching ``torch.distributed`` error, so that code written for torch's
backends catches mlfabric's errors unchanged (``except dist.DistBackendError``), and keeps
its own class and message (``except mlfabric.PeerLostError``)::

    MlfabricError            -> torch.distributed.DistError
      TransportError         -> DistNetworkError   (a send, receive or connect failed)
      CollectiveError        -> DistBackendError   (a collective or point-to-point op failed)
        PeerLostError        -> DistBackendError and DistNetworkError (a peer died or left)
          PeerLeftError
        CollectiveTimeoutError  (also TimeoutError)
        CollectiveMismatchError (also ValueError)
      RendezvousError        -> DistStoreError     (the ranks could not meet through the store)

All of them remain ``RuntimeError``s, as torch's are. torch >= 2.3 has the four types; where
one is missing (``_torch_error``) its parent stands in (DistError, else RuntimeError).
The mapping is documented in docs/faults.md and checked by
``python -m pytest tests/unit/test_faults.py -k torch_error``.
"""

from __future__ import annotations

import torch.distributed as _dist


def _torch_error(name: str) -> type[Exception]:
    """torch.distributed's exception ``name``, or the nearest one this torch has."""
    found = getattr(_dist, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    parent = getattr(_dist, "DistError", None)
    return parent if isinstance(parent, type) and issubclass(parent, RuntimeError) else RuntimeError


def _bases(*candidates: type) -> tuple[type, ...]:
    """``candidates`` without the ones an earlier candidate already is (a torch that lacks a
    type gives its parent in its place, which must not appear twice or after a subclass)."""
    bases: list[type] = []
    for candidate in candidates:
        if not any(issubclass(base, candidate) for base in bases):
            bases.append(candidate)
    return tuple(bases)


DistError = _torch_error("DistError")
DistBackendError = _torch_error("DistBackendError")
DistNetworkError = _torch_error("DistNetworkError")
DistStoreError = _torch_error("DistStoreError")


class MlfabricError(*_bases(DistError, RuntimeError)):  # type: ignore[misc]
    """Base class of mlfabric's runtime errors (a ``torch.distributed.DistError``)."""


class TransportError(*_bases(MlfabricError, DistNetworkError)):  # type: ignore[misc]
    """A transport could not send, receive or connect (a ``DistNetworkError``)."""


class CollectiveError(*_bases(MlfabricError, DistBackendError)):  # type: ignore[misc]
    """A collective failed (a ``DistBackendError``); ``rank`` is where it was raised,
    ``peer`` the culprit if known."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


class PeerLostError(*_bases(CollectiveError, DistNetworkError)):  # type: ignore[misc]
    """A peer process died or disconnected while a collective needed it (a
    ``DistBackendError`` and a ``DistNetworkError``)."""


class PeerLeftError(PeerLostError):
    """A peer closed its communicator (or its process exited) before finishing a collective
    the others still run or start; ``peer`` is the rank that left."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called a collective with different sizes, dtypes, ops, roots or algorithms
    (raised on every rank, with both descriptions)."""


class RendezvousError(*_bases(MlfabricError, DistStoreError)):  # type: ignore[misc]
    """The ranks could not find each other: a rank missing, world sizes that disagree, a
    rendezvous port held by another program (a ``DistStoreError``)."""


#: Each mlfabric error and the torch.distributed error it also is (docs/faults.md).
TORCH_ERROR_TYPES: dict[type[MlfabricError], tuple[type[Exception], ...]] = {
    MlfabricError: (DistError,),
    TransportError: (DistNetworkError,),
    CollectiveError: (DistBackendError,),
    PeerLostError: (DistBackendError, DistNetworkError),
    PeerLeftError: (DistBackendError, DistNetworkError),
    CollectiveTimeoutError: (DistBackendError,),
    CollectiveMismatchError: (DistBackendError,),
    RendezvousError: (DistStoreError,),
}
