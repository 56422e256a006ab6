"""Schedule IR construction errors and the validator, on hand-made sets and every builder.

    python -m pytest tests/unit/test_schedule.py -q
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pytest

from mlfabric.collectives.halving_doubling import halving_doubling_allreduce
from mlfabric.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from mlfabric.collectives.tree import binomial_broadcast, binomial_reduce, tree_allreduce
from mlfabric.schedule import (
    MAX_OP_TAG,
    Copy,
    Cost,
    DepMode,
    Nop,
    Recv,
    Reduce,
    Schedule,
    ScheduleBuilder,
    ScheduleError,
    Send,
    Slice,
    validate,
)
from mlfabric.schedule.interpret import interpret

WORLD_SIZES = range(1, 17)
COUNTS = (0, 1, 7, 1000)

Builder = Callable[[int, int, int], Schedule]

BUILDERS: dict[str, Builder] = {
    "ring_allreduce": lambda n, r, c: ring_allreduce(n, r, c),
    "ring_allreduce_chunked": lambda n, r, c: ring_allreduce(n, r, c, chunks=3),
    "ring_reduce_scatter": lambda n, r, c: ring_reduce_scatter(n, r, c, op="max"),
    "ring_allgather": lambda n, r, c: ring_allgather(n, r, c, chunks=2),
    "halving_doubling": lambda n, r, c: halving_doubling_allreduce(n, r, c),
    "tree_allreduce": lambda n, r, c: tree_allreduce(n, r, c),
    "tree_allreduce_chunked": lambda n, r, c: tree_allreduce(n, r, c, op="min", chunks=3),
    "broadcast_root0": lambda n, r, c: binomial_broadcast(n, r, c),
    "broadcast_root_mid": lambda n, r, c: binomial_broadcast(n, r, c, root=n // 2, chunks=2),
    "broadcast_root_last": lambda n, r, c: binomial_broadcast(n, r, c, root=n - 1),
    "reduce_root0": lambda n, r, c: binomial_reduce(n, r, c, chunks=2),
    "reduce_root_mid": lambda n, r, c: binomial_reduce(n, r, c, root=n // 2, op="max"),
}

ZERO = Cost(steps=0, elements_sent={})


def _sched(rank: int, world_size: int, ops: list, buffers: dict[str, int] | None = None,
           name: str = "hand") -> Schedule:
    return Schedule(name=name, rank=rank, world_size=world_size,
                    buffers=buffers if buffers is not None else {"data": 8},
                    ops=tuple(ops), cost=ZERO)


def _data(offset: int = 0, length: int = 4) -> Slice:
    return Slice("data", offset, length)


# --- IR construction errors -------------------------------------------------------------


@pytest.mark.parametrize("peer", [0, 2, -1, 99])
def test_bad_peer_is_rejected(peer: int) -> None:
    b = ScheduleBuilder("hand", 0, 2)
    b.buffer("data", 8)
    b.send(peer, _data(), tag=0)
    with pytest.raises(ValueError, match=f"hand rank 0: op 0 has bad peer {peer}"):
        b.build(ZERO)


def test_recv_bad_peer_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank 1: op 0 has bad peer 1"):
        _sched(1, 2, [Recv(peer=1, dst=_data(), tag=0)])


@pytest.mark.parametrize("deps", [(1,), (2,), (0, 5)])
def test_dependency_must_point_backwards(deps: tuple[int, ...]) -> None:
    # op 0 is a nop; op 1 names itself or a later op.
    with pytest.raises(ValueError, match=r"op 1 depends on op [125]; dependencies must point"):
        _sched(0, 1, [Nop(), Nop(deps=deps)] + ([Nop()] * 5))
    with pytest.raises(ValueError, match="op 0 depends on op 0"):
        _sched(0, 1, [Nop(deps=(0,))])


def test_undeclared_buffer_is_rejected() -> None:
    ops = [Copy(dst=Slice("scratch", 0, 2), src=_data(0, 2))]
    with pytest.raises(ValueError, match="op 0 uses undeclared buffer 'scratch'"):
        _sched(0, 1, ops)
    _sched(0, 1, ops, buffers={"data": 8, "scratch": 2})  # declared: fine


@pytest.mark.parametrize("sl", [Slice("data", 5, 4), Slice("data", 8, 1), Slice("data", 0, 9)])
def test_slice_out_of_bounds_is_rejected(sl: Slice) -> None:
    with pytest.raises(ValueError, match="exceeds buffer size 8"):
        _sched(0, 2, [Send(peer=1, src=sl, tag=0)])
    _sched(0, 2, [Send(peer=1, src=Slice("data", 8, 0), tag=0)])  # empty slice at the end: fine


def test_negative_slice_is_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        Slice("data", -1, 2)
    with pytest.raises(ValueError, match="negative"):
        Slice("data", 0, -2)


def test_unknown_reduction_is_rejected() -> None:
    with pytest.raises(ValueError, match="op 0 has unknown reduction 'avg'"):
        _sched(0, 2, [Recv(peer=1, dst=_data(), tag=0, reduce="avg")])
    with pytest.raises(ValueError, match="op 0 has unknown reduction 'mean'"):
        _sched(0, 1, [Reduce(dst=_data(0), src=_data(4), op="mean")])


@pytest.mark.parametrize("tag", [-1, MAX_OP_TAG + 1])
def test_tag_out_of_range_is_rejected(tag: int) -> None:
    with pytest.raises(ValueError, match=f"tag {tag} out of range"):
        _sched(0, 2, [Send(peer=1, src=_data(), tag=tag)])


def test_any_of_without_deps_is_rejected() -> None:
    with pytest.raises(ValueError, match="op 0 is any-of with no deps"):
        _sched(0, 1, [Nop(mode=DepMode.ANY)])


def test_builder_dedups_deps_and_drops_none() -> None:
    b = ScheduleBuilder("hand", 0, 1)
    b.buffer("data", 4)
    first = b.nop()
    second = b.nop([first, None, first])
    assert b.build(ZERO).ops[second].deps == (first,)


# --- the validator accepts every builder ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_validator_accepts_builder(name: str) -> None:
    build = BUILDERS[name]
    for n in WORLD_SIZES:
        for count in COUNTS:
            schedules = [build(n, r, count) for r in range(n)]
            report = validate(schedules)
            assert report.world_size == n
            assert report.elements_moved == sum(
                sum(s.elements_sent_by_channel().values()) for s in schedules
            )


def test_validator_report_counts_messages() -> None:
    schedules = [ring_allreduce(4, r, 100) for r in range(4)]
    report = validate(schedules)
    assert report.messages == 4 * 2 * 3  # 4 ranks, 2 phases, 3 steps, 1 chunk
    assert report.elements_moved == 2 * 3 * 100
    assert report.ops == sum(len(s.ops) for s in schedules)


# --- the validator rejects broken sets ------------------------------------------------------


def _pair(ops0: list, ops1: list) -> list[Schedule]:
    return [_sched(0, 2, ops0), _sched(1, 2, ops1)]


def test_rejects_recv_then_send_deadlock() -> None:
    schedules = _pair(
        [Recv(peer=1, dst=_data(0), tag=0), Send(peer=1, src=_data(4), tag=1, deps=(0,))],
        [Recv(peer=0, dst=_data(0), tag=1), Send(peer=0, src=_data(4), tag=0, deps=(0,))],
    )
    with pytest.raises(ScheduleError, match=r"deadlock: 4 ops can never run") as info:
        validate(schedules)
    message = str(info.value)
    assert "rank 0 op 0 (recv tag 0 from 1" in message
    assert "rank 1 op 0 (recv tag 1 from 0" in message
    with pytest.raises(ScheduleError, match="stalled"):
        interpret(schedules, [np.zeros(8), np.zeros(8)])


def test_send_then_recv_is_no_deadlock_with_eager_sends() -> None:
    schedules = _pair(
        [Send(peer=1, src=_data(4), tag=1), Recv(peer=1, dst=_data(0), tag=0, deps=(0,))],
        [Send(peer=0, src=_data(4), tag=0), Recv(peer=0, dst=_data(0), tag=1, deps=(0,))],
    )
    validate(schedules)


def test_rejects_size_mismatch() -> None:
    schedules = _pair([Send(peer=1, src=_data(0, 4), tag=3)],
                      [Recv(peer=0, dst=_data(0, 3), tag=3)])
    with pytest.raises(ScheduleError, match=r"size mismatch: rank 0 op 0 sends 4 elements \(tag 3.*"
                                            r"rank 1 op 0 receives 3"):
        validate(schedules)


def test_rejects_unmatched_send() -> None:
    schedules = _pair([Nop(), Send(peer=1, src=_data(), tag=5)], [])
    with pytest.raises(ScheduleError, match="rank 0 op 1 sends tag 5 to rank 1 on channel '0', "
                                            "but rank 1 never receives it"):
        validate(schedules)


def test_rejects_unmatched_recv() -> None:
    schedules = _pair([], [Recv(peer=0, dst=_data(), tag=2)])
    with pytest.raises(ScheduleError, match="rank 1 op 0 receives tag 2 from rank 0 on channel "
                                            "'0', but rank 0 never sends it"):
        validate(schedules)


def test_same_tag_on_another_channel_does_not_match() -> None:
    schedules = _pair([Send(peer=1, src=_data(), tag=2, channel="1")],
                      [Recv(peer=0, dst=_data(), tag=2, channel="0")])
    with pytest.raises(ScheduleError, match="never receives it"):
        validate(schedules)


def test_rejects_duplicated_tag() -> None:
    schedules = _pair(
        [Send(peer=1, src=_data(0), tag=7), Send(peer=1, src=_data(4), tag=7)],
        [Recv(peer=0, dst=_data(0), tag=7), Recv(peer=0, dst=_data(4), tag=8)],
    )
    with pytest.raises(ScheduleError, match="hand rank 0: ops 0 and 1 both send tag 7 on channel "
                                            "'0' with peer 1; tags must be unique"):
        validate(schedules)


def test_rejects_race_between_send_and_overwriting_recv() -> None:
    # rank 0 sends data[0:4] while concurrently receiving into data[2:6].
    schedules = _pair(
        [Send(peer=1, src=_data(0, 4), tag=0), Recv(peer=1, dst=_data(2, 4), tag=1)],
        [Recv(peer=0, dst=_data(0, 4), tag=0), Send(peer=0, src=_data(4, 4), tag=1)],
    )
    with pytest.raises(ScheduleError, match=r"hand rank 0: ops 0 \(send tag 0 to 1 on '0'\) "
                                            r"and 1 \(recv tag 1 from 1 on '0'\) touch "
                                            r"overlapping memory"):
        validate(schedules)
    validate(schedules, check_races=False)
    # Ordering the receive after the send removes the race.
    fixed = _pair(
        [Send(peer=1, src=_data(0, 4), tag=0), Recv(peer=1, dst=_data(2, 4), tag=1, deps=(0,))],
        list(schedules[1].ops),
    )
    validate(fixed)


def test_rejects_two_concurrent_reducing_recvs() -> None:
    schedules = _pair(
        [Recv(peer=1, dst=_data(0, 4), tag=0, reduce="sum"),
         Recv(peer=1, dst=_data(0, 4), tag=1, reduce="sum")],
        [Send(peer=0, src=_data(0, 4), tag=0), Send(peer=0, src=_data(0, 4), tag=1)],
    )
    with pytest.raises(ScheduleError, match="rank 0: ops 0 .* and 1 .* overlapping"):
        validate(schedules)


def test_concurrent_reads_are_no_race() -> None:
    schedules = [
        _sched(0, 3, [Send(peer=1, src=_data(0, 8), tag=0), Send(peer=2, src=_data(2, 4), tag=0)]),
        _sched(1, 3, [Recv(peer=0, dst=_data(0, 8), tag=0)]),
        _sched(2, 3, [Recv(peer=0, dst=_data(0, 4), tag=0)]),
    ]
    validate(schedules)


def test_rejects_misnumbered_set() -> None:
    schedules = [_sched(0, 2, []), _sched(0, 2, [])]
    with pytest.raises(ScheduleError, match="index 1 claims rank 0 of 2"):
        validate(schedules)
    with pytest.raises(ScheduleError, match="index 0 claims rank 0 of 3"):
        validate([_sched(0, 3, [])])
    with pytest.raises(ScheduleError, match="empty"):
        validate([])


def _drop_deps(sched: Schedule, index: int) -> Schedule:
    ops = list(sched.ops)
    ops[index] = dataclasses.replace(ops[index], deps=())
    return dataclasses.replace(sched, ops=tuple(ops))


def test_builder_write_after_read_dependencies_are_needed() -> None:
    """Dropping a builder's write-after-read dependency must be caught as a race."""
    # tree allreduce, rank 1 of 4: reduce-phase send to 0, then broadcast receive from 0.
    tree = [tree_allreduce(4, r, 10) for r in range(4)]
    recv_index = max(i for i, op in enumerate(tree[1].ops) if isinstance(op, Recv))
    assert tree[1].ops[recv_index].reduce is None and tree[1].ops[recv_index].deps
    tree[1] = _drop_deps(tree[1], recv_index)
    with pytest.raises(ScheduleError, match=f"tree_allreduce rank 1: ops 0 .* and {recv_index} "
                                            "\\(recv tag 1 from 0"):
        validate(tree)
    # halving-doubling, rank 0 of 4: the last doubling receive overwrites what the first
    # halving send read.
    hd = [halving_doubling_allreduce(4, r, 16) for r in range(4)]
    last = len(hd[0].ops) - 1
    assert isinstance(hd[0].ops[last], Recv) and hd[0].ops[last].peer == 2
    hd[0] = _drop_deps(hd[0], last)
    with pytest.raises(ScheduleError, match=f"rank 0: ops 0 \\(send tag 1 to 2 .*\\) and {last}"):
        validate(hd)
    # halving-doubling with a folded pair (N = 3): rank 0's result receive overwrites the
    # vector its fold send reads.
    hd3 = [halving_doubling_allreduce(3, r, 5) for r in range(3)]
    hd3[0] = _drop_deps(hd3[0], 1)
    with pytest.raises(ScheduleError, match="rank 0: ops 0 .* and 1 .* overlapping"):
        validate(hd3)


# --- any-of dependencies --------------------------------------------------------------------


def _any_of_pair(mode: DepMode) -> list[Schedule]:
    """Rank 0's send waits on (a) a recv that only rank 0's own send unblocks, or (b) a nop."""
    rank0 = [
        Recv(peer=1, dst=_data(0, 2), tag=1),
        Nop(),
        Send(peer=1, src=_data(4, 2), tag=0, deps=(0, 1), mode=mode),
    ]
    rank1 = [
        Recv(peer=0, dst=_data(0, 2), tag=0),
        Send(peer=0, src=_data(4, 2), tag=1, deps=(0,)),
    ]
    return _pair(rank0, rank1)


def test_any_of_fires_on_first_dependency() -> None:
    validate(_any_of_pair(DepMode.ANY))
    with pytest.raises(ScheduleError, match="deadlock: 4 ops"):
        validate(_any_of_pair(DepMode.ALL))
    data = [np.arange(8), np.arange(8) * 10]
    out = interpret(_any_of_pair(DepMode.ANY), data)
    np.testing.assert_array_equal(out[1][0:2], [4, 5])
    np.testing.assert_array_equal(out[0][0:2], [40, 50])


def test_any_of_fires_exactly_once() -> None:
    # Both dependencies complete; a Reduce that ran twice would double the accumulator.
    ops = [
        Copy(dst=_data(0, 1), src=_data(1, 1)),
        Copy(dst=_data(2, 1), src=_data(3, 1)),
        Reduce(dst=_data(4, 1), src=_data(5, 1), op="sum", deps=(0, 1), mode=DepMode.ANY),
        Nop(deps=(0, 1, 2)),
    ]
    sched = _sched(0, 1, ops)
    validate([sched])
    out = interpret([sched], [np.array([0, 1, 0, 3, 100, 7, 0, 0])])
    np.testing.assert_array_equal(out[0], [1, 1, 3, 3, 107, 7, 0, 0])


def test_any_of_recv_fires_once_when_both_deps_complete() -> None:
    rank0 = [Nop(), Nop(), Recv(peer=1, dst=_data(0, 2), tag=0, reduce="sum", deps=(0, 1),
                                mode=DepMode.ANY)]
    rank1 = [Send(peer=0, src=_data(0, 2), tag=0)]
    schedules = _pair(rank0, rank1)
    validate(schedules)
    out = interpret(schedules, [np.ones(8, dtype=np.int64), np.full(8, 5)])
    np.testing.assert_array_equal(out[0][:2], [6, 6])


def test_any_of_orders_only_by_common_ancestors() -> None:
    # op 2 may fire after the nop alone, before the copy writing what it reads: a race.
    ops = [Copy(dst=_data(0, 2), src=_data(4, 2)), Nop(),
           Copy(dst=_data(6, 2), src=_data(0, 2), deps=(0, 1), mode=DepMode.ANY)]
    with pytest.raises(ScheduleError, match=r"rank 0: ops 0 \(copy\) and 2 \(copy\) touch"):
        validate([_sched(0, 1, ops)])
    # ...unless both alternatives come after the writer.
    ops = [Copy(dst=_data(0, 2), src=_data(4, 2)), Nop(deps=(0,)),
           Copy(dst=_data(6, 2), src=_data(0, 2), deps=(0, 1), mode=DepMode.ANY)]
    validate([_sched(0, 1, ops)])


# --- stricter transport model: a send completes only together with its receive -------------


def _rendezvous_stuck(schedules: list[Schedule]) -> list[tuple[int, int]]:
    """Ops that never complete if a send (e.g. zero-copy, unbuffered) finishes only when the
    matching receive is posted; the validator models eager sends, this is the harsher case."""
    armed: dict[tuple[int, int, str, int], tuple[int, int]] = {}
    done = [[False] * len(s.ops) for s in schedules]
    waiting = [[len(op.deps) for op in s.ops] for s in schedules]
    dependents = [s.dependents() for s in schedules]
    queue = [(r, i) for r, s in enumerate(schedules) for i, op in enumerate(s.ops) if not op.deps]
    fired: set[tuple[int, int]] = set()

    def complete(r: int, i: int) -> None:
        done[r][i] = True
        for j in dependents[r][i]:
            if schedules[r].ops[j].mode is DepMode.ANY:
                queue.append((r, j))
            else:
                waiting[r][j] -= 1
                if waiting[r][j] == 0:
                    queue.append((r, j))

    while queue:
        r, i = queue.pop()
        if (r, i) in fired:
            continue
        fired.add((r, i))
        op = schedules[r].ops[i]
        if isinstance(op, (Send, Recv)):
            key = (r, op.peer, op.channel, op.tag) if isinstance(op, Send) else \
                (op.peer, r, op.channel, op.tag)
            if key in armed:
                complete(*armed.pop(key))
                complete(r, i)
            else:
                armed[key] = (r, i)
        else:
            complete(r, i)
    return [(r, i) for r, flags in enumerate(done) for i, f in enumerate(flags) if not f]


def test_rendezvous_model_catches_send_send_cycle() -> None:
    schedules = _pair(
        [Send(peer=1, src=_data(4), tag=1), Recv(peer=1, dst=_data(0), tag=0, deps=(0,))],
        [Send(peer=0, src=_data(4), tag=0), Recv(peer=0, dst=_data(0), tag=1, deps=(0,))],
    )
    assert len(_rendezvous_stuck(schedules)) == 4


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builders_progress_with_rendezvous_sends(name: str) -> None:
    for n in (1, 2, 3, 5, 6, 8, 11, 16):
        for count in (0, 7):
            assert _rendezvous_stuck([BUILDERS[name](n, r, count) for r in range(n)]) == []


def test_validator_rejects_schedules_of_different_collectives() -> None:
    from mlfabric.collectives import ring_allreduce, tree_allreduce

    mixed = [ring_allreduce(2, 0, 8), tree_allreduce(2, 1, 8)]
    with pytest.raises(ScheduleError, match="different collectives"):
        validate(mixed)


def test_interpreter_rejects_data_of_the_wrong_length() -> None:
    import numpy as np

    from mlfabric.collectives import ring_allreduce
    from mlfabric.schedule.interpret import interpret

    with pytest.raises(ValueError, match="schedule expects 10"):
        interpret([ring_allreduce(2, r, 10) for r in range(2)], [np.arange(4), np.arange(4)])
