"""DDP with mlfabric's comm hook gives the same gradients as DDP's default allreduce.

Run: python -m pytest tests/local/test_ddp_hook.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mlfabric
import mlfabric.torch
from mlfabric.bench.procs import run_ranks

pytestmark = pytest.mark.local


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _grads() -> bool:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    comm = mlfabric.init("zmq", timeout=30)
    reference, hooked = DDP(_model()), DDP(_model(), bucket_cap_mb=0.001)  # several buckets
    state = mlfabric.torch.HookState(comm, algorithm="ring")
    hooked.register_comm_hook(state, mlfabric.torch.allreduce_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        for model in (reference, hooked):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        for p_ref, p_hook in zip(reference.parameters(), hooked.parameters()):
            torch.testing.assert_close(p_hook.grad, p_ref.grad, rtol=1e-5, atol=1e-6)
    # The hook really carried the gradients, in more than one bucket.
    assert state.buckets_reduced > 3, state.buckets_reduced  # > 1 bucket per step
    comm.close()
    dist.destroy_process_group()
    return True


def test_ddp_hook_matches_default_allreduce() -> None:
    assert run_ranks(_grads, 2, timeout=120) == [True, True]


def test_hook_state_rejects_unknown_algorithm() -> None:
    comm = mlfabric.local_world(1)[0]
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        mlfabric.torch.HookState(comm, algorithm="bogus")
    comm.close()
