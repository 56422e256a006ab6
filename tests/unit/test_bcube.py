"""BML on BCube (collectives/bcube.py), its hierarchical variant and the P2P parameter server
(collectives/p2p_ps.py): numbers against a local reference, structure (levels, neighbours,
per-level bytes) and the communicator's topology handling.

    python -m pytest tests/unit/test_bcube.py -q
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import mlfabric
from mlfabric.collectives import MAX_PARTS, build, choose_allreduce, pipeline_parts
from mlfabric.collectives.bcube import (
    AGGREGATION,
    BROADCAST,
    DigitExchange,
    bcube_allreduce,
    closed_form_elements_per_level,
    decode_part_tag,
    decode_tag,
    hierarchical_allreduce,
    hierarchy_of,
)
from mlfabric.collectives.p2p_ps import p2p_ps_allreduce
from mlfabric.schedule import Recv, ScheduleError, Send, validate
from mlfabric.schedule.interpret import interpret
from mlfabric.topo.spec import TopologySpec

SHAPES = [(2, 1), (2, 2), (3, 2), (2, 3), (4, 2), (3, 3)]


def _inputs(world: int, count: int, dtype: type = np.int64) -> list[np.ndarray]:
    rng = np.random.default_rng(world * 1000 + count)
    return [rng.integers(-1000, 1000, size=count).astype(dtype) for _ in range(world)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("count", [0, 1, 7, 1001, 4 * 3 * 27])
@pytest.mark.parametrize("parts", [1, 3])
def test_bml_matches_reference(n: int, k: int, count: int, parts: int) -> None:
    world = n**k
    schedules = [bcube_allreduce(world, r, count, n=n, k=k, parts=parts) for r in range(world)]
    validate(schedules)
    data = _inputs(world, count)
    expected = np.sum(np.stack(data), axis=0) if count else np.zeros(0, np.int64)
    for rank, out in enumerate(interpret(schedules, data)):
        np.testing.assert_array_equal(out, expected, err_msg=f"BCube({n},{k}) rank {rank}")


@pytest.mark.parametrize("op", ["max", "min"])
def test_bml_other_reductions(op: str) -> None:
    schedules = [bcube_allreduce(9, r, 100, n=3, k=2, op=op) for r in range(9)]
    data = _inputs(9, 100)
    expected = getattr(np, op)(np.stack(data), axis=0)
    for out in interpret(schedules, data):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("n,k", SHAPES)
def test_threads_of_a_host_use_distinct_levels_in_every_step(n: int, k: int) -> None:
    world = n**k
    ex = DigitExchange((n,) * k, k, 0)
    for rank in range(world):
        sched = bcube_allreduce(world, rank, 10 * k * world, n=n, k=k)
        levels: dict[tuple[int, int], set[int]] = {}
        for op in sched.ops:
            if not isinstance(op, (Send, Recv)):
                continue
            thread, stage, step = decode_tag(op.tag, k)
            level = int(op.channel)
            expected = ex.aggregation_level(thread, step) if stage == AGGREGATION else ex.broadcast_level(thread, step)
            assert level == expected, (rank, thread, stage, step)
            # Only 1-hop neighbours under the level-l switch: the peer differs in digit l only.
            differs = [i for i, (a, b) in enumerate(zip(ex.digits(rank), ex.digits(op.peer))) if a != b]
            assert differs == [level], (rank, op)
            levels.setdefault((stage, step), set()).add((thread, level))
        for (stage, step), used in levels.items():
            assert len({t for t, _ in used}) == k, (rank, stage, step)
            assert len({lvl for _, lvl in used}) == k, f"rank {rank} {stage}/{step}: levels collide: {used}"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_messages_to_a_neighbour_leave_in_step_order(n: int, k: int, parts: int) -> None:
    """Regression: on one connection (peer, level) the threads' messages were ordered only by
    timing, so a thread that ran ahead could put its last, big message in front of the other
    thread's earlier, small one (BML calls of ~1.5 s instead of ~1.1 s on the emulator). Now
    every send waits for the previous one on the same connection, in step-major order: step w
    of every part before step w+1 of any (what lets parts pipeline)."""
    world = n**k
    for rank in range(world):
        sched = bcube_allreduce(world, rank, 10 * k * world * parts, n=n, k=k, parts=parts)
        by_connection: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for index, op in enumerate(sched.ops):
            if isinstance(op, Send):
                part, _, stage, step = decode_part_tag(op.tag, k, k)
                global_step = step if stage == AGGREGATION else k + step
                by_connection.setdefault((op.peer, op.channel), []).append((global_step, part, index))
        for connection, sends in by_connection.items():
            sends.sort()
            # Every step uses every level once, so each connection carries one message per
            # step and part.
            assert [(step, part) for step, part, _ in sends] == [
                (step, part) for step in range(2 * k) for part in range(parts)], (rank, connection)
            for (_, _, earlier), (_, _, later) in zip(sends, sends[1:]):
                assert earlier in sched.ops[later].deps, (rank, connection, earlier, later)


def test_bml_paper_example_bcube_3_2() -> None:
    """BML §3.2's walk-through: thread 0 of server [0,0] sends 3 pieces to [0,1] and 3 to
    [0,2] on level 0, then 1 piece to each of [1,0] and [2,0] on level 1."""
    count = 18 * 5  # 18 pieces of 5 elements
    sched = bcube_allreduce(9, 0, count, n=3, k=2)
    thread0 = [op for op in sched.ops if isinstance(op, Send) and decode_tag(op.tag, 2)[0] == 0]
    agg = [(op.peer, op.channel, op.src.length // 5) for op in thread0 if decode_tag(op.tag, 2)[1] == AGGREGATION]
    assert sorted(agg) == [(1, "0", 3), (2, "0", 3), (3, "1", 1), (6, "1", 1)]
    bcast = [(op.peer, op.channel, op.src.length // 5) for op in thread0 if decode_tag(op.tag, 2)[1] == BROADCAST]
    assert sorted(bcast) == [(1, "0", 3), (2, "0", 3), (3, "1", 1), (6, "1", 1)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("parts", [1, 2])
def test_per_level_elements_equal_closed_form(n: int, k: int, parts: int) -> None:
    world = n**k
    count = 3 * k * world * parts
    for rank in range(world):
        sched = bcube_allreduce(world, rank, count, n=n, k=k, parts=parts)
        per_level = sched.elements_sent_by_channel()
        assert per_level == sched.cost.elements_sent
        for level in range(k):
            assert per_level[str(level)] == closed_form_elements_per_level(count, n, k)
        assert sched.cost.steps == 2 * k


def test_per_level_elements_uneven_counts_stay_within_one_piece() -> None:
    for count in (1, 7, 1001):
        for rank in range(9):
            sched = bcube_allreduce(9, rank, count, n=3, k=2)
            assert sched.elements_sent_by_channel() == sched.cost.elements_sent
            for level in range(2):
                ideal = closed_form_elements_per_level(count, 3, 2)
                # 2(N-1) pieces each off by at most one element from count/(kN)
                assert abs(sched.cost.elements_sent.get(str(level), 0) - ideal) <= 2 * 8


def test_bml_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="n\\^k"):
        bcube_allreduce(8, 0, 10, n=3, k=2)
    with pytest.raises(ValueError, match="n >= 2"):
        bcube_allreduce(1, 0, 10, n=1, k=2)
    with pytest.raises(ValueError, match="channels"):
        bcube_allreduce(9, 0, 10, n=3, k=2, channels=("0",))
    with pytest.raises(ValueError, match="outside"):
        bcube_allreduce(9, 9, 10, n=3, k=2)


def test_missing_dependency_would_be_caught() -> None:
    """The validator is what proves the dependencies right: dropping one makes it fail."""
    schedules = [bcube_allreduce(8, r, 64, n=2, k=3) for r in range(8)]
    from dataclasses import replace

    sched = schedules[0]
    index = next(i for i, op in enumerate(sched.ops)
                 if isinstance(op, Send) and decode_tag(op.tag, 3)[1:] == (BROADCAST, 2))
    ops = list(sched.ops)
    ops[index] = replace(ops[index], deps=())
    schedules[0] = replace(sched, ops=tuple(ops))
    with pytest.raises(ScheduleError, match="overlapping"):
        validate(schedules)


@pytest.mark.parametrize("radices", [(2, 2, 4), (3, 1, 2), (5,), (2, 3)])
def test_hierarchical_matches_reference_on_one_channel(radices: tuple[int, ...]) -> None:
    world = int(np.prod(radices))
    for count in (0, 5, 999):
        schedules = [hierarchical_allreduce(world, r, count, radices=radices) for r in range(world)]
        validate(schedules)
        assert all(s.channels() <= {"0"} for s in schedules)
        data = _inputs(world, count)
        for out in interpret(schedules, data):
            np.testing.assert_array_equal(out, np.sum(np.stack(data), axis=0))


def test_hierarchical_groups_innermost_digit_first() -> None:
    """Fat-Tree(4): first the host under the same edge switch, then the other edge of the
    pod, then the other pods."""
    sched = hierarchical_allreduce(16, 0, 160, radices=(2, 2, 4))
    first_peers = [op.peer for op in sched.ops if isinstance(op, Send)]
    assert first_peers[:1] == [1] and first_peers[1:2] == [2] and sorted(first_peers[2:5]) == [4, 8, 12]
    assert sched.elements_sent_by_channel() == {"0": 2 * 15 * 10}


def test_hierarchy_of_topologies() -> None:
    assert hierarchy_of(TopologySpec.parse("fat-tree:k=4")) == (2, 2, 4)
    assert hierarchy_of(TopologySpec.parse("racks:r=3,h=4")) == (4, 3)
    assert hierarchy_of(TopologySpec.parse("bcube:n=3,k=2")) == (3, 3)
    assert hierarchy_of(TopologySpec.parse("star:n=5")) == (5,)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 9])
def test_p2p_ps_matches_reference_and_cost(world: int) -> None:
    for count in (0, 1, 7, 1001):
        schedules = [p2p_ps_allreduce(world, r, count) for r in range(world)]
        validate(schedules)
        data = _inputs(world, count)
        for rank, out in enumerate(interpret(schedules, data)):
            np.testing.assert_array_equal(out, np.sum(np.stack(data), axis=0))
            sched = schedules[rank]
            assert sched.elements_sent_by_channel().get("0", 0) == sched.cost.elements_sent["0"]
            peers = {op.peer for op in sched.ops if isinstance(op, Send)}
            assert peers == set(range(world)) - {rank}


def test_auto_picks_bml_on_bcube_only() -> None:
    assert choose_allreduce("auto", 64 << 20, 9, "bcube:n=3,k=2") == "bcube"
    assert choose_allreduce("auto", 16, 9, "bcube:n=3,k=2") == "bcube"
    assert choose_allreduce("auto", 64 << 20, 9, "star:n=9") == "ring"
    assert choose_allreduce("auto", 64 << 20, 9) == "ring"
    assert build("allreduce:bcube", 9, 4, 100, n=3, k=2).name == "bcube_allreduce"


# --- the communicator, threads transport ---------------------------------------------------


@pytest.mark.parametrize("n,k", [(2, 2), (3, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_communicator_bml_one_channel_per_level(n: int, k: int, dtype: torch.dtype) -> None:
    world, count = n**k, 1001
    channels = tuple(str(level) for level in range(k))

    def body(comm: mlfabric.Communicator) -> tuple[torch.Tensor, dict[str, int]]:
        t = (torch.arange(count) % 97 * (comm.rank + 1)).to(dtype)
        comm.allreduce(t, algorithm="bcube")
        return t, {ch: comm.transport.bytes_sent(ch) for ch in channels}

    results = mlfabric.run_threads(world, body, channels=channels, topology=f"bcube:n={n},k={k}")
    expected = (torch.arange(count) % 97 * sum(range(1, world + 1))).to(dtype)
    for rank, (tensor, per_channel) in enumerate(results):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
        stated = build("allreduce:bcube", world, rank, count, op="sum", n=n, k=k, channels=channels).cost
        itemsize = torch.tensor([], dtype=dtype).element_size()
        assert per_channel == {ch: stated.elements_sent.get(ch, 0) * itemsize for ch in channels}


def test_communicator_bml_on_one_nic_and_auto() -> None:
    def body(comm: mlfabric.Communicator) -> torch.Tensor:
        t = torch.full((37,), float(comm.rank))
        comm.allreduce(t, algorithm="auto")
        assert comm.transport.bytes_sent("0") > 0
        return t

    for out in mlfabric.run_threads(4, body, topology="bcube:n=2,k=2"):
        torch.testing.assert_close(out, torch.full((37,), 6.0))


def test_communicator_topology_errors() -> None:
    with pytest.raises(ValueError, match="9 hosts but the world size is 8"):
        mlfabric.local_world(8, topology="bcube:n=3,k=2")
    comms = mlfabric.local_world(4)
    try:
        with pytest.raises(ValueError, match="topology='bcube"):
            comms[0].allreduce(torch.ones(4), algorithm="bcube")
    finally:
        for comm in comms:
            comm.close()
    comms = mlfabric.local_world(4, topology="star:n=4")
    try:
        with pytest.raises(ValueError, match="needs the cluster's shape"):
            comms[0].allreduce(torch.ones(4), algorithm="bcube")
    finally:
        for comm in comms:
            comm.close()


def test_parts_keep_the_smallest_message_at_least_one_chunk() -> None:
    mib = (1 << 20) // 4  # float32 elements
    # 64 MB of float32 on BCube(3,2): 18 pieces of ~3.56 MB; 1 MiB chunks give 3 parts.
    assert pipeline_parts("bcube", 16_000_000, 9, mib, n=3, k=2) == {"parts": 3}
    assert pipeline_parts("bcube", 16_000_000, 9, 2 * mib, n=3, k=2) == {"parts": 1}  # 1.7 chunks
    assert pipeline_parts("bcube", 16_000_000, 9, 1, n=3, k=2) == {"parts": MAX_PARTS}
    assert pipeline_parts("bcube", 3_274_634, 9, mib, n=3, k=2) == {"parts": 1}  # LeNet-5: < 1 MiB pieces
    # The P2P PS's smallest message is a shard: 64 MB / 9 = 7.1 MB -> capped at MAX_PARTS.
    assert pipeline_parts("ps", 16_000_000, 9, mib) == {"parts": MAX_PARTS}
    assert pipeline_parts("ps", 16_000_000, 9, None) == {"parts": 1}  # no pipelining chunk
    assert pipeline_parts("ring", 16_000_000, 9, mib) == {}  # the ring pipelines in chunks instead
    with pytest.raises(ValueError, match="positive"):
        pipeline_parts("ps", 100, 3, 0)
    with pytest.raises(ValueError, match="at least 1"):
        bcube_allreduce(9, 0, 100, n=3, k=2, parts=0)
    with pytest.raises(ValueError, match="at least 1"):
        p2p_ps_allreduce(3, 0, 100, parts=0)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 1001])
@pytest.mark.parametrize("parts", [1, 3])
def test_p2p_ps_in_parts_matches_reference_and_costs_the_same(world: int, count: int, parts: int) -> None:
    schedules = [p2p_ps_allreduce(world, r, count, parts=parts) for r in range(world)]
    validate(schedules)
    data = _inputs(world, count)
    expected = np.sum(np.stack(data), axis=0) if count else np.zeros(0, np.int64)
    for rank, out in enumerate(interpret(schedules, data)):
        np.testing.assert_array_equal(out, expected, err_msg=f"world {world} rank {rank}")
    if world > 1 and count >= world * parts:
        one = [p2p_ps_allreduce(world, r, count).cost for r in range(world)]
        assert sum(s.cost.total_elements_sent for s in schedules) == sum(c.total_elements_sent for c in one)
        for sched in schedules:
            assert sched.elements_sent_by_channel() == sched.cost.elements_sent


def test_p2p_ps_connections_carry_every_push_before_any_pull() -> None:
    for rank in range(4):
        sched = p2p_ps_allreduce(4, rank, 4000, parts=3)
        for peer in range(4):
            if peer == rank:
                continue
            tags = [op.tag for op in sched.ops if isinstance(op, Send) and op.peer == peer]
            # Tags 2p (push of part p) and 2p + 1 (pull): all pushes, then the pulls, in part order.
            assert tags == [0, 2, 4, 1, 3, 5], (rank, peer, tags)


def test_communicator_pipelines_bml_from_its_chunk_size() -> None:
    def run(comm: mlfabric.Communicator) -> tuple[int, bool]:
        t = torch.arange(18 * 4000, dtype=torch.float32) + comm.rank
        parts = comm.pipeline_options("bcube", t)["parts"]
        comm.allreduce(t, algorithm="bcube")
        return parts, bool(torch.equal(t, 9 * torch.arange(18 * 4000, dtype=torch.float32) + 36))

    comms = mlfabric.local_world(9, topology="bcube:n=3,k=2", channels=("0", "1"))
    for comm in comms:
        comm.chunk_bytes = 4000  # 1,000 float32: pieces of 4,000 elements -> 4 parts
    results = []
    threads = [threading.Thread(target=lambda c=c: results.append(run(c))) for c in comms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for comm in comms:
        comm.close()
    assert results == [(MAX_PARTS, True)] * 9
