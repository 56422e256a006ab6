"""The parameter server's wire messages: tags, the small JSON header each one carries, and the typed headers.

    python -m pytest tests/unit/test_ps.py -k protocol

Everything a worker sends a server rides one tag, ``request_tag(session)``, so that the
transport's per-(channel, tag) FIFO keeps a worker's push ahead of its ``clock`` and its
``leave`` (the server must see them in the order they were sent). What kind of request a
message is, and its fields, sit in the message's meta as JSON (a few hundred bytes at most);
the payload is the tensor, if any. A worker's pushes and pulls are typed (:class:`Push`,
:class:`Pull`) until the policy that sends them encodes them, once, with what it adds. Answers go back on ``reply_tag(session, request_id)`` so
that the thread waiting for one takes exactly its own.

Tags live in their own namespace (bit 60) apart from the collectives' (sequence << 24) and the
partial collectives' (bit 63); ``session`` keeps consecutive PS instances of one job (one per
training run) apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from mlfabric.errors import MlfabricError

NAMESPACE = 1 << 60
_KIND_SHIFT, _SESSION_SHIFT = 52, 40
_SEQ_MASK = (1 << _SESSION_SHIFT) - 1
MAX_SESSIONS = 1 << (_KIND_SHIFT - _SESSION_SHIFT)

REQUEST, REPLY, ALLREDUCE_PUSH, ALLREDUCE_RESULT, REPLICATE = 1, 2, 3, 4, 5
# The scheduled routing policy (MLfabric, ``ps/policies/scheduled/``): update requests and monitor
# reports to the scheduler, its decisions back (seq = the update's id), and the traffic of
# aggregators (group plans from the scheduler, members from workers).
SCHEDULE, DECISION, AGGREGATE = 6, 7, 8
# The mlnet routing policy (MLNET, ``ps/policies/mlnet.py``): what tree nodes send their parents
# (sums, clocks, leaves, pulls); answers come back on the reply tags.
TREE = 9

# Request kinds (meta["op"]).
INIT, PUSH, CLOCK, PULL, LEAVE, STATS = "init", "push", "clock", "pull", "leave", "stats"
ORDER = "order"  # from the scheduler to a server: a batch's application order
ADOPT = "adopt"  # from a worker to a replica promoted to server: the worker's clock
ATTACH = "attach"  # from an mlnet node to its new parent (node or server) after a repair


class PSRequestError(MlfabricError, ValueError):
    """A server refused a request (the message says which server, why and what to do)."""


def tag(kind: int, session: int, seq: int = 0) -> int:
    if not 0 <= session < MAX_SESSIONS:
        raise ValueError(f"PS session {session} is outside 0..{MAX_SESSIONS - 1}")
    return NAMESPACE | (kind << _KIND_SHIFT) | (session << _SESSION_SHIFT) | (seq & _SEQ_MASK)


def request_tag(session: int) -> int:
    return tag(REQUEST, session)


def reply_tag(session: int, request_id: int) -> int:
    return tag(REPLY, session, request_id)


@dataclass(frozen=True, slots=True)
class Push:
    """A push's header before it is on the wire: the worker fills it, the policy encodes it
    once, with what it adds (a batch, an id), as it sends (never decoded on the sender)."""

    model: str
    clock: int
    version: int
    norm: float | None = None

    def fields(self, **extra: Any) -> dict[str, Any]:
        return {"op": PUSH, "model": self.model, "clock": self.clock, "version": self.version, "norm": self.norm,
                **extra}

    def encode(self, **extra: Any) -> bytes:
        return encode(**self.fields(**extra))


@dataclass(frozen=True, slots=True)
class Pull:
    """A pull's header before it is on the wire (see :class:`Push`). ``staleness``: the pull's
    own bound (None: the job's); ``order``: an ordered pull's order; ``direct``: answer from the
    server itself (the worker's distributor was lost)."""

    id: int
    model: str
    clock: int
    staleness: float | None = None
    order: str | None = None
    direct: bool = False

    def fields(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"op": PULL, "id": self.id, "model": self.model, "clock": self.clock,
                               "staleness": self.staleness}
        if self.order is not None:
            out["order"] = self.order
        if self.direct:
            out["direct"] = True
        return {**out, **extra}

    def encode(self, **extra: Any) -> bytes:
        return encode(**self.fields(**extra))


def encode(**fields: Any) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def decode(meta: bytes) -> dict[str, Any]:
    try:
        data = json.loads(bytes(meta).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed parameter-server header: {exc}") from None
    if not isinstance(data, dict) or "op" not in data:
        raise ValueError(f"malformed parameter-server header: {data!r}")
    return data


def payload_tensor(payload: memoryview, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
    """The received ``payload`` as a 1-D tensor of ``numel`` x ``dtype`` (no copy when the
    transport's buffer is writable); ValueError naming ``what`` if the size is wrong."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if payload.nbytes != numel * itemsize:
        raise ValueError(f"{what}: {payload.nbytes} bytes, expected {numel} x {dtype} = {numel * itemsize}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    buf = payload if not payload.readonly else memoryview(bytearray(payload))
    return torch.frombuffer(buf, dtype=dtype)
