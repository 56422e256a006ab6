"""The torch.distributed transport (gloo) with real processes on loopback.

Run: python -m pytest tests/local/test_torchdist.py
"""

from __future__ import annotations

import pytest
import torch

import mlfabric
from mlfabric.bench.procs import run_ranks
from mlfabric.collectives import build

pytestmark = pytest.mark.local


def _allreduce_over_gloo() -> list[int]:
    comm = mlfabric.init("torch", backend="gloo", timeout=30)
    sent = []
    for alg in ("ring", "halving_doubling", "tree"):
        for count in (0, 7, 100_003):
            t = torch.arange(count, dtype=torch.int64) * (comm.rank + 1)
            comm.transport.reset_counters()
            comm.allreduce(t, algorithm=alg)
            expected = torch.arange(count, dtype=torch.int64) * sum(range(1, comm.world_size + 1))
            assert torch.equal(t, expected), (alg, count)
            stated = build(f"allreduce:{alg}", comm.world_size, comm.rank, count, op="sum").cost
            assert comm.transport.bytes_sent() == stated.bytes_sent(8)
            sent.append(comm.transport.bytes_sent())
    mismatch = 10 if comm.rank == 0 else 11
    with pytest.raises(mlfabric.CollectiveError):
        comm.allreduce(torch.ones(mismatch), algorithm="ring")
    comm.close()
    return sent


def test_torch_transport_allreduce_and_mismatch() -> None:
    results = run_ranks(_allreduce_over_gloo, 3, timeout=120)
    assert all(len(r) == 9 for r in results)
    assert sum(results[0]) > 0


def test_nccl_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        mlfabric.init("torch", backend="nccl", rank=0, world_size=1)
