"""The "mlfabric" torch.distributed backend against gloo, in real processes on loopback.

One launch of 3 ranks runs every torch.distributed op on an mlfabric group and on a gloo
group with the same inputs and compares the results (dtypes, uneven sizes, async_op,
ReduceOps, subgroups, point to point, errors); one launch of 2 ranks trains DDP and FSDP2
models on the default "mlfabric" group and on a gloo group and compares the parameters.

Run: python -m pytest tests/local/test_torch_backend.py
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import mlfabric
from mlfabric.bench.procs import LaunchConfig, run_ranks
from mlfabric.torch import MlfabricWork, ProcessGroupMlfabric, ProcessGroupOptions

pytestmark = pytest.mark.local

R = dist.ReduceOp
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.int8, torch.uint8)
SIZES = (1, 7, 3001)  # 7 and 3001 do not split evenly over 3 ranks


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int, low: int = 0, high: int = 5) -> torch.Tensor:
    """Small integers in any dtype, so that sums and products are exact in every dtype and
    every order of reduction: results must then be equal, not close."""
    values = torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))
    return values.to(dtype) if dtype != torch.bool else values % 2 == 1


class Checker:
    """Runs one op on the mlfabric group and on the gloo group, compares what it leaves."""

    def __init__(self, mlf: object, gloo: object) -> None:
        self.groups = {"mlfabric": mlf, "gloo": gloo}
        self.failures: list[str] = []
        self.checked = 0
        self.async_calls = itertools.count()

    def compare(self, name: str, fn: Callable[[object, bool], object]) -> None:
        """``fn(group, async_op)`` returns what to compare; every other call is async."""
        async_op = next(self.async_calls) % 2 == 1
        try:
            ours = fn(self.groups["mlfabric"], async_op)
            theirs = fn(self.groups["gloo"], False)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        except Exception as exc:  # noqa: BLE001 - collected and reported by the parent
            self.failures.append(f"rank {dist.get_rank()}: {name}: {type(exc).__name__}: {str(exc)[:400]}")
        self.checked += 1

    def merge(self, other: "Checker") -> None:
        self.failures += other.failures
        self.checked += other.checked


def _finish(work: object, async_op: bool, outputs: object) -> object:
    """Wait like a torch user does; an async work must be a completed MlfabricWork (or gloo's)."""
    if async_op:
        assert work is not None
        assert work.wait() is True and work.is_completed()
        value = work.get_future().wait()
        assert isinstance(value, list)
    return outputs


def _semantics() -> dict[str, object]:
    dist.init_process_group("mlfabric", timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    world = dist.distributed_c10d._get_default_group()
    assert isinstance(world, ProcessGroupMlfabric) and dist.get_backend() == "mlfabric"
    gloo = dist.new_group(backend="gloo")
    check = Checker(None, gloo)  # None: the default group, as a plain dist.all_reduce(t) uses
    seeds = itertools.count(100 * rank)

    # all_reduce: every dtype and op torch allows on gloo, uneven sizes, a non-contiguous tensor
    for dtype, n, op in itertools.product((*FLOATS, *INTS, torch.bool), SIZES, (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)):
        if op == R.AVG and not dtype.is_floating_point:
            continue  # gloo refuses integer averages (mlfabric floors them: tests/unit)
        low, high = (1, 3) if op == R.PRODUCT else (0, 5)
        x = _data((n,), dtype, next(seeds), low, high)

        def all_reduce(group: object, async_op: bool, x: torch.Tensor = x, op: object = op) -> torch.Tensor:
            t = x.clone()
            return _finish(dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op, t)

        check.compare(f"all_reduce {dtype} n={n} {op}", all_reduce)
    x = _data((5, 4), torch.float32, next(seeds))

    def all_reduce_transposed(group: object, async_op: bool) -> torch.Tensor:
        t = x.clone().t()
        return _finish(dist.all_reduce(t, group=group, async_op=async_op), async_op, t)

    check.compare("all_reduce of a non-contiguous tensor", all_reduce_transposed)
    complex_x = torch.complex(_data((6,), torch.float32, next(seeds)), _data((6,), torch.float32, next(seeds)))
    check.compare("all_reduce complex64", lambda g, a: _finish(dist.all_reduce(t := complex_x.clone(), group=g, async_op=a), a, t))

    coalesced = [_data((n,), torch.float32, next(seeds)) for n in (3, 5)]

    def all_reduce_coalesced(group: object, async_op: bool) -> list[torch.Tensor]:
        ts = [t.clone() for t in coalesced]
        work = dist.all_reduce_coalesced(ts, op=R.MAX, group=group, async_op=async_op)
        return _finish(work, async_op, ts)

    check.compare("all_reduce_coalesced", all_reduce_coalesced)

    # broadcast, reduce, gather, scatter from every root
    for root, dtype in itertools.product(range(size), (torch.float32, torch.int64, torch.bool, torch.bfloat16)):
        x = _data((7, 3), dtype, next(seeds))
        check.compare(f"broadcast root={root} {dtype}",
                      lambda g, a, x=x, root=root: _finish(dist.broadcast(t := x.clone(), root, group=g, async_op=a), a, t))

        def reduce(group: object, async_op: bool, x: torch.Tensor = x, root: int = root) -> torch.Tensor:
            t = x.clone()
            op = R.MAX if dtype == torch.bool else R.SUM
            work = dist.reduce(t, root, op=op, group=group, async_op=async_op)
            return _finish(work, async_op, t if rank == root else torch.zeros(0))  # elsewhere: undefined

        check.compare(f"reduce root={root} {dtype}", reduce)

        def gather(group: object, async_op: bool, x: torch.Tensor = x, root: int = root) -> list[torch.Tensor]:
            out = [torch.zeros_like(x) for _ in range(size)] if rank == root else None
            return _finish(dist.gather(x, out, dst=root, group=group, async_op=async_op), async_op, out or [])

        check.compare(f"gather root={root} {dtype}", gather)
        pieces = [_data((4,), dtype, 1000 * root + i) for i in range(size)]

        def scatter(group: object, async_op: bool, pieces: list = pieces, root: int = root, dtype: object = dtype) -> torch.Tensor:
            out = torch.zeros(4, dtype=dtype)
            work = dist.scatter(out, pieces if rank == root else None, src=root, group=group, async_op=async_op)
            return _finish(work, async_op, out)

        check.compare(f"scatter root={root} {dtype}", scatter)

    # all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor
    for dtype, n in itertools.product((torch.float32, torch.int32, torch.bool, torch.float16), (1, 7)):
        x = _data((n, 2), dtype, next(seeds))

        def all_gather(group: object, async_op: bool, x: torch.Tensor = x) -> list[torch.Tensor]:
            out = [torch.empty_like(x) for _ in range(size)]
            return _finish(dist.all_gather(out, x, group=group, async_op=async_op), async_op, out)

        check.compare(f"all_gather {dtype} n={n}", all_gather)
        # gloo wants the pieces along dim 0; mlfabric (as NCCL) takes any shape of that size.
        for shape in ((size * n, 2), (size, n, 2), (size * n * 2,)):
            def into_tensor(group: object, async_op: bool, x: torch.Tensor = x, shape: tuple = shape) -> torch.Tensor:
                out = torch.empty(shape if group is not gloo else (size * n, 2), dtype=x.dtype)
                work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
                return _finish(work, async_op, out.reshape(size * n, 2))

            check.compare(f"all_gather_into_tensor {dtype} n={n} {shape}", into_tensor)
        if dtype == torch.bool:
            continue
        for op in (R.SUM, R.MAX, R.MIN, R.PRODUCT, *((R.AVG,) if dtype.is_floating_point else ())):
            pieces = [_data((n, 2), dtype, next(seeds), 1, 3) for _ in range(size)]

            def reduce_scatter(group: object, async_op: bool, pieces: list = pieces, op: object = op) -> torch.Tensor:
                out = torch.zeros_like(pieces[0])
                work = dist.reduce_scatter(out, [p.clone() for p in pieces], op=op, group=group, async_op=async_op)
                return _finish(work, async_op, out)

            check.compare(f"reduce_scatter {dtype} n={n} {op}", reduce_scatter)
            whole = torch.cat(pieces)

            def reduce_scatter_tensor(group: object, async_op: bool, whole: torch.Tensor = whole, op: object = op) -> torch.Tensor:
                out = torch.zeros(n, 2, dtype=whole.dtype)
                work = dist.reduce_scatter_tensor(out, whole.clone(), op=op, group=group, async_op=async_op)
                return _finish(work, async_op, out)

            check.compare(f"reduce_scatter_tensor {dtype} n={n} {op}", reduce_scatter_tensor)

    # all_to_all_single (even and uneven splits) and all_to_all
    for dtype in (torch.float32, torch.int64, torch.bool):
        x = _data((size * 2, 3), dtype, next(seeds))
        check.compare(f"all_to_all_single even {dtype}", lambda g, a, x=x: _finish(
            dist.all_to_all_single(out := torch.empty_like(x), x, group=g, async_op=a), a, out))
        send = [(rank + p) % 3 for p in range(size)]  # rows to peer p; p receives them
        recv = [(p + rank) % 3 for p in range(size)]
        x = _data((sum(send), 2), dtype, next(seeds))

        def uneven(group: object, async_op: bool, x: torch.Tensor = x, send: list = send, recv: list = recv) -> torch.Tensor:
            out = torch.empty(sum(recv), 2, dtype=x.dtype)
            work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=async_op)
            return _finish(work, async_op, out)

        check.compare(f"all_to_all_single uneven {dtype}", uneven)
        ins = [_data((3,), dtype, next(seeds)) for _ in range(size)]

        def all_to_all(group: object, async_op: bool, ins: list = ins) -> list[torch.Tensor]:
            outs = [torch.empty_like(i) for i in ins]
            if group is gloo:  # gloo of torch 2.11 has no list all_to_all: its single-tensor one
                dist.all_to_all_single(flat := torch.empty(3 * size, dtype=ins[0].dtype), torch.cat(ins), group=gloo)
                return list(flat.split(3))
            return _finish(dist.all_to_all(outs, ins, group=group, async_op=async_op), async_op, outs)

        check.compare(f"all_to_all {dtype}", all_to_all)

    # point to point: a ring of send/recv, of isend/irecv, batch_isend_irecv, a recv from anyone
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    x = _data((5,), torch.float64, next(seeds))

    def ring_send_recv(group: object, async_op: bool) -> torch.Tensor:
        out = torch.zeros(5, dtype=torch.float64)
        if rank % 2 == 0:
            dist.send(x, nxt, group=group, tag=3)
            dist.recv(out, prev, group=group, tag=3)
        else:
            dist.recv(out, prev, group=group, tag=3)
            dist.send(x, nxt, group=group, tag=3)
        return out

    check.compare("send/recv ring", ring_send_recv)

    def isend_irecv(group: object, async_op: bool) -> list[torch.Tensor]:
        outs = [torch.zeros(5, dtype=torch.float64) for _ in range(2)]
        works = [dist.irecv(outs[i], prev, group=group, tag=i) for i in (1, 0)]  # posted out of tag order
        works += [dist.isend(x * (i + 1), nxt, group=group, tag=i) for i in (0, 1)]
        for work in works:
            work.wait()
        return outs

    check.compare("isend/irecv with tags", isend_irecv)

    def batch(group: object, async_op: bool) -> torch.Tensor:
        out = torch.zeros(5, dtype=torch.float64)
        ops = [dist.P2POp(dist.irecv, out, prev, group), dist.P2POp(dist.isend, x, nxt, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out

    check.compare("batch_isend_irecv", batch)

    def from_anyone(group: object, async_op: bool) -> torch.Tensor:
        if rank == 0:
            outs = []
            for _ in range(size - 1):
                out = torch.zeros(1)
                source = dist.recv(out, group=group, tag=9)
                outs.append((source, out.item()))
            return torch.tensor(sorted(outs))
        dist.send(torch.tensor([float(rank)]), 0, group=group, tag=9)
        return torch.zeros(0)

    check.compare("recv from any source", from_anyone)
    for async_op in (False, True):
        work = dist.barrier(async_op=async_op)
        if async_op:
            assert isinstance(work, MlfabricWork) and work.wait() and work.is_completed()

    # subgroups: ranks 0 and 2 only (global ranks in, group ranks inside)
    sub = {name: dist.new_group([0, 2], backend=name) for name in ("mlfabric", "gloo")}
    if rank in (0, 2):
        sub_check = Checker(sub["mlfabric"], sub["gloo"])
        x = _data((7,), torch.float32, next(seeds))
        sub_check.compare("subgroup all_reduce", lambda g, a: _finish(dist.all_reduce(t := x.clone(), group=g, async_op=a), a, t))
        sub_check.compare("subgroup broadcast from global rank 2", lambda g, a: _finish(
            dist.broadcast(t := x.clone(), 2, group=g, async_op=a), a, t))
        sub_check.compare("subgroup all_gather", lambda g, a: _finish(
            dist.all_gather(out := [torch.empty_like(x) for _ in range(2)], x, group=g, async_op=a), a, out))

        def send_recv(group: object, async_op: bool) -> torch.Tensor:
            if rank == 0:
                dist.send(x, 2, group=group)  # global rank 2 is group rank 1
                return x
            out = torch.zeros(7)
            assert dist.recv(out, 0, group=group) == 0
            return out

        sub_check.compare("subgroup send/recv", send_recv)
        assert dist.get_group_rank(sub["mlfabric"], 2) == 1 and sub["mlfabric"].size() == 2
        check.merge(sub_check)

    # MLFABRIC_ALGORITHM / pg_options pick the allreduce: BML on a 3-host BCube
    bml = dist.new_group(backend="mlfabric", pg_options=ProcessGroupOptions(algorithm="bcube", topology="bcube:n=3,k=1"))
    assert bml.algorithm == "bcube" and world.algorithm == os.environ.get("MLFABRIC_ALGORITHM", "auto")
    x = _data((3001,), torch.float32, next(seeds))
    bml_check = Checker(bml, gloo)
    bml_check.compare("all_reduce through BML", lambda g, a: _finish(dist.all_reduce(t := x.clone(), group=g, async_op=a), a, t))
    check.merge(bml_check)

    # errors surface from wait(): ranks disagreeing on the size, in a group of its own
    broken = dist.new_group(backend="mlfabric")
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(4 + (rank == 2)), group=broken, async_op=True)
    try:
        work.wait()
        error = None
    except mlfabric.CollectiveError as exc:
        error = str(exc)
    out = {"failures": check.failures, "checked": check.checked, "error": error,
           "error_s": time.monotonic() - start, "exception": repr(work.exception()),
           "bytes_sent": world.comm.transport.bytes_sent()}
    # Rank 0 hosts torch's store: it must not exit while another rank still uses it (rank 1
    # once got "Connection reset by peer" from the store after rank 0 had returned).
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return out


def test_every_op_matches_gloo() -> None:
    config = LaunchConfig(world_size=3, timeout_s=150, env={"MLFABRIC_ALGORITHM": "ring"})
    results = run_ranks(_semantics, config=config)
    for rank, res in enumerate(results):
        assert res["failures"] == [], "\n".join(res["failures"])
        assert res["checked"] >= 250, res["checked"]
        assert res["bytes_sent"] > 100_000  # the default group's ops went over mlfabric's transport
        # A size mismatch fails the operation on every rank from wait(), quickly, naming
        # another rank; exception() returns the same error.
        others = [p for p in range(3) if p != rank]
        assert res["error"] is not None and any(f"{who} {p}" in res["error"] for p in others
                                                for who in ("rank", "peer")), res
        assert res["error_s"] < 5.0 and "Error" in res["exception"], res


# -- training: unmodified DDP and FSDP2 on the mlfabric default group ----------------------------

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(model: torch.nn.Module, rank: int, steps: int = 6) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _ddp_and_fsdp() -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("mlfabric")
    rank = dist.get_rank()
    world = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    out: dict[str, float] = {}

    before = world.comm.transport.bytes_sent()
    ours, reference = DDP(_model(), bucket_cap_mb=0.002), DDP(_model(), process_group=gloo, bucket_cap_mb=0.002)
    _train(ours, rank)
    _train(reference, rank)
    out["ddp_bytes"] = world.comm.transport.bytes_sent() - before
    out["ddp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), reference.parameters()))
    out["ddp_moved"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), _model().parameters()))

    def fsdp(mesh: DeviceMesh) -> list[torch.Tensor]:
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank)
        return [p.full_tensor() for p in model.parameters()]

    before = world.comm.transport.bytes_sent()
    fsdp_ours = fsdp(init_device_mesh("cpu", (dist.get_world_size(),)))  # the default group
    out["fsdp_bytes"] = world.comm.transport.bytes_sent() - before
    fsdp_reference = fsdp(DeviceMesh.from_group(gloo, "cpu"))
    out["fsdp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(fsdp_ours, fsdp_reference))
    out["fsdp_vs_ddp"] = max((a - b).abs().max().item() for a, b in zip(fsdp_ours, reference.parameters()))
    dist.destroy_process_group()
    return out


def test_ddp_and_fsdp_train_as_on_gloo() -> None:
    config = LaunchConfig(world_size=2, timeout_s=150, env={"MLFABRIC_ALGORITHM": "auto"})
    for res in run_ranks(_ddp_and_fsdp, config=config):
        assert res["ddp_moved"] > 1e-3  # training changed the parameters
        assert res["ddp_max_diff"] <= 1e-6, res
        assert res["fsdp_max_diff"] <= 1e-6, res
        assert res["fsdp_vs_ddp"] <= 1e-5, res  # FSDP and DDP train the same model
        # The gradients went through mlfabric: each of the 6 steps sends (N-1)/N x 2 = 1 model's
        # worth of gradients per rank (1,732 float32 parameters), give or take the rounding of
        # uneven pieces; FSDP2 all-gathers the parameters and reduce-scatters the gradients.
        model_bytes = sum(p.numel() for p in _model().parameters()) * 4
        assert res["ddp_bytes"] >= 0.9 * 6 * model_bytes and res["fsdp_bytes"] >= 0.9 * 6 * model_bytes, res


# -- CUDA tensors (a lent GPU machine; skipped elsewhere) -----------------------------------------

def _cuda_tensors() -> bool:
    dist.init_process_group("mlfabric")
    rank, device = dist.get_rank(), torch.device("cuda", 0)
    t = (torch.arange(1000, dtype=torch.float32) * (rank + 1)).to(device)
    dist.all_reduce(t)
    gathered = torch.empty(2000, device=device)
    dist.all_gather_into_tensor(gathered, t)
    b = torch.full((5,), float(rank), device=device)
    dist.broadcast(b, 1)
    assert t.device == device and gathered.device == device
    assert torch.equal(t.cpu(), torch.arange(1000.0) * 3)
    assert torch.equal(gathered.cpu(), torch.cat([t.cpu(), t.cpu()])) and torch.equal(b.cpu(), torch.ones(5))
    dist.destroy_process_group()
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    assert run_ranks(_cuda_tensors, 2, timeout=120) == [True, True]
