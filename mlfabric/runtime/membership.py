"""Membership that changes at run time: the quorum through the rendezvous store.

    .venv/bin/python -m pytest tests/unit/test_elastic_membership.py -q

An elastic job's processes have stable *member ids* (a restarted process keeps its id) and,
in each *membership epoch*, a dense rank: the index of its id in the epoch's sorted member
list. Collective schedules are built per (rank, world), so an epoch of N-1 members runs
ring / halving-doubling / tree over N-1 dense ranks with no special case.

Epoch ``E`` is agreed on through the store (a torch.distributed Store that outlives every
worker: the launcher's, not a worker's), under ``elastic/<job>/e<E>/``:

* every process that wants to be in ``E`` registers ``reg/<id>`` (its committed step and the
  signature of its model: names, shapes, dtypes); a process joining from outside also takes
  a ticket ``joiners`` -> ``joiner/<i>`` = its id, which is how the members learn about it;
* a member *closes* the quorum with one ``compare_set`` on ``members`` (the first closer
  wins; everyone reads the same list) once every expected process has registered: the
  previous members not known to be gone (the old transport's ``lost_peers`` and
  ``departed_peers``) plus the joiners. A member that neither registers nor is known gone
  within ``grace_s`` is left out (it is hung or dead without a closed connection); if it
  was alive after all it finds itself outside and joins the next epoch as a joiner;
* a joiner whose signature differs from the members' is rejected (``rejected/<id>`` says
  why) and raises :class:`ElasticJoinError`; the members go on.

Every epoch gets a fresh transport whose job token is :func:`epoch_token` of the job's token
and ``E``: the token rides the handshake of every connection, and a connection whose token is
another epoch's is refused before a byte of it is delivered, so nothing from an old
membership ever reaches a tensor (``tests/unit/test_elastic_recovery_faults.py`` injects such a
message).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from mlfabric.errors import MlfabricError
from mlfabric.transport.base import TOKEN_BYTES

#: How long a member waits for an expected member that has not registered and is not known to
#: be gone before it closes the quorum without it.
DEFAULT_GRACE_S = 5.0
_POLL_S = 0.005
#: How often a waiting joiner looks at the store (it may wait for a whole step of the members).
_JOINER_POLL_S = 0.02


class ElasticError(MlfabricError):
    """The elastic job cannot go on (no quorum within the timeout, a state transfer failed
    its checksum, ...)."""


class ElasticJoinError(ElasticError):
    """This process was refused by the running job (its model differs from the members')."""


class JobFinishedError(ElasticError):
    """A joiner arrived after the job's members had finished training."""


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


@dataclass(frozen=True, kw_only=True)
class Membership:
    """Epoch ``epoch``'s members (sorted ids; a member's dense rank is its index) and the
    step each had committed when it registered (-1: a joiner, which holds no state yet)."""

    epoch: int
    members: tuple[int, ...]
    steps: dict[int, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    @property
    def committed(self) -> int:
        """The highest step any member committed: where the epoch starts."""
        return max(self.steps.values(), default=-1)

    def sources(self) -> tuple[int, ...]:
        """Dense ranks that hold the state of :attr:`committed` (the senders of a transfer)."""
        return tuple(i for i, m in enumerate(self.members) if self.steps.get(m, -1) == self.committed)

    def receivers(self) -> tuple[int, ...]:
        """Dense ranks behind :attr:`committed` (joiners, survivors that missed a step)."""
        return tuple(i for i, m in enumerate(self.members) if self.steps.get(m, -1) != self.committed)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members),
                           "steps": {str(k): v for k, v in self.steps.items()}})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Membership":
        data = json.loads(raw)
        return cls(epoch=int(data["epoch"]), members=tuple(int(m) for m in data["members"]),
                   steps={int(k): int(v) for k, v in data["steps"].items()})


def epoch_token(job_token: bytes, epoch: int) -> bytes:
    """The transport token of membership epoch ``epoch``: a connection made with another
    epoch's token is refused at its handshake."""
    return hashlib.blake2b(job_token + epoch.to_bytes(8, "little"), digest_size=TOKEN_BYTES,
                           person=b"mlfabric-epoch").digest()


def expected_members(previous: Iterable[int], gone: Iterable[int], joiners: Iterable[int]) -> set[int]:
    """Who a closer waits for: the previous members not known to be gone, plus the joiners."""
    return (set(previous) - set(gone)) | set(joiners)


class MembershipStore:
    """The store side of the quorum (keys in the module docstring)."""

    def __init__(self, store: Store, job: str = "job") -> None:
        self.store = store
        self.prefix = f"elastic/{job}/"

    def _key(self, epoch: int, name: str) -> str:
        return f"{self.prefix}e{epoch}/{name}"

    # -- job-wide ----------------------------------------------------------------------------

    def job_token(self) -> bytes:
        """The job's secret (drawn by the first process to ask), from which every epoch's
        transport token derives."""
        key = f"{self.prefix}token"
        self.store.compare_set(key, "", secrets.token_hex(TOKEN_BYTES))
        return bytes.fromhex(self.store.get(key).decode())

    def current_epoch(self) -> int:
        """The latest epoch whose quorum closed (-1: none yet)."""
        key = f"{self.prefix}current"
        return int(self.store.get(key).decode()) if self.store.check([key]) else -1

    def _advance_current(self, epoch: int) -> None:
        key = f"{self.prefix}current"
        while True:
            now = self.store.get(key).decode() if self.store.check([key]) else ""
            if now and int(now) >= epoch:
                return
            if self.store.compare_set(key, now, str(epoch)).decode() == str(epoch):
                return

    # -- one epoch ---------------------------------------------------------------------------

    def finish(self, step: int) -> None:
        """The members finished training at ``step``: joiners stop waiting."""
        self.store.set(f"{self.prefix}finished", str(step))

    def finished(self) -> int | None:
        key = f"{self.prefix}finished"
        return int(self.store.get(key).decode()) if self.store.check([key]) else None

    def register(self, epoch: int, member: int, *, step: int, signature: str, joiner: bool) -> None:
        self.store.set(self._key(epoch, f"reg/{member}"), json.dumps({"step": step, "signature": signature}))
        if joiner:
            ticket = int(self.store.add(self._key(epoch, "joiners"), 1))
            self.store.set(self._key(epoch, f"joiner/{ticket}"), str(member))

    def registration(self, epoch: int, member: int) -> dict | None:
        key = self._key(epoch, f"reg/{member}")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def joiner_count(self, epoch: int) -> int:
        """Joiners that took a ticket for ``epoch`` (the members' leader reads it every step)."""
        return int(self.store.add(self._key(epoch, "joiners"), 0))

    def joiners(self, epoch: int) -> list[int]:
        """The ids of the joiners whose ticket for ``epoch`` is complete."""
        out = []
        for ticket in range(1, self.joiner_count(epoch) + 1):
            key = self._key(epoch, f"joiner/{ticket}")
            if self.store.check([key]):
                out.append(int(self.store.get(key).decode()))
        return out

    def closed(self, epoch: int) -> Membership | None:
        key = self._key(epoch, "members")
        return Membership.from_json(self.store.get(key)) if self.store.check([key]) else None

    def close(self, membership: Membership) -> Membership:
        """Propose ``membership``; returns the one that won (maybe another closer's)."""
        key = self._key(membership.epoch, "members")
        won = Membership.from_json(self.store.compare_set(key, "", membership.to_json()))
        self._advance_current(won.epoch)
        return won

    def reject(self, epoch: int, member: int, reason: str) -> None:
        self.store.set(self._key(epoch, f"rejected/{member}"), reason)

    def rejected(self, epoch: int, member: int) -> str | None:
        key = self._key(epoch, f"rejected/{member}")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def publish(self, epoch: int, member: int, name: str, value: str) -> None:
        """Per-epoch data of one member (its endpoints, its state's checksum)."""
        self.store.set(self._key(epoch, f"{name}/{member}"), value)

    def read(self, epoch: int, member: int, name: str) -> str | None:
        key = self._key(epoch, f"{name}/{member}")
        return self.store.get(key).decode() if self.store.check([key]) else None


def agree(ms: MembershipStore, epoch: int, member: int, *, previous: tuple[int, ...],
          gone: Callable[[], Iterable[int]], step: int, signature: str, joiner: bool,
          timeout: float, grace_s: float = DEFAULT_GRACE_S, may_close: bool = True,
          on_registered: Callable[[], None] | None = None) -> Membership | None:
    """Register ``member`` for ``epoch`` and wait for the quorum (closing it when this member
    is the first to see every expected process registered, or ``grace_s`` passed). Returns
    the membership, or None when it closed without ``member`` (registered too late: join the
    next epoch). Raises :class:`ElasticJoinError` when this joiner was rejected and
    :class:`ElasticError` when no quorum formed within ``timeout``. ``may_close`` False (a
    joiner: it cannot tell who is gone): wait for a member to close it. ``on_registered`` runs
    once the registration is in the store."""
    ms.register(epoch, member, step=step, signature=signature, joiner=joiner)
    if on_registered is not None:
        on_registered()
    start = time.monotonic()
    while True:
        won = ms.closed(epoch)
        if won is not None:
            if member in won.members:
                return won
            reason = ms.rejected(epoch, member)
            if reason is not None:
                raise ElasticJoinError(f"member {member}: the job refused it at membership epoch {epoch}: {reason}")
            return None
        now = time.monotonic()
        if now - start > timeout:
            raise ElasticError(f"member {member}: no quorum for membership epoch {epoch} within {timeout:g} s "
                               f"(previous members {list(previous)}); is the rendezvous store up and are the "
                               "other processes alive?")
        if not may_close:
            done = ms.finished()
            if done is not None:
                raise JobFinishedError(f"member {member}: the job finished (at step {done}) before it could join")
            time.sleep(_JOINER_POLL_S)
            continue
        joiners = ms.joiners(epoch)
        # Who is gone is read before the registrations: a member that leaves an epoch registers
        # for the next one first and then says goodbye, so one seen gone here has its
        # registration in the store already. Read the other way round, a member registering
        # and leaving between the two reads was counted gone but not registered, and the
        # quorum closed without it (it came back as a joiner: an extra epoch and transfer).
        seen_gone = set(gone())
        candidates = set(previous) | set(joiners) | {member}
        registered = {m: r for m in candidates if (r := ms.registration(epoch, m)) is not None}
        expected = expected_members(previous, seen_gone, joiners) | {member}
        if expected <= set(registered) or now - start > grace_s:
            reference = _reference_signature(registered, previous)
            admitted: dict[int, int] = {}
            for m, reg in sorted(registered.items()):
                if reference is not None and reg["signature"] != reference:
                    ms.reject(epoch, m, f"its model ({reg['signature']}) differs from the members' ({reference}); "
                              "start it with the job's model")
                    continue
                admitted[m] = int(reg["step"])
            if member in admitted:
                ms.close(Membership(epoch=epoch, members=tuple(sorted(admitted)), steps=admitted))
                continue  # read back the winner
        time.sleep(_POLL_S)


def _reference_signature(registered: dict[int, dict], previous: tuple[int, ...]) -> str | None:
    """The model signature a quorum admits: the previous members' (they hold the job's model);
    at the first epoch, the lowest registered id's."""
    for m in sorted(registered):
        if m in previous and registered[m]["step"] >= 0:
            return registered[m]["signature"]
    for m in sorted(registered):
        if m in previous:
            return registered[m]["signature"]
    return registered[min(registered)]["signature"] if registered else None
