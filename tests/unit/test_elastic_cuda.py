"""The Elastic wrapper with the model on a GPU: gradients averaged through host memory, a
joiner's model and Adam state landing on its devices. Skips without CUDA (CI has none; run it
on a GPU machine).

    .venv/bin/python -m pytest tests/unit/test_elastic_cuda.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mlfabric.runtime.membership import MembershipStore
from mlfabric.torch.elastic import Elastic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DIM = 8


def _batch(step: int, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randn(12, DIM, generator=gen)
    part = torch.arange(12)[rank::world]
    return x[part].to(device), x[part].sum(1, keepdim=True).to(device)


def _train(store: dist.Store, member: int, steps: int, device: torch.device, out: dict, *,
           leave_at: int | None = None) -> None:
    model = nn.Linear(DIM, 1)
    with torch.no_grad():  # every member starts from the same parameters
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    el = Elastic(model, opt, store=store, member=member, initial=(0, 1, 2), timeout=20, grace_s=3)
    try:
        while el.committed < steps:
            if leave_at is not None and el.committed == leave_at:
                break
            x, y = _batch(el.committed, el.rank, el.world_size, device)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            el.step(weight=len(x))
        out[member] = {"params": torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]),
                       "committed": el.committed, "param_devices": {p.device.type for p in model.parameters()},
                       "state": {k: v.device.type for s in opt.state.values() for k, v in s.items()
                                 if isinstance(v, torch.Tensor)}}
    finally:
        el.close()


def _run(device: torch.device, steps: int, *, leave: bool) -> dict:
    store, out, errors = dist.HashStore(), {}, []

    def run(member: int, **kwargs) -> None:
        try:
            _train(store, member, steps, device, out, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,), kwargs={"leave_at": 4 if leave and m == 2 else None},
                                daemon=True) for m in (0, 1, 2)]
    for t in threads:
        t.start()
    if leave:
        threads[2].join(60)
        ms = MembershipStore(store)
        deadline = time.monotonic() + 30
        while ms.current_epoch() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads.append(threading.Thread(target=run, args=(2,), daemon=True))  # restarted: joins
        threads[-1].start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def test_a_gpu_model_trains_elastically_and_a_joiner_gets_its_adam_state_on_its_devices() -> None:
    cuda = _run(torch.device("cuda"), 12, leave=True)
    assert [cuda[m]["committed"] for m in (0, 1, 2)] == [12, 12, 12]
    assert torch.equal(cuda[0]["params"], cuda[1]["params"]) and torch.equal(cuda[0]["params"], cuda[2]["params"])
    for m in (0, 1, 2):
        assert cuda[m]["param_devices"] == {"cuda"}
        # Adam's moments beside their parameters, its step count in host memory (torch's default)
        assert cuda[m]["state"] == {"exp_avg": "cuda", "exp_avg_sq": "cuda", "step": "cpu"}, cuda[m]["state"]
    cpu = _run(torch.device("cpu"), 12, leave=True)
    assert torch.allclose(cpu[0]["params"], cuda[0]["params"], atol=1e-5)



_DDP_MEMBER = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from mlfabric.torch.elastic import Elastic
member, port, dim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, member == 0, timeout=timedelta(seconds=60))
model = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 1))
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
el = Elastic(model, opt, store=store, member=member, initial=(0, 1), timeout=20, grace_s=3)
ddp = el.ddp()
while el.committed < 6:
    gen = torch.Generator().manual_seed(1000 * el.committed + 7)
    x = torch.randn(12, dim, generator=gen)[el.rank::el.world_size].cuda()
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
    el.step()
print(json.dumps({"params": torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist(),
                  "devices": sorted({p.device.type for p in model.parameters()}), "committed": el.committed}))
el.finish()
el.close()
"""


def test_ddp_on_the_elastic_group_with_a_gpu_model() -> None:
    """DDP's buckets are CUDA tensors: the "mlfabric" backend's elastic group stages them
    through host memory; two members (processes: a process's CUDA backward passes all run on
    one autograd thread, so two members as threads of one process would block each other in
    DDP's hook) end with equal parameters, still on the GPU."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _DDP_MEMBER, str(m), str(port), str(DIM)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [g["committed"] for g in got] == [6, 6] and all(g["devices"] == ["cuda"] for g in got)
    assert got[0]["params"] == got[1]["params"]
