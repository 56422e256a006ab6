"""Direct gather, scatter and all-to-all (collectives/direct.py): numbers through the reference
interpreter, structure (who sends what to whom) and the stated cost; then the Communicator's
reduce, gather, scatter and all_to_all on threads, and torch's ReduceOp accepted by it.

    python -m pytest tests/unit/test_direct_collectives.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mlfabric
from mlfabric.collectives.direct import direct_gather, direct_scatter, pairwise_all_to_all
from mlfabric.runtime.communicator import reduce_op_name
from mlfabric.schedule import Recv, Send, validate
from mlfabric.schedule.interpret import interpret

UNEVEN = (3, 0, 5, 1)  # a rank may contribute nothing


def _counts(n: int) -> tuple[int, ...]:
    return tuple(UNEVEN[r % len(UNEVEN)] + r for r in range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("root", [0, -1])
def test_gather_lands_every_piece_at_its_offset(n: int, root: int) -> None:
    root %= n
    counts = _counts(n)
    pieces = [np.arange(c, dtype=np.int64) + 100 * r for r, c in enumerate(counts)]
    data = [np.concatenate(pieces) if r == root else pieces[r] for r in range(n)]
    schedules = [direct_gather(n, r, len(data[r]), root=root, counts=counts) for r in range(n)]
    validate(schedules)
    out = interpret(schedules, [np.zeros_like(d) if r == root else d for r, d in enumerate(data)])
    expected = np.concatenate([np.zeros(c, np.int64) if r == root else pieces[r] for r, c in enumerate(counts)])
    np.testing.assert_array_equal(out[root], expected)  # the root's own slot is the caller's
    for r, sched in enumerate(schedules):
        sends = [op for op in sched.ops if isinstance(op, Send)]
        assert [op.peer for op in sends] == ([] if r == root else [root])
        assert sched.cost.elements_sent == {"0": 0 if r == root else counts[r]}


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_scatter_sends_each_rank_its_piece_only(n: int) -> None:
    root, counts = n - 1, _counts(n)
    stacked = np.arange(sum(counts), dtype=np.int64)
    data = [stacked if r == root else np.zeros(counts[r], np.int64) for r in range(n)]
    schedules = [direct_scatter(n, r, len(data[r]), root=root, counts=counts) for r in range(n)]
    validate(schedules)
    out = interpret(schedules, data)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for r in range(n):
        if r != root:
            np.testing.assert_array_equal(out[r], stacked[offsets[r]:offsets[r + 1]])
    root_sends = {op.peer: op.src.length for op in schedules[root].ops if isinstance(op, Send)}
    assert root_sends == {r: counts[r] for r in range(n) if r != root}
    assert schedules[root].cost.elements_sent == {"0": sum(counts) - counts[root]}
    if n > 1:
        assert set(schedules[root].cost.link_shares.values()) == {1 / (n - 1)}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_all_to_all_with_uneven_splits(n: int) -> None:
    # send[r][p]: how much rank r sends to p; what p receives from r must be the same.
    send = [tuple((r * 3 + p) % 4 for p in range(n)) for r in range(n)]
    recv = [tuple(send[p][r] for p in range(n)) for r in range(n)]
    inputs = [np.arange(sum(send[r]), dtype=np.int64) + 1000 * r for r in range(n)]
    data = [np.concatenate([inputs[r], np.zeros(sum(recv[r]), np.int64)]) for r in range(n)]
    schedules = [pairwise_all_to_all(n, r, len(data[r]), send_counts=send[r], recv_counts=recv[r])
                 for r in range(n)]
    validate(schedules)
    out = interpret(schedules, data)
    for r in range(n):
        expected = []
        for p in range(n):
            start = sum(send[p][:r])
            expected.append(inputs[p][start:start + send[p][r]])
        np.testing.assert_array_equal(out[r][sum(send[r]):], np.concatenate(expected))
        # Pairwise: step s sends to r+s and receives from r-s.
        peers = [(type(op).__name__, op.peer) for op in schedules[r].ops if isinstance(op, (Send, Recv))]
        assert peers == [(kind, (r + s if kind == "Send" else r - s) % n)
                         for s in range(1, n) for kind in ("Send", "Recv")]
        assert schedules[r].cost.elements_sent == {"0": sum(send[r]) - send[r][r]}


def test_builders_reject_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="expected 5"):
        direct_gather(2, 0, 4, root=0, counts=(2, 3))
    with pytest.raises(ValueError, match="root 2 is outside"):
        direct_scatter(2, 0, 2, root=2, counts=(1, 1))
    with pytest.raises(ValueError, match="send_counts must be 3"):
        pairwise_all_to_all(3, 0, 2, send_counts=(1, 1), recv_counts=(0, 0, 0))
    with pytest.raises(ValueError, match="does not hold"):
        pairwise_all_to_all(2, 0, 5, send_counts=(1, 1), recv_counts=(1, 1))


# --- the Communicator's collectives on threads ---------------------------------------------------

def test_reduce_op_names_from_torch() -> None:
    R = dist.ReduceOp
    assert [reduce_op_name(op) for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX)] == \
        ["sum", "avg", "prod", "min", "max"]
    assert reduce_op_name(R(R.MAX)) == "max"  # the object torch's options carry
    assert reduce_op_name("prod") == "prod"
    with pytest.raises(ValueError, match="BAND.*sum, avg, max, min, prod"):
        reduce_op_name(R.BAND)
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        reduce_op_name("mean")


def test_communicator_accepts_torch_reduce_ops() -> None:
    """Regression: ``op=dist.ReduceOp.SUM`` failed with 'unknown reduction'."""

    def body(comm: mlfabric.Communicator) -> list[torch.Tensor]:
        r = comm.rank
        out = []
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
            out.append(comm.allreduce(torch.tensor([1.0, 2.0]) * (r + 1), op=op))
        out.append(comm.reduce_scatter(torch.arange(6.0) * (r + 1), op=dist.ReduceOp.MIN))
        return out

    results = mlfabric.run_threads(3, body, timeout=20)
    for rank, (total, avg, big, prod, shard) in enumerate(results):
        torch.testing.assert_close(total, torch.tensor([6.0, 12.0]))
        torch.testing.assert_close(avg, torch.tensor([2.0, 4.0]))
        torch.testing.assert_close(big, torch.tensor([3.0, 6.0]))
        torch.testing.assert_close(prod, torch.tensor([6.0, 48.0]))
        torch.testing.assert_close(shard, torch.arange(6.0)[2 * rank:2 * rank + 2])


def test_communicator_rooted_collectives_and_all_to_all() -> None:
    n, root = 3, 1

    def body(comm: mlfabric.Communicator) -> dict[str, object]:
        r = comm.rank
        mine = torch.arange(4, dtype=torch.int32).view(2, 2) + 10 * r
        reduced = mine.clone()
        comm.reduce(reduced, root=root, op=dist.ReduceOp.MAX)
        gathered = comm.gather(mine, root=root)
        stacked = torch.arange(n * 3.0).view(n, 3) if r == root else None
        piece = comm.scatter(torch.empty(3), stacked, root=root)
        send = [(r + p) % 3 for p in range(n)]
        recv = [(p + r) % 3 for p in range(n)]
        inputs = torch.cat([torch.full((c,), 10.0 * r + p) for p, c in enumerate(send)])
        exchanged = comm.all_to_all(inputs, send_counts=send, recv_counts=recv)
        return {"mine": mine, "reduced": reduced, "gathered": gathered, "piece": piece,
                "exchanged": exchanged, "recv": recv}

    results = mlfabric.run_threads(n, body, timeout=20)
    for r, res in enumerate(results):
        if r == root:
            torch.testing.assert_close(res["reduced"], results[n - 1]["mine"])  # max = highest rank's
            torch.testing.assert_close(res["gathered"], torch.stack([x["mine"] for x in results]))
        else:
            torch.testing.assert_close(res["reduced"], res["mine"])  # a non-root's input is kept
            assert res["gathered"] is None
        torch.testing.assert_close(res["piece"], torch.arange(3.0) + 3 * r)
        expected = torch.cat([torch.full((c,), 10.0 * p + r) for p, c in enumerate(res["recv"])])
        torch.testing.assert_close(res["exchanged"], expected)


def test_all_to_all_with_disagreeing_splits_names_the_peer() -> None:
    def body(comm: mlfabric.Communicator) -> torch.Tensor:
        # Rank 1 expects 2 elements from rank 0, which sends 1.
        recv = [1, 1] if comm.rank == 0 else [2, 1]
        return comm.all_to_all(torch.ones(2), send_counts=[1, 1], recv_counts=recv)

    with pytest.raises(mlfabric.CollectiveError, match="from peer 0"):
        mlfabric.run_threads(2, body, timeout=5)
