"""Collective builders: numbers (reference interpreter vs numpy) and structure (who sends
what to whom, stated cost vs the ops).

    python -m pytest tests/unit/test_collectives.py -q
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.collectives.halving_doubling import halving_doubling_allreduce
from mlfabric.collectives.partition import piece_offsets, piece_sizes, pieces, subdivide
from mlfabric.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from mlfabric.collectives.tree import binomial_broadcast, binomial_reduce, tree_allreduce
from mlfabric.schedule import Recv, Schedule, Send, Slice, validate
from mlfabric.schedule.interpret import interpret

WORLD_SIZES = range(1, 17)
COUNTS = (0, 1, 7, 1000)
OPS = ("sum", "max", "min")
_NP = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def _inputs(n: int, count: int, seed: int, low: int = -1000, high: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, size=count, dtype=np.int64) for _ in range(n)]


def _reduced(data: list[np.ndarray], op: str) -> np.ndarray:
    return _NP[op](np.stack(data), axis=0)


def _run(schedules: list[Schedule], data: list[np.ndarray]) -> list[np.ndarray]:
    validate(schedules)
    return interpret(schedules, data)


def _ceil_log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


# --- numbers: interpreter result equals a local reference ------------------------------------

ALLREDUCES: dict[str, Callable[..., Schedule]] = {
    "ring": lambda n, r, c, op, chunks: ring_allreduce(n, r, c, op=op, chunks=chunks),
    "halving_doubling": lambda n, r, c, op, chunks: halving_doubling_allreduce(n, r, c, op=op),
    "tree": lambda n, r, c, op, chunks: tree_allreduce(n, r, c, op=op, chunks=chunks),
}


@pytest.mark.parametrize("chunks", [None, 3])
@pytest.mark.parametrize("algo", sorted(ALLREDUCES))
def test_allreduce_matches_reference(algo: str, chunks: int | None) -> None:
    build = ALLREDUCES[algo]
    for n in WORLD_SIZES:
        for count in COUNTS:
            for op in OPS:
                data = _inputs(n, count, seed=n * 1000 + count)
                out = _run([build(n, r, count, op, chunks) for r in range(n)], data)
                expected = _reduced(data, op)
                for r in range(n):
                    np.testing.assert_array_equal(out[r], expected, err_msg=f"{algo} N={n} "
                                                  f"count={count} op={op} rank {r}")


@pytest.mark.parametrize("algo", sorted(ALLREDUCES))
def test_allreduce_prod(algo: str) -> None:
    for n in (1, 3, 8, 11):
        data = _inputs(n, 50, seed=n, low=-2, high=3)
        out = _run([ALLREDUCES[algo](n, r, 50, "prod", None) for r in range(n)], data)
        for r in range(n):
            np.testing.assert_array_equal(out[r], _reduced(data, "prod"))


def test_allreduce_does_not_touch_inputs_and_handles_floats() -> None:
    data = [np.linspace(0, 1, 33) * (r + 1) for r in range(5)]
    before = [d.copy() for d in data]
    for algo, build in ALLREDUCES.items():
        out = _run([build(5, r, 33, "sum", None) for r in range(5)], data)
        for r in range(5):
            np.testing.assert_allclose(out[r], sum(before), err_msg=algo)
    for d, b in zip(data, before):
        np.testing.assert_array_equal(d, b)


@pytest.mark.parametrize("chunks", [None, 2])
def test_ring_reduce_scatter_matches_reference(chunks: int | None) -> None:
    for n in WORLD_SIZES:
        for count in COUNTS:
            for op in OPS:
                data = _inputs(n, count, seed=n + count)
                out = _run([ring_reduce_scatter(n, r, count, op=op, chunks=chunks)
                            for r in range(n)], data)
                expected = _reduced(data, op)
                for r, seg in enumerate(pieces(count, n)):
                    np.testing.assert_array_equal(out[r][seg.offset:seg.end],
                                                  expected[seg.offset:seg.end])


@pytest.mark.parametrize("chunks", [None, 2])
def test_ring_allgather_matches_reference(chunks: int | None) -> None:
    for n in WORLD_SIZES:
        for count in COUNTS:
            data = _inputs(n, count, seed=n + count)
            expected = np.concatenate([data[r][s.offset:s.end]
                                       for r, s in enumerate(pieces(count, n))])
            out = _run([ring_allgather(n, r, count, chunks=chunks) for r in range(n)], data)
            for r in range(n):
                np.testing.assert_array_equal(out[r], expected)


@pytest.mark.parametrize("chunks", [None, 3])
def test_broadcast_matches_reference(chunks: int | None) -> None:
    for n in WORLD_SIZES:
        for count in COUNTS:
            data = _inputs(n, count, seed=n * 7 + count)
            for root in sorted({0, n // 2, n - 1}):
                out = _run([binomial_broadcast(n, r, count, root=root, chunks=chunks)
                            for r in range(n)], data)
                for r in range(n):
                    np.testing.assert_array_equal(out[r], data[root])


@pytest.mark.parametrize("chunks", [None, 3])
def test_reduce_matches_reference(chunks: int | None) -> None:
    for n in WORLD_SIZES:
        for count in COUNTS:
            data = _inputs(n, count, seed=n * 13 + count)
            for root in sorted({0, 1 % n, n - 1}):
                for op in OPS:
                    out = _run([binomial_reduce(n, r, count, root=root, op=op, chunks=chunks)
                                for r in range(n)], data)
                    np.testing.assert_array_equal(out[root], _reduced(data, op))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 24), count=st.integers(0, 300), chunks=st.integers(1, 6),
       op=st.sampled_from(OPS), algo=st.sampled_from(sorted(ALLREDUCES)),
       seed=st.integers(0, 2**16))
def test_allreduce_property(n: int, count: int, chunks: int, op: str, algo: str,
                            seed: int) -> None:
    data = _inputs(n, count, seed)
    schedules = [ALLREDUCES[algo](n, r, count, op, chunks) for r in range(n)]
    out = _run(schedules, data)
    expected = _reduced(data, op)
    for r in range(n):
        np.testing.assert_array_equal(out[r], expected)
        assert schedules[r].cost.elements_sent.get("0", 0) == \
            schedules[r].elements_sent_by_channel().get("0", 0)


def test_builders_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank 4 outside world of 4"):
        halving_doubling_allreduce(4, 4, 10)
    with pytest.raises(ValueError, match="rank -1 outside"):
        tree_allreduce(4, -1, 10)
    with pytest.raises(ValueError, match="root 4 outside world of 4"):
        binomial_broadcast(4, 0, 10, root=4)
    with pytest.raises(ValueError, match="negative count"):
        binomial_reduce(4, 0, -1)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        halving_doubling_allreduce(4, 0, 10, op="avg")


# --- stated cost equals what the ops send ----------------------------------------------------

COSTED: dict[str, Callable[[int, int, int, str], Schedule]] = {
    "ring_allreduce": lambda n, r, c, ch: ring_allreduce(n, r, c, channel=ch),
    "ring_allreduce_chunked": lambda n, r, c, ch: ring_allreduce(n, r, c, chunks=5, channel=ch),
    "ring_reduce_scatter": lambda n, r, c, ch: ring_reduce_scatter(n, r, c, channel=ch),
    "ring_allgather": lambda n, r, c, ch: ring_allgather(n, r, c, chunks=2, channel=ch),
    "halving_doubling": lambda n, r, c, ch: halving_doubling_allreduce(n, r, c, channel=ch),
    "tree_allreduce": lambda n, r, c, ch: tree_allreduce(n, r, c, chunks=3, channel=ch),
    "broadcast": lambda n, r, c, ch: binomial_broadcast(n, r, c, root=n // 3, channel=ch),
    "reduce": lambda n, r, c, ch: binomial_reduce(n, r, c, root=n - 1, chunks=2, channel=ch),
}


@pytest.mark.parametrize("name", sorted(COSTED))
def test_stated_cost_equals_ops(name: str) -> None:
    for n in WORLD_SIZES:
        for count in (*COUNTS, 13, 1001, 4096):
            for r in range(n):
                sched = COSTED[name](n, r, count, "nic1")
                actual = sched.elements_sent_by_channel()
                stated = {ch: v for ch, v in sched.cost.elements_sent.items() if v}
                assert stated == {ch: v for ch, v in actual.items() if v}, (
                    f"{name} N={n} count={count} rank {r}: stated {sched.cost} vs ops {actual}")
                assert sched.channels() <= {"nic1"}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_stated_steps(n: int) -> None:
    p2 = 1 << (n.bit_length() - 1)
    hd_steps = 2 * int(math.log2(p2)) + (2 if n != p2 else 0)
    for r in range(n):
        assert ring_allreduce(n, r, 100).cost.steps == 2 * (n - 1)
        assert ring_reduce_scatter(n, r, 100).cost.steps == n - 1
        assert halving_doubling_allreduce(n, r, 100).cost.steps == hd_steps
        assert tree_allreduce(n, r, 100).cost.steps == 2 * _ceil_log2(n)
        assert binomial_broadcast(n, r, 100, root=n - 1).cost.steps == _ceil_log2(n)
        assert binomial_reduce(n, r, 100).cost.steps == _ceil_log2(n)


# --- structure: ring ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_ring_talks_only_to_neighbours(n: int) -> None:
    for build in (ring_allreduce, ring_reduce_scatter, ring_allgather):
        for r in range(n):
            sched = build(n, r, 100, chunks=2)
            assert {op.peer for op in sched.sends()} == {(r + 1) % n}
            assert {op.peer for op in sched.recvs()} == {(r - 1) % n}


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("count", [1000, 1001, 12345])
def test_ring_total_traffic(n: int, count: int) -> None:
    sent = [sum(ring_allreduce(n, r, count).elements_sent_by_channel().values()) for r in range(n)]
    assert sum(sent) == 2 * (n - 1) * count
    for s in sent:
        assert abs(s - 2 * (n - 1) / n * count) <= 2


def test_ring_allreduce_step_structure() -> None:
    # N = 4, 1 chunk: rank 0 sends segments 0, 3, 2 while reducing (reduce-scatter), ending
    # with segment 1; then forwards 1, 0, 3 (allgather).
    sched = ring_allreduce(4, 0, 100)
    segs = pieces(100, 4)
    assert [op.src for op in sched.sends()] == [segs[i] for i in (0, 3, 2, 1, 0, 3)]
    assert [op.dst for op in sched.recvs()] == [segs[i] for i in (3, 2, 1, 0, 3, 2)]
    assert [op.reduce for op in sched.recvs()] == ["sum"] * 3 + [None] * 3


# --- structure: halving-doubling ---------------------------------------------------------------


def test_halving_doubling_power_of_two_peers_and_sizes() -> None:
    sched = halving_doubling_allreduce(8, 0, 1000)
    assert [op.peer for op in sched.sends()] == [4, 2, 1, 1, 2, 4]
    assert [op.peer for op in sched.recvs()] == [4, 2, 1, 1, 2, 4]
    assert [op.src.length for op in sched.sends()] == [500, 250, 125, 125, 250, 500]
    assert [op.reduce for op in sched.recvs()] == ["sum"] * 3 + [None] * 3
    # rank 0 keeps the low half each time and ends owning piece 0 = [0, 125).
    assert [op.src for op in sched.sends()][:3] == [
        Slice("data", 500, 500), Slice("data", 250, 250), Slice("data", 125, 125)]
    assert [op.dst for op in sched.recvs()][:3] == [
        Slice("data", 0, 500), Slice("data", 0, 250), Slice("data", 0, 125)]
    # rank 5 = 0b101 keeps high, low, high halves and owns piece 5.
    r5 = halving_doubling_allreduce(8, 5, 1000)
    assert [op.peer for op in r5.sends()] == [1, 7, 4, 4, 7, 1]
    assert [op.dst for op in r5.recvs()][2] == Slice("data", 625, 125)
    assert [op.src for op in r5.sends()][3:] == [
        Slice("data", 625, 125), Slice("data", 500, 250), Slice("data", 500, 500)]


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_halving_doubling_power_of_two_is_balanced(n: int) -> None:
    count = 16 * 25
    for r in range(n):
        sched = halving_doubling_allreduce(n, r, count)
        assert sched.cost.elements_sent["0"] == 2 * (n - 1) * count // n
        assert len(list(sched.sends())) == 2 * int(math.log2(n))


def test_halving_doubling_non_power_of_two_folds_first_ranks() -> None:
    # N = 6: p = 4, r = 2. Ranks 0, 2 fold into 1, 3; the core is ranks 1, 3, 4, 5
    # (virtual 0, 1, 2, 3).
    count = 100
    r0 = halving_doubling_allreduce(6, 0, count)
    assert [(type(op).__name__, op.peer, op.src.length if isinstance(op, Send) else op.dst.length)
            for op in r0.ops] == [("Send", 1, count), ("Recv", 1, count)]
    assert r0.ops[1].reduce is None and r0.ops[1].deps == (0,)
    r1 = halving_doubling_allreduce(6, 1, count)
    first, last = r1.ops[0], r1.ops[-1]
    assert isinstance(first, Recv) and first.peer == 0 and first.reduce == "sum"
    assert first.dst == Slice("data", 0, count)
    assert isinstance(last, Send) and last.peer == 0 and last.src == Slice("data", 0, count)
    assert [op.peer for op in r1.sends()] == [4, 3, 3, 4, 0]
    assert [op.peer for op in halving_doubling_allreduce(6, 5, count).sends()] == [3, 4, 4, 3]
    sent = [halving_doubling_allreduce(6, r, count).cost.elements_sent["0"] for r in range(6)]
    core = 2 * 3 * count // 4
    assert sent == [count, core + count, count, core + count, core, core]


@pytest.mark.parametrize("n", [3, 5, 6, 7, 9, 12, 15])
def test_halving_doubling_peers_stay_in_world(n: int) -> None:
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    for r in range(n):
        sched = halving_doubling_allreduce(n, r, 64)
        peers = {op.peer for op in sched.ops if isinstance(op, (Send, Recv))}
        if r < 2 * extra and r % 2 == 0:
            assert peers == {r + 1}
        else:
            # The core never talks to a folded-away (even, < 2r) rank, except its own pair.
            outsiders = {q for q in peers if q < 2 * extra and q % 2 == 0}
            assert outsiders == ({r - 1} if r < 2 * extra else set())
            assert len(peers - outsiders) == int(math.log2(p2))


def test_halving_doubling_small_count_pieces_differ_by_at_most_one() -> None:
    # count < p: some ranks own empty pieces, messages may be empty, results still exact.
    for count in (1, 3, 5, 7):
        data = _inputs(16, count, seed=count)
        out = _run([halving_doubling_allreduce(16, r, count) for r in range(16)], data)
        assert all((o == _reduced(data, "sum")).all() for o in out)
        # the piece each rank ends the halving with: the partition's piece r
        owned = [[op.dst for op in halving_doubling_allreduce(16, r, count).recvs()][3]
                 for r in range(16)]
        assert owned == pieces(count, 16)
        sizes = [sl.length for sl in owned]
        assert max(sizes) - min(sizes) <= 1


# --- structure: trees --------------------------------------------------------------------------


def _parent(v: int) -> int:
    return v - (v & -v)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("chunks", [1, 3])
def test_broadcast_root_sends_ceil_log2_messages_per_chunk(n: int, chunks: int) -> None:
    for root in range(n):
        scheds = [binomial_broadcast(n, r, 90, root=root, chunks=chunks) for r in range(n)]
        root_sends = list(scheds[root].sends())
        assert len(root_sends) == _ceil_log2(n) * chunks
        assert not list(scheds[root].recvs())
        # largest subtree first: relative children 2^(L-1), ..., 2, 1
        L = _ceil_log2(n)
        expected = [(root + (1 << k)) % n for k in reversed(range(L)) if (1 << k) < n]
        assert [op.peer for op in root_sends][::chunks] == expected
        for r in range(n):
            if r == root:
                continue
            v = (r - root) % n
            recvs = list(scheds[r].recvs())
            assert len(recvs) == chunks
            assert {op.peer for op in recvs} == {(_parent(v) + root) % n}
        assert sum(len(list(s.sends())) for s in scheds) == (n - 1) * chunks


def test_broadcast_n8_structure() -> None:
    peers = {r: [op.peer for op in binomial_broadcast(8, r, 10).sends()] for r in range(8)}
    assert peers == {0: [4, 2, 1], 1: [], 2: [3], 3: [], 4: [6, 5], 5: [], 6: [7], 7: []}
    # relabelled around root 3
    peers = {r: [op.peer for op in binomial_broadcast(8, r, 10, root=3).sends()] for r in range(8)}
    assert peers[3] == [7, 5, 4] and peers[7] == [1, 0] and peers[5] == [6]


@pytest.mark.parametrize("n", [2, 3, 6, 8, 13])
def test_reduce_each_rank_sends_once_per_chunk_to_parent(n: int) -> None:
    chunks = 2
    for root in sorted({0, n - 1}):
        for r in range(n):
            sched = binomial_reduce(n, r, 40, root=root, chunks=chunks)
            v = (r - root) % n
            sends = list(sched.sends())
            if v == 0:
                assert not sends
            else:
                assert len(sends) == chunks
                assert {op.peer for op in sends} == {(_parent(v) + root) % n}
            assert all(op.reduce == "sum" for op in sched.recvs())
    # root 0 of 8 drains its children smallest subtree first
    assert [op.peer for op in binomial_reduce(8, 0, 10).recvs()] == [1, 2, 4]


def test_tree_allreduce_phases() -> None:
    sched = tree_allreduce(8, 4, 30, op="max", chunks=1)
    kinds = [(type(op).__name__, op.peer, getattr(op, "reduce", None)) for op in sched.ops]
    # reduce: receive-reduce from 5 then 6, send to 0; broadcast: receive from 0, send to 6, 5
    assert kinds == [("Recv", 5, "max"), ("Recv", 6, "max"), ("Send", 0, None),
                     ("Recv", 0, None), ("Send", 6, None), ("Send", 5, None)]
    # the broadcast receive overwrites what the reduce send read: it waits for it
    assert 2 in sched.ops[3].deps


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16])
def test_tree_allreduce_sent_by_children(n: int) -> None:
    count = 50
    for r in range(n):
        kids = sum(1 for k in range(8) if (1 << k) < (r & -r if r else 1 << 8) and r + (1 << k) < n)
        assert tree_allreduce(n, r, count).cost.elements_sent.get("0", 0) == \
            (kids + (r != 0)) * count
    if n > 1:
        assert tree_allreduce(n, 0, count).cost.elements_sent["0"] == _ceil_log2(n) * count


# --- pipelining: chunk c depends only on chunk c ----------------------------------------------


def _slice_of(op) -> Slice:
    return op.src if isinstance(op, Send) else op.dst


@pytest.mark.parametrize("n, build", [
    (11, lambda r: tree_allreduce(11, r, 100, chunks=4)),
    (11, lambda r: binomial_broadcast(11, r, 100, root=3, chunks=4)),
    (11, lambda r: binomial_reduce(11, r, 100, root=5, chunks=4)),
    (5, lambda r: ring_allreduce(5, r, 100, chunks=4)),
], ids=["tree_allreduce", "broadcast", "reduce", "ring_allreduce"])
def test_pipelined_chunks_depend_only_on_same_chunk(n: int, build) -> None:
    for r in range(n):
        sched = build(r)
        assert len(list(sched.sends())) >= 4 or r != 0
        for op in sched.ops:
            for d in op.deps:
                assert _slice_of(sched.ops[d]) == _slice_of(op), (sched.name, op, sched.ops[d])


def test_tree_chunks_follow_partition() -> None:
    sched = binomial_broadcast(4, 0, 10, chunks=3)
    expected = subdivide(Slice("data", 0, 10), 3)
    assert [op.src for op in sched.sends()] == [expected[c] for _ in range(2) for c in range(3)]
    assert piece_sizes(10, 3) == [4, 3, 3] and piece_offsets(10, 3) == [0, 4, 7]


def test_builders_are_deterministic() -> None:
    for name, build in COSTED.items():
        assert build(7, 3, 101, "0") == build(7, 3, 101, "0"), name
