"""Partial collectives (eager-SGD §4): the activation schedule's structure, and the runtime's
semantics on the threads transport — sums, rounds, several initiators, catching up,
conservation, a lost rank, bad arguments.

    python -m pytest tests/unit/test_partial.py -q
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

import mlfabric
from mlfabric.collectives.partial import INTERNAL_ACTIVATION, JOIN, activation_op_count, partial_allreduce
from mlfabric.runtime.communicator import Communicator
from mlfabric.runtime.partial import _KEEP_DRAINING
from mlfabric.schedule import DepMode, Recv, Send, validate
from mlfabric.schedule.interpret import interpret
from mlfabric.schedule.validate import walk
from mlfabric.transport.local import LocalFabric

WORLDS = [1, 2, 3, 4, 5, 6, 8, 11]


# --- the schedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "tree", "ps"])
def test_schedule_is_valid_persistent_and_reduces(n: int, algorithm: str) -> None:
    schedules = [partial_allreduce(n, r, 9, algorithm=algorithm) for r in range(n)]
    validate(schedules)  # every rank initiating: all sends match, no deadlock, no race
    assert all(s.persistent and s.triggers == (INTERNAL_ACTIVATION, JOIN) for s in schedules)
    data = [np.arange(9) * (r + 1) for r in range(n)]
    for out in interpret(schedules, data):
        np.testing.assert_array_equal(out, np.arange(9) * n * (n + 1) // 2)


@pytest.mark.parametrize("n", WORLDS)
def test_any_single_initiator_activates_everyone(n: int) -> None:
    schedules = [partial_allreduce(n, r, 5) for r in range(n)]
    for initiator in range(n):
        done = walk(schedules, triggered=lambda rank, _i, who=initiator: rank == who)
        for rank, flags in enumerate(done):
            first = activation_op_count(schedules[rank]) - 1
            assert all(flags[first:]), f"N={n} initiator {initiator}: rank {rank} did not reduce"
            assert flags[INTERNAL_ACTIVATION] == (rank == initiator)


@pytest.mark.parametrize("n", [4, 6, 8])
def test_joins_start_the_reduction_but_only_an_initiator_completes_it(n: int) -> None:
    """Majority's non-initiators *join* (trigger JOIN): their reduction starts, but they send
    no activation, so without the initiator the ranks that did not call never reduce; with
    it every rank does, and the activation still takes N-1 messages."""
    schedules = [partial_allreduce(n, r, 5) for r in range(n)]
    joiners = {0, n - 1}
    activations: list[int] = []

    def on_fire(rank: int, index: int, op: object) -> None:
        if isinstance(op, Send) and index < activation_op_count(schedules[rank]):
            activations.append(rank)

    done = walk(schedules, on_fire, triggered=lambda rank, i: i == JOIN and rank in joiners)
    assert not activations
    for rank, flags in enumerate(done):
        start = activation_op_count(schedules[rank]) - 1
        assert flags[start] == (rank in joiners)
        assert not all(flags[start:]), f"rank {rank} finished a round nobody initiated"
    initiator = 2
    done = walk(schedules, on_fire, triggered=lambda rank, i: (i == JOIN and rank in joiners)
                or (i == INTERNAL_ACTIVATION and rank == initiator))
    assert all(all(flags[activation_op_count(schedules[rank]) - 1:]) for rank, flags in enumerate(done))
    assert len(activations) == n - 1


@pytest.mark.parametrize("n", [4, 8, 6])
def test_activation_is_a_binomial_tree_from_the_initiator(n: int) -> None:
    """With one initiator every other rank receives exactly one activation message (a tree,
    not a flood): N-1 activation messages in all."""
    schedules = [partial_allreduce(n, r, 5) for r in range(n)]
    fired: list[tuple[int, int]] = []

    def on_fire(rank: int, index: int, op: object) -> None:
        if isinstance(op, Send) and index < activation_op_count(schedules[rank]):
            fired.append((rank, op.peer))

    walk(schedules, on_fire, triggered=lambda rank, _i: rank == 1)
    assert len(fired) == n - 1
    assert sorted(dst for _, dst in fired) == sorted(set(range(n)) - {1})


def test_activation_sends_are_any_of_and_reduction_waits_for_activation() -> None:
    sched = partial_allreduce(8, 5, 16)
    first = activation_op_count(sched)
    activation_sends = [op for op in sched.ops[:first] if isinstance(op, Send)]
    assert len(activation_sends) == 3 and all(op.mode is DepMode.ANY for op in activation_sends)
    assert all(op.src.length == 0 for op in activation_sends)
    start = sched.ops[first - 1]
    assert start.mode is DepMode.ANY and INTERNAL_ACTIVATION in start.deps
    assert all(op.deps for op in sched.ops[first:]), "a reduction op could start before activation"


def test_members_map_virtual_ranks_to_survivors() -> None:
    sched = partial_allreduce(8, 5, 10, members=(1, 3, 5, 7))
    peers = {op.peer for op in sched.ops if isinstance(op, (Send, Recv))}
    assert peers == {1, 3, 7} and sched.rank == 5 and sched.world_size == 8
    with pytest.raises(ValueError, match="not among"):
        partial_allreduce(8, 2, 10, members=(1, 3))


# --- the runtime -----------------------------------------------------------------------------


def _threads(n: int, fn, timeout: float = 30.0) -> list:
    return mlfabric.run_threads(n, fn, timeout=timeout)


@pytest.mark.parametrize("quorum", ["solo", "majority", "all"])
def test_result_is_the_sum_of_what_active_reports_and_same_everywhere(quorum: str) -> None:
    """Each rank hands in a distinct power of two per round, so the result tells exactly
    which fresh and stale contributions it holds; it must match ``active`` and be identical
    on every rank that got that round."""
    n, rounds = 4, 6

    def body(comm: Communicator) -> list[tuple[int, bool, int, int]]:
        # Every rank stops at the same round, not after the same number of calls: with
        # majority, a rank that stopped early could be the initiator another rank waits for
        # (regression: this test hung for 30 s now and then on a loaded machine). A call
        # returns a later round than the previous one, so there are at most ``rounds`` calls.
        out: list[tuple[int, bool, int, int]] = []
        step = 0
        while not out or out[-1][0] < rounds - 1:
            time.sleep(0.01 * ((comm.rank * 3 + step) % n))
            value = 1 << (comm.rank * rounds + step)
            res = comm.partial_allreduce(torch.tensor([value, 1], dtype=torch.int64), quorum=quorum)
            out.append((res.round, res.contributed, res.active, int(res.tensor[0])))
            step += 1
        assert step <= rounds
        return out

    results = _threads(n, body)
    by_round: dict[int, set[tuple[int, int]]] = {}
    for rank, calls in enumerate(results):
        for round_, contributed, active, total in calls:
            by_round.setdefault(round_, set()).add((active, total))
            if contributed:
                # this rank's bit for the step that call made is in the total
                step = [c[0] for c in calls].index(round_)
                assert total >> (rank * rounds + step) & 1
    for round_, seen in by_round.items():
        assert len(seen) == 1, f"round {round_} differs between ranks: {seen}"
        fresh_ranks = {rank for rank, calls in enumerate(results) for r, contributed, _, _ in calls
                       if r == round_ and contributed}
        assert next(iter(seen))[0] == len(fresh_ranks), f"round {round_}: active vs contributors"
    # Conservation: the last round everyone saw... every bit handed in appears in exactly one
    # round's total, or is still waiting in a send buffer.
    totals = {r: next(iter(s))[1] for r, s in by_round.items()}
    combined = 0
    for total in totals.values():
        assert combined & total == 0, "a contribution was counted twice"
        combined |= total
    if quorum == "all":
        assert all(active == n for calls in results for _, _, active, _ in calls)
        assert combined == (1 << (n * rounds)) - 1


def test_conservation_with_integer_gradients() -> None:
    """Sum of everything handed in = sum of every executed round's result + what is still in
    the send buffers, exactly (integers)."""
    n, steps = 4, 12
    fabric = LocalFabric(n)
    comms = [Communicator(t, timeout=30) for t in fabric.transports()]
    produced = torch.zeros(3, dtype=torch.int64)
    lock = threading.Lock()
    results: dict[int, torch.Tensor] = {}

    def body(rank: int) -> None:
        rng = np.random.default_rng(rank)
        for _ in range(steps):
            time.sleep(float(rng.uniform(0, 0.02)) * (1 + 3 * (rank == 0)))
            grad = torch.tensor(rng.integers(-50, 50, size=3), dtype=torch.int64)
            with lock:
                produced.add_(grad)
            res = comms[rank].partial_allreduce(grad, quorum="solo")
            with lock:
                results.setdefault(res.round, res.tensor.clone())
                assert torch.equal(results[res.round], res.tensor)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)  # let the progress threads finish any round a peer started last
    handles = [next(iter(c._partials.values())) for c in comms]
    executed = handles[0].latest[0] + 1
    assert all(h.latest[0] + 1 == executed for h in handles)
    # A round only starts when a rank calls it, and that call returns it: none is missing.
    assert set(results) == set(range(executed))
    applied = sum(results.values())
    waiting = sum(h.send_buffer for h in handles)
    assert torch.equal(produced, applied + waiting), (produced, applied, waiting)
    for c in comms:
        c.close()


def test_several_simultaneous_initiators_execute_the_round_once() -> None:
    n = 8
    barrier = threading.Barrier(n)

    def body(comm: Communicator) -> tuple[int, int, int]:
        barrier.wait()
        res = comm.partial_allreduce(torch.ones(4, dtype=torch.int64), quorum="solo")
        time.sleep(0.1)
        handle = next(iter(comm._partials.values()))
        # The next round is armed lazily (PartialAllreduce._rearm): count it as armed.
        return res.round, int(res.tensor[0]), handle.round + (handle._rearm_after is not None)

    for round_, total, armed in _threads(n, body):
        # everyone initiated round 0 at once: one execution, never a second one
        assert round_ == 0 and armed == 1
        assert 1 <= total <= n


def test_activations_a_finished_round_still_awaits_are_dropped_and_then_forgotten() -> None:
    """A finished round leaves activation receives open (its rank was activated through
    another tree). Their messages, if they ever come, are dropped by the mailbox on arrival
    (no progress-loop polling for them, which cost the partial microbenchmark a third of its
    CPU), so nothing stays queued; and the mailbox stops waiting for them after
    _KEEP_DRAINING rounds, so what it keeps stays bounded however long the run."""
    n, rounds = 8, 3 * _KEEP_DRAINING
    barrier = threading.Barrier(n)

    def body(comm: Communicator) -> tuple[int, int, int]:
        for _ in range(rounds):
            barrier.wait()
            if comm.rank not in (0, n - 1):
                time.sleep(0.01)  # the round runs without this rank's call
            comm.partial_allreduce(torch.ones(4, dtype=torch.int64), quorum="solo")
        barrier.wait()
        time.sleep(0.3)  # the last activations land
        mailbox = comm.transport.mailbox
        handle = next(iter(comm._partials.values()))
        return handle.round + (handle._rearm_after is not None), mailbox.pending(), len(mailbox._discarded)

    bits = n.bit_length() - 1
    for armed, pending, waiting_to_drop in _threads(n, body, timeout=60):
        assert armed == rounds
        assert pending == 0
        assert waiting_to_drop <= _KEEP_DRAINING * bits


def test_a_rank_several_rounds_behind_gets_the_latest_result() -> None:
    n = 3
    gate = threading.Event()

    def body(comm: Communicator) -> list[tuple[int, bool, int]]:
        out = []
        # Round 0 with everyone: a rank takes part in rounds from its first call on.
        comm.partial_allreduce(torch.tensor([0]), quorum="solo")
        if comm.rank == 2:
            gate.wait(10)
            time.sleep(0.1)
            res = comm.partial_allreduce(torch.tensor([100]), quorum="solo")  # asks for round 1
            out.append((res.round, res.contributed, int(res.tensor[0])))
            res = comm.partial_allreduce(torch.tensor([1000]), quorum="solo")
            out.append((res.round, res.contributed, int(res.tensor[0])))
            return out
        for step in range(1, 5):
            res = comm.partial_allreduce(torch.tensor([1]), quorum="solo", round=step)
            out.append((res.round, res.contributed, int(res.tensor[0])))
            time.sleep(0.01)
        if comm.rank == 0:
            gate.set()
        res = comm.partial_allreduce(torch.tensor([1]), quorum="solo", round=5)
        out.append((res.round, res.contributed, int(res.tensor[0])))
        return out

    results = _threads(n, body)
    late = results[2]
    latest_before = max(r for r, _, _ in results[0][:4])
    # first call: round 0 is long gone -> the latest result, not contributed
    assert late[0][0] >= latest_before and late[0][1] is False
    # its 100 was kept, and goes in with the next call's 1000
    assert late[1][1] is True and late[1][2] >= 1100


def test_a_kept_result_is_not_overwritten_by_later_rounds() -> None:
    """Regression: rounds re-arm one execution and reuse its buffer, so every result handed
    to a caller must be its own copy."""
    def body(comm: Communicator) -> list[torch.Tensor]:
        kept = []
        for step in range(1, 6):
            res = comm.partial_allreduce(torch.full((4,), step), quorum="all")
            kept.append(res.tensor)
        return kept

    for kept in _threads(2, body):
        assert [t.tolist() for t in kept] == [[2 * step] * 4 for step in range(1, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_every_dtype_reduces_and_keeps_its_type(dtype: torch.dtype) -> None:
    """The progress thread works on numpy views where numpy has the dtype and on tensors
    where it has not (bfloat16): both give the caller a tensor of its dtype with the sum,
    and a tensor that requires grad or is not contiguous is read, not modified."""
    def body(comm: Communicator) -> list[torch.Tensor]:
        out = []
        base = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
        for step in range(1, 4):
            grad = (base + step + comm.rank).to(dtype)
            if dtype.is_floating_point:
                grad.requires_grad_(True)
            out.append(comm.partial_allreduce(grad, quorum="all").tensor)
        return out

    results = _threads(2, body)
    for step, (a, b) in enumerate(zip(*results), start=1):
        expected = (2 * (torch.arange(6, dtype=torch.float32).reshape(2, 3).t().reshape(-1) + step) + 1).to(dtype)
        assert a.dtype == dtype and not a.requires_grad
        assert torch.equal(a, expected) and torch.equal(b, expected)


def test_majority_callers_join_before_the_initiator_and_wait_for_it() -> None:
    """A majority rank that calls before the round's initiator starts its part of the
    reduction at once (its fresh data is taken then), yet its call returns only after the
    initiator's; the round counts exactly the callers and the initiator as active."""
    n, seed = 4, 11

    def call(rank: int, value: int) -> torch.futures.Future:
        return comms[rank].partial_allreduce_async(torch.full((1,), value, dtype=torch.int64),
                                                   quorum="majority", seed=seed)

    comms = mlfabric.local_world(n)
    try:
        for future in [call(r, 0) for r in range(n)]:  # round 0: every rank registers
            assert future.wait().round == 0
        handles = [next(iter(comm._partials.values())) for comm in comms]
        initiator = handles[0]._initiator(1)
        early = (initiator + 1) % n
        futures = {early: call(early, 10)}
        time.sleep(0.2)
        assert not futures[early].done(), "a round completed without its initiator"

        def started_round_1(handle) -> bool:  # round 1 armed (arming is lazy) and its reduction begun
            return handle._rearm_after is None and handle.round == 1 and handle.execution.activated

        assert started_round_1(handles[early]), "the caller waited for the activation instead of joining"
        assert not started_round_1(handles[(initiator + 2) % n])  # nobody activated the others
        futures[initiator] = call(initiator, 100)
        for res in (f.wait() for f in futures.values()):
            assert res.round == 1 and int(res.tensor[0]) == 110 and res.active == 2
    finally:
        for comm in comms:
            comm.close()


def test_majority_initiators_agree_across_ranks_and_draw_blocks() -> None:
    """Every rank draws the same initiator for every round (also across the blocks in which
    draws are made), and the draws spread over the ranks."""
    comms = mlfabric.local_world(4)
    try:
        handles = []
        for comm in comms:
            comm.partial_allreduce_async(torch.zeros(2), quorum="majority", seed=5)
            handles.append(next(iter(comm._partials.values())))
        rounds = range(250, 600)  # crosses the draws' block boundaries at 256 and 512
        draws = [[h._initiator(r) for r in rounds] for h in handles]
        assert draws[1] == draws[0] and draws[2] == draws[0] and draws[3] == draws[0]
        counts = np.bincount(draws[0], minlength=4)
        assert counts.min() > len(rounds) / 8, counts  # uniform would be ~88 per rank
        assert handles[0]._initiator(300) == draws[0][50]  # direct, not order-dependent
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("quorum", ["solo", "majority"])
def test_lost_rank_does_not_block_the_others(quorum: str) -> None:
    n = 4
    fabric = LocalFabric(n)
    comms = [Communicator(t, timeout=20) for t in fabric.transports()]
    results: list[list] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            for step in range(8):
                if rank == 3 and step == 2:
                    fabric.kill(3)
                    return
                time.sleep(0.01)
                res = comms[rank].partial_allreduce(torch.ones(2, dtype=torch.int64), quorum=quorum)
                results[rank].append(res)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for rank in range(3):
        assert len(results[rank]) == 8, f"rank {rank} stopped after {len(results[rank])} rounds"
        final = results[rank][-1]
        assert final.lost == frozenset({3})
        assert int(final.tensor[0]) <= 2 * 3  # only the three survivors (plus stale) remain
    for c in comms[:3]:
        c.close()


def test_reformation_activates_a_round_an_initiator_was_already_waiting_in() -> None:
    """Regression (majority, zmq, ~1 run in 4 timed out): a survivor whose application is
    blocked in a call answered by the execution in flight (it arrived after the activation)
    is the initiator of the round the group resumes at. That call must count as fresh there,
    so the survivor activates the resumed round; before the fix nobody did and every
    survivor timed out waiting for it."""
    seed = 3  # majority's initiators: round 0 -> rank 2 (the last caller), round 1 -> rank 0 in
    # epoch 0 and rank 1 in epoch 1 (checked)
    fabric = LocalFabric(3)
    comms = [Communicator(t, timeout=10) for t in fabric.transports()]
    part = lambda rank, value: comms[rank].partial_allreduce_async(  # noqa: E731
        torch.full((3,), value, dtype=torch.int64), quorum="majority", seed=seed)
    try:
        first = [part(rank, 1) for rank in range(3)]  # round 0: everyone, rank 2 initiates
        assert [int(f.wait().tensor[0]) for f in first] == [3, 3, 3]
        handle = comms[0]._partials[("majority", 3, torch.int64, "ring", seed)]
        assert handle._initiator(0) == 2 and handle._initiator(1) == 0
        comms[2].transport._deliver = lambda message: None  # rank 2 hangs: round 1 cannot finish
        fresh = part(0, 10)                                 # the initiator starts round 1
        other = comms[1]._partials[("majority", 3, torch.int64, "ring", seed)]
        deadline = time.monotonic() + 5
        # (A call returns before its progress thread arms the next round: wait for round 1.)
        while not (other.round == 1 and other.execution is not None and other.execution.activated) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.execution.activated and other.round == 1
        late = part(1, 100)  # arrives after the activation: waits on the stuck execution
        time.sleep(0.1)
        assert not late.done() and not fresh.done()
        fabric.kill(2)
        a, b = fresh.wait(), late.wait()
        assert handle._initiator(1) == 1 and handle.members == (0, 1)  # the new epoch's draw
        assert a.round == b.round == 1 and a.lost == b.lost == frozenset({2})
        assert a.contributed and b.contributed and a.active == b.active == 2
        assert torch.equal(a.tensor, b.tensor) and int(a.tensor[0]) == 110
    finally:
        for comm in comms[:2]:
            comm.close()


def test_bad_arguments_give_clear_errors() -> None:
    comms = mlfabric.local_world(2)
    try:
        with pytest.raises(ValueError, match="unknown quorum"):
            comms[0].partial_allreduce(torch.ones(3), quorum="most")
        with pytest.raises(ValueError, match="op"):
            comms[0].partial_allreduce(torch.ones(3), op="max")
        with pytest.raises(ValueError, match="call rounds in order"):
            comms[0].partial_allreduce(torch.ones(3), round=5)
    finally:
        for comm in comms:
            comm.close()


def test_mismatched_sizes_fail_on_every_rank() -> None:
    def body(comm: Communicator) -> str:
        with pytest.raises(mlfabric.CollectiveError) as info:
            comm.partial_allreduce(torch.ones(5 if comm.rank == 0 else 6), quorum="all", timeout=10)
        return str(info.value)

    for message in _threads(2, body):
        assert "mismatch" in message or "aborted" in message


def test_avg_divides_by_live_ranks() -> None:
    def body(comm: Communicator) -> torch.Tensor:
        return comm.partial_allreduce(torch.full((3,), 4.0), quorum="all", op="avg").tensor

    for out in _threads(4, body):
        torch.testing.assert_close(out, torch.full((3,), 4.0))


@pytest.mark.parametrize("leave", ["close", "crash"])
def test_a_departure_is_logged_as_info_and_a_crash_as_a_warning(leave: str, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: ranks that finish a job at different times closed their communicators and
    every survivor warned "partial allreduce continues without rank(s) ..." (once per
    partial collective), as if they had crashed."""
    fabric = LocalFabric(3)
    comms = [Communicator(t, timeout=10) for t in fabric.transports()]
    try:
        first = [comms[rank].partial_allreduce_async(torch.ones(2, dtype=torch.int64), quorum="solo") for rank in range(3)]
        for future in first:
            future.wait()
        with caplog.at_level(logging.INFO, logger="mlfabric.runtime.partial"):
            if leave == "close":
                comms[2].close()
            else:
                fabric.kill(2)
            results = [comms[rank].partial_allreduce(torch.ones(2, dtype=torch.int64), quorum="solo") for rank in (0, 1)]
        assert all(res.lost == frozenset({2}) for res in results)
        records = [r for r in caplog.records if "continues without rank(s) [2]" in r.getMessage()]
        assert records, caplog.text
        expected = logging.INFO if leave == "close" else logging.WARNING
        assert {r.levelno for r in records} == {expected}, caplog.text
        assert ("closed their communicators" if leave == "close" else "lost: [2]") in records[0].getMessage()
    finally:
        for comm in comms[:2]:
            comm.close()
