"""Partial collectives (eager-SGD §4): an activation broadcast any rank can start, then an
ordinary allreduce.

One schedule per rank, persistent (the runtime re-arms it after every execution), in two
parts (eager-SGD Fig. 6):

* **Activation.** Op 0 is the *internal activation*, a trigger fired when the application
  calls the collective. The activation message then spreads over the union of the P binomial
  trees of recursive doubling: in the tree rooted at ``r`` a rank ``p`` with
  ``v = p XOR r`` gets the message from ``p XOR 2^i`` where ``2^i`` is the highest bit of
  ``v`` and forwards it to ``p XOR 2^j`` for every ``j > i``. So rank ``p`` has one receive
  ``R_i`` from ``p XOR 2^i`` per bit and one send ``S_j`` to ``p XOR 2^j`` per bit, ``S_j``
  firing on *any* of {internal activation, ``R_i`` for ``i < j``}. Ops are consumable: with
  several initiators every send still fires at most once and the allreduce starts once.
  With N not a power of two, the ``N - P`` ranks above the largest power of two ``P`` pair
  with rank ``p - P``: an extra rank that initiates tells its partner, which spreads the
  activation as if it had initiated; every activated partner tells its extra rank.
* **Join.** Op 1, a second trigger, fired when a rank calls *without* initiating (majority's
  ranks other than the round's initiator). It starts this rank's part of the reduction but
  sends no activation: the round still needs the initiator. The paper's majority lets such a
  call wait for the activation instead (§4.2); the result is the same — a rank that called
  contributes its fresh data either way — but joining at once does the callers' share of the
  reduction before the initiator arrives rather than after, which shortens the round the
  callers wait for (docs/architecture.md, "Deviations").
* **Reduction.** ``N1``, an any-of Nop over the internal activation, the join and every
  activation receive, starts the allreduce: the core builders' ops (``ring``, ``halving_doubling``...)
  appended after it. The runtime fills the send buffer into ``data`` when ``N1`` fires —
  fresh data if the application already called, else the stale accumulated buffer — so the
  reduction always has every rank, and data, ready.

``members`` restricts the collective to a subset of ranks (after a failure): the schedule is
built over ``len(members)`` virtual ranks and its peers are mapped back to real ones.

Exercise it with ``python -m pytest tests/unit/test_partial.py``.
"""

from __future__ import annotations

from dataclasses import replace

from mlfabric.schedule import Cost, DepMode, Recv, Schedule, ScheduleBuilder, Send, Slice

INTERNAL_ACTIVATION = 0  # op index of the trigger in every partial schedule
JOIN = 1  # op index of the join trigger in schedules with an activation broadcast
QUORUMS = ("solo", "majority")


def activation_tags(world_size: int) -> int:
    """How many tags the activation uses (the reduction's tags start there)."""
    return max(1, world_size.bit_length()) + 2


def partial_allreduce(world_size: int, rank: int, count: int, *, algorithm: str = "ring",
                      op: str = "sum", members: tuple[int, ...] | None = None,
                      external_activation: bool = True) -> Schedule:
    """The persistent partial-allreduce schedule of ``rank`` (see the module docstring).

    ``external_activation=False`` leaves the activation broadcast out: the reduction starts
    only on this rank's own call, i.e. a synchronous allreduce (quorum ``"all"``)."""
    from mlfabric.collectives import ALLREDUCE_ALGORITHMS, SHAPED_ALGORITHMS  # the registry imports this module

    members = tuple(range(world_size)) if members is None else tuple(members)
    if sorted(set(members)) != sorted(members) or not all(0 <= m < world_size for m in members):
        raise ValueError(f"members {members} must be distinct ranks below {world_size}")
    if rank not in members:
        raise ValueError(f"rank {rank} is not among the members {members}")
    if algorithm not in ALLREDUCE_ALGORITHMS or algorithm in SHAPED_ALGORITHMS:
        raise ValueError(f"partial allreduce runs ring, halving_doubling, tree or ps, not {algorithm!r}")
    n, v = len(members), members.index(rank)
    b = ScheduleBuilder(f"partial_allreduce({algorithm})", v, n)
    b.buffer("data", count)
    trigger = b.trigger("internal activation")
    assert trigger == INTERNAL_ACTIVATION
    if external_activation:
        join = b.trigger("join")
        assert join == JOIN
        activated = [trigger, join, *_activation_ops(b, n, v, trigger)[1:]]
    else:
        activated = [trigger]
    start = b.nop(activated, mode=DepMode.ANY, label="activate reduction")
    reduction = ALLREDUCE_ALGORITHMS[algorithm](n, v, count, op=op)
    b.append(reduction, after=[start], tag_offset=activation_tags(n))
    sched = b.build(Cost(steps=reduction.cost.steps + max(0, (n - 1).bit_length()),
                         elements_sent=dict(reduction.cost.elements_sent)), persistent=True)
    return _on_members(sched, members, world_size)


def _activation_ops(b: ScheduleBuilder, n: int, v: int, trigger: int) -> list[int]:
    """Add the activation broadcast; returns every op whose completion activates this rank."""
    empty = Slice("data", 0, 0)
    core = 1 << (n.bit_length() - 1)  # largest power of two <= n
    bits = core.bit_length() - 1
    fold_tag, unfold_tag = bits, bits + 1
    if v >= core:  # an extra rank: its partner does the spreading
        partner = v - core
        b.send(partner, empty, fold_tag, [trigger])
        return [trigger, b.recv(partner, empty, unfold_tag)]
    sources = [trigger]
    if v + core < n:
        sources.append(b.recv(v + core, empty, fold_tag))
    recvs = [b.recv(v ^ (1 << i), empty, i) for i in range(bits)]
    for j in range(bits):
        b.add(Send(peer=v ^ (1 << j), src=empty, tag=j, deps=tuple(sorted(sources + recvs[:j])),
                   mode=DepMode.ANY))
    if v + core < n:
        b.add(Send(peer=v + core, src=empty, tag=unfold_tag, deps=tuple(sorted([trigger] + recvs)),
                   mode=DepMode.ANY))
    return sources + recvs


def _on_members(sched: Schedule, members: tuple[int, ...], world_size: int) -> Schedule:
    """The schedule of virtual rank ``sched.rank`` among ``members``, addressed to real ranks."""
    if members == tuple(range(world_size)):
        return sched
    ops = tuple(replace(op, peer=members[op.peer]) if isinstance(op, (Send, Recv)) else op
                for op in sched.ops)
    return replace(sched, rank=members[sched.rank], world_size=world_size, ops=ops)


def activation_op_count(schedule: Schedule) -> int:
    """Ops before the reduction (activation broadcast plus the start Nop)."""
    for index, op in enumerate(schedule.ops):
        if getattr(op, "label", "") == "activate reduction":
            return index + 1
    raise ValueError(f"{schedule.name} is not a partial collective schedule")
