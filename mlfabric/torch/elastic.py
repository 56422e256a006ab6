"""Elastic data-parallel training: a model and optimizer whose steps survive a lost rank.

    .venv/bin/python examples/elastic.py --help
    .venv/bin/python -m pytest tests/local/test_elastic_processes.py -q

In the spirit of torchft's ``Manager``: wrap the model and optimizer, call :meth:`Elastic.step`
after ``loss.backward()``::

    elastic = Elastic(model, optimizer, store=store, member=member_id, initial=range(4))
    while elastic.committed < total_steps:
        x, y = batch_for(elastic.committed, elastic.rank, elastic.world_size)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        elastic.step(weight=len(x))    # True: committed on every live rank; False: retried

Each step's gradients (times ``weight``, e.g. the batch's sample count) are summed over the
ranks of the current membership with one allreduce, in which two more numbers ride: the sum of
the weights (the gradient is divided by it: averaged over the ranks that contributed, in
proportion to their samples) and the leader's "joiners are waiting" flag. A failed allreduce
(a rank died) aborts the step on this rank and reconfigures the membership
(``mlfabric/runtime/elastic.py``); the quorum starts the new epoch at the highest committed
step and hands that state to any member behind it, so the step ends committed on all live
ranks or on none. A joiner (``initial=None``) receives the model, the optimizer state and
the step count before its first step.

Parameters must share one floating dtype (the gradient buffer is one flat tensor); optimizer
state may hold tensors of any dtype and plain numbers. A model on a GPU works as one on the CPU:
the gradients and the state a joiner receives are staged through host memory, and each received
state tensor goes where the sender kept it (beside its parameter, or in host memory like Adam's
step count); tests/unit/test_elastic_cuda.py checks it where a GPU is present.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from mlfabric.errors import MlfabricError
from mlfabric.runtime.communicator import DEFAULT_TIMEOUT_S
from mlfabric.runtime.elastic import DEFAULT_CONNECT_S, ElasticCommunicator
from mlfabric.runtime.membership import DEFAULT_GRACE_S, Store

__all__ = ["Elastic", "model_signature"]


def model_signature(model: nn.Module) -> str:
    """Names, shapes and dtypes of ``model``'s parameters and buffers: what a joiner must share."""
    parts = [f"{name}:{'x'.join(map(str, t.shape)) or 'scalar'}:{str(t.dtype).removeprefix('torch.')}"
             for name, t in model.state_dict().items()]
    return ";".join(parts)


class Elastic:
    """See the module docstring. ``on_commit(step, elastic)`` is called after each committed
    step (measurements); ``algorithm`` is the allreduce schedule (ring, halving_doubling, tree)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, store: Store, member: int,
                 initial: Sequence[int] | None = None, algorithm: str = "ring", job: str = "job",
                 address: str = "127.0.0.1", timeout: float = DEFAULT_TIMEOUT_S, grace_s: float = DEFAULT_GRACE_S,
                 connect_s: float = DEFAULT_CONNECT_S,
                 on_commit: Callable[[int, "Elastic"], None] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"Elastic needs parameters of one floating dtype, got {sorted(map(str, dtypes))}")
        self.dtype = next(iter(dtypes))
        self.committed = 0
        self.aborted = 0
        self.on_commit = on_commit
        self.comm = ElasticCommunicator(store, member, self, initial=initial, job=job, address=address,
                                        timeout=timeout, grace_s=grace_s, connect_s=connect_s)

    # -- membership ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def members(self) -> tuple[int, ...]:
        assert self.comm.membership is not None
        return self.comm.membership.members

    # -- the step --------------------------------------------------------------------------------

    def step(self, weight: float = 1.0) -> bool:
        """Average the gradients over this step's ranks and apply the optimizer: True when the
        step committed, False when it was aborted (a rank was lost; the membership changed and
        this rank now holds the job's latest committed state: compute the step again)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        leader_flag = 1.0 if self.comm.rank == 0 and self.comm.joiners_waiting() else 0.0
        # The communicator moves host memory: the gradients of a model on an accelerator are
        # staged through one host buffer (as the "mlfabric" backend stages CUDA tensors).
        buf = torch.cat([g.detach().reshape(-1).to("cpu", self.dtype) for g in grads]
                        + [torch.tensor([1.0, leader_flag], dtype=self.dtype)])
        n = buf.numel() - 2
        if weight != 1.0:
            buf[:n].mul_(weight)
        buf[n] = weight
        comm = self.comm.comm
        assert comm is not None
        try:
            comm.allreduce(buf, algorithm=self.algorithm)
        except MlfabricError as exc:
            self.aborted += 1
            self.comm.reconfigure(f"step {self.committed} aborted: {type(exc).__name__}: {exc}")
            return False
        total, joiners = float(buf[n]), float(buf[n + 1])
        buf[:n].div_(total)
        offset = 0
        for p, g in zip(self.params, grads):
            size = g.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(buf[offset:offset + size].view_as(p.grad))  # back to p's device
            offset += size
        self.optimizer.step()
        self.committed += 1
        if self.on_commit is not None:
            self.on_commit(self.committed, self)
        if joiners > 0:
            self.comm.reconfigure(f"admitting joiners after step {self.committed}")
        return True

    def finish(self) -> None:
        """Training is over: processes still waiting to join give up (JobFinishedError)."""
        self.comm.finish()

    def close(self) -> None:
        self.comm.close()

    # -- state (runtime.elastic.StateHolder) -------------------------------------------------------

    def signature(self) -> str:
        return model_signature(self.model)

    def _tensors(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The state's tensors in a fixed order, and its plain values."""
        tensors = [(f"model.{name}", t) for name, t in self.model.state_dict().items()]
        extra: dict[str, Any] = {}
        for i, p in enumerate(self.params):
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    # "@" marks a state tensor kept where its parameter is (Adam's moments);
                    # the others stay in host memory on the receiver too (Adam's step count)
                    where = "@" if value.device == p.device else ""
                    tensors.append((f"opt.{i}.{key}{where}", value))
                else:
                    extra[f"opt.{i}.{key}"] = value
        return tensors, extra

    def pack(self) -> tuple[dict[str, Any], torch.Tensor]:
        tensors, extra = self._tensors()
        layout, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
            offset += nbytes
        blob = torch.empty(offset, dtype=torch.uint8)  # host memory, whatever the state's devices
        for (name, _, _, start, nbytes), (_, t) in zip(layout, tensors):
            blob[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return {"committed": self.committed, "layout": layout, "extra": extra, "packed_at": time.time()}, blob

    def unpack(self, header: dict[str, Any], blob: torch.Tensor) -> None:
        model_state = self.model.state_dict()
        for name, dtype, shape, start, nbytes in header["layout"]:
            value = blob[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
            if name.startswith("model."):
                key = name.removeprefix("model.")
                if key not in model_state or tuple(model_state[key].shape) != tuple(shape):
                    raise ValueError(f"the received state's {key} ({shape}) does not fit this model")
                with torch.no_grad():
                    model_state[key].copy_(value)  # onto the model's own device
            else:
                _, index, key = name.split(".", 2)
                param = self.params[int(index)]
                on_param = key.endswith("@")
                self.optimizer.state[param][key.removesuffix("@")] = (value.to(param.device, copy=True) if on_param
                                                                      else value.clone())
        for name, value in header["extra"].items():
            _, index, key = name.split(".", 2)
            self.optimizer.state[self.params[int(index)]][key] = value
        self.committed = int(header["committed"])
