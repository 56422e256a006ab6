"""Elastic members as threads of the test process, for the elastic tests
(test_elastic_membership.py, test_elastic_recovery_faults.py).

    .venv/bin/python -m pytest tests/unit/test_elastic_recovery_faults.py -q

Each member trains a linear model with :class:`mlfabric.torch.elastic.Elastic` over loopback
tcp and a shared in-memory store; ``plan`` says, per member id, when it leaves (``leave_at``:
it raises :class:`Died`, its thread ends and its sockets close, which its peers see as a
departed peer: the path of a lost one after detection), whether it then comes back as a
joiner (``rejoin_after``: once the store's membership epoch reaches that), whether it starts
later as a joiner (``start_after``) and its ``initial`` list.
``patch(member, elastic)`` replaces parts of a member to make it die at a chosen point.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from mlfabric.runtime.membership import MembershipStore
from mlfabric.torch.elastic import Elastic

DIM = 6


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s 12 samples, this rank's share (12 splits evenly over 1 to 4 ranks)."""
    gen = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randn(12, DIM, generator=gen)
    y = x.sum(1, keepdim=True)
    part = torch.arange(12)[rank::world]
    return x[part], y[part]


class Died(Exception):
    """Stands for a process that dies at a chosen point (its thread ends, its sockets close)."""


def run_members(store: dist.Store, plan: dict[int, dict], steps: int, initial: tuple[int, ...],
                patch: Callable[[int, Elastic], None], *, step_s: float = 0.0,
                options: dict | None = None) -> tuple[dict, dict]:
    """Run the members of ``plan`` to ``steps`` committed steps (``step_s``: a pause per step,
    standing in for compute; ``options``: more arguments of every member's Elastic); returns
    ({member: params and history}, {member: its exception})."""
    out: dict = {}
    errors: dict[int, BaseException] = {}

    def run(member: int, restarted: bool = False) -> None:
        spec = plan[member]
        model = nn.Linear(DIM, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        el = None
        try:
            el = Elastic(model, opt, store=store, member=member,
                         initial=None if restarted else spec.get("initial", initial),
                         timeout=20, grace_s=3, connect_s=1.0, **(options or {}))
            patch(member, el)
            while el.committed < steps:
                if spec.get("leave_at") == el.committed and not restarted:
                    raise Died()
                x, y = batch(el.committed, el.rank, el.world_size)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if step_s:
                    time.sleep(step_s)
                el.step(weight=len(x))
            out[member] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
                           "history": el.comm.history, "aborted": el.aborted}
        except Died as exc:
            if "rejoin_after" not in spec:
                errors[member] = exc
        except BaseException as exc:  # noqa: BLE001 - fails the test
            errors[member] = exc
        finally:
            if el is not None:
                el.close()
        if "rejoin_after" in spec and not restarted and member not in errors and member not in out:
            # Restarted (as torchrun would) once the others formed epoch ``rejoin_after``: it joins.
            ms = MembershipStore(store)
            deadline = time.monotonic() + 30
            while ms.current_epoch() < spec["rejoin_after"] and time.monotonic() < deadline:
                time.sleep(0.01)
            run(member, restarted=True)

    threads = {m: threading.Thread(target=run, args=(m,), daemon=True) for m in plan if "start_after" not in plan[m]}
    for t in threads.values():
        t.start()
    for m, spec in plan.items():
        if "start_after" in spec:
            ms = MembershipStore(store)
            deadline = time.monotonic() + 30
            while ms.current_epoch() < spec["start_after"] and time.monotonic() < deadline:
                time.sleep(0.01)
            threads[m] = threading.Thread(target=run, args=(m,), daemon=True)
            threads[m].start()
    for t in threads.values():
        t.join(90)
    assert all(not t.is_alive() for t in threads.values())
    return out, errors
