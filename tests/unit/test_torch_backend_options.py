"""The torch backend's registration, options and Work objects, in one process (world size 1).
The multi-rank semantics against gloo are in tests/local/test_torch_backend.py.

    python -m pytest tests/unit/test_torch_backend_options.py -q
"""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mlfabric
from mlfabric.torch import MlfabricWork, ProcessGroupMlfabric, ProcessGroupOptions
from mlfabric.torch.backend import ALGORITHM_ENV, TRANSPORT_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def solo_group():
    """A default "mlfabric" group of one rank; destroyed afterwards."""
    dist.init_process_group("mlfabric", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


def test_import_mlfabric_registers_the_backend() -> None:
    assert "mlfabric" in dist.Backend.backend_list


def test_the_entry_point_registers_it_without_importing_mlfabric() -> None:
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch.backends"]
    assert entry == {"mlfabric": "mlfabric._plugin:register_backend"}
    script = ("import sys, torch.distributed as dist; "
              "print('mlfabric' in dist.Backend.backend_list, 'mlfabric.torch.backend' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # Registered at `import torch`, the backend itself still unimported (it loads on first use).
    assert out.stdout.split() == ["True", "False"], (out.stdout, out.stderr[-2000:])


def test_options_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALGORITHM_ENV, raising=False)
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert ProcessGroupOptions().resolved() == ProcessGroupOptions(algorithm="auto", transport="tcp")
    monkeypatch.setenv(ALGORITHM_ENV, "bcube")
    monkeypatch.setenv(TRANSPORT_ENV, "zmq")
    assert ProcessGroupOptions().resolved() == ProcessGroupOptions(algorithm="bcube", transport="zmq")
    assert ProcessGroupOptions(algorithm="ring").resolved().algorithm == "ring"  # options win
    monkeypatch.setenv(TRANSPORT_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="'carrier-pigeon' \\(from MLFABRIC_TRANSPORT\\) is not one of tcp, zmq"):
        ProcessGroupOptions().resolved()


def test_bad_options_fail_at_init() -> None:
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'bogus'"):
        dist.init_process_group("mlfabric", store=dist.HashStore(), rank=0, world_size=1,
                                pg_options=ProcessGroupOptions(algorithm="bogus"))
    with pytest.raises(TypeError, match="must be mlfabric.torch.ProcessGroupOptions, got dict"):
        dist.init_process_group("mlfabric", store=dist.HashStore(), rank=0, world_size=1,
                                pg_options={"algorithm": "ring"})
    assert not dist.is_initialized()


def test_a_group_of_one_runs_every_op(solo_group: ProcessGroupMlfabric) -> None:
    assert isinstance(solo_group, ProcessGroupMlfabric) and dist.get_backend() == "mlfabric"
    t = torch.arange(6.0).view(2, 3)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert isinstance(work, MlfabricWork) and work.wait() and work.is_completed() and work.is_success()
    assert work.exception() is None and work.get_future().wait() == [t]
    out = torch.empty(6)
    dist.all_gather_into_tensor(out, torch.arange(6.0))
    assert out.tolist() == list(range(6))
    dist.reduce_scatter_tensor(out2 := torch.empty(6), torch.ones(6))
    assert out2.tolist() == [1.0] * 6
    dist.broadcast(t, 0)
    dist.barrier()
    assert solo_group.group_name and "ProcessGroupMlfabric(rank=0, size=1" in repr(solo_group)


def test_work_surfaces_the_error_as_torch_does() -> None:
    failed: torch.futures.Future = torch.futures.Future()
    work = MlfabricWork(failed, [torch.zeros(1)], "all_reduce", rank=3)
    assert not work.is_completed() and work.exception() is None
    start = time.monotonic()
    with pytest.raises(mlfabric.CollectiveTimeoutError, match="rank 3: all_reduce not done after waiting 0.2s"):
        work.wait(timedelta(seconds=0.2))
    assert time.monotonic() - start < 1.0
    failed.set_exception(mlfabric.PeerLostError("rank 3: peer 1 was lost", rank=3, peer=1))
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), mlfabric.PeerLostError)
    with pytest.raises(mlfabric.PeerLostError, match="peer 1 was lost"):
        work.wait()
    with pytest.raises(mlfabric.PeerLostError):
        work.get_future().wait()
    with pytest.raises(ValueError, match="not a receive from any source"):
        work._source_rank()
