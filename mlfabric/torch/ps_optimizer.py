"""Data-parallel training through the parameter server: push gradients, pull the model.

    import mlfabric.ps, mlfabric.torch
    job = mlfabric.ps.init(consistency="ssp:2")          # servers: job.serve(); workers:
    model = MyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ps = mlfabric.torch.PSOptimizer(opt, model, job.worker)
    for x, y in batches:
        ps.zero_grad()
        loss_fn(model(x), y).backward()
        ps.step()                                          # push, clock, pull
    ps.leave()

Exercise it with ``python -m pytest tests/unit/test_ps_optimizer.py -q``.

Same shape as :class:`mlfabric.torch.EagerSGD`, but the optimizer runs on the servers: the
wrapped ``torch.optim.SGD`` declares the learning rate and momentum, which the servers apply
as MLfabric's eq. (1)-(2) (:class:`mlfabric.ps.rules.SGDMomentum`, the same arithmetic as
SGD's momentum buffer). The constructor registers the model (every worker starts from the
values the servers keep: the first worker's to arrive, so seed the model the same everywhere
or accept the first). :meth:`step` pushes this worker's flat gradient, advances its clock
and pulls the model into the parameters, waiting as the consistency model says (BSP: until
everyone's gradient of this step is applied, which is synchronous SGD exactly).

``keep_dropped=True``: a gradient MLfabric's scheduler drops (it would break the delay bound)
is added to the next step's instead of lost -- for updates that must all arrive once, like
LDA's count deltas (:mod:`mlfabric.train.lda`). SGD's gradients are dropped, as the paper does.
"""

from __future__ import annotations

from typing import Any

import torch

from mlfabric.ps.worker import PSWorker

__all__ = ["PSOptimizer"]


class PSOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, worker: PSWorker, *,
                 name: str = "model", keep_dropped: bool = False) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"PSOptimizer needs torch.optim.SGD (the servers apply SGD with momentum, MLfabric "
                            f"eq. (1)-(2)), got {type(optimizer).__name__}")
        if not isinstance(worker, PSWorker):
            raise TypeError(f"PSOptimizer needs the job's PSWorker (mlfabric.ps.init(...).worker), got "
                            f"{type(worker).__name__}")
        groups = optimizer.param_groups
        settings = {(g["lr"], g.get("momentum", 0.0), g.get("weight_decay", 0.0), g.get("nesterov", False),
                     g.get("dampening", 0.0)) for g in groups}
        if len(settings) != 1:
            raise ValueError("PSOptimizer applies one lr and momentum on the servers: use one parameter group")
        lr, momentum, weight_decay, nesterov, dampening = settings.pop()
        if weight_decay or nesterov or dampening:
            raise ValueError("the servers' rule is plain SGD with momentum: weight_decay, nesterov and dampening "
                             "are not supported")
        self.optimizer, self.model, self.worker, self.name = optimizer, model, worker, name
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        keys = [k for k, p in model.named_parameters() if p.requires_grad]
        self.spec = worker.init_model(name, dict(zip(keys, self.params)), lr=float(lr), momentum=float(momentum))
        self._grads = torch.zeros(self.spec.numel, dtype=self.spec.torch_dtype)
        self._flat = torch.zeros(self.spec.numel, dtype=self.spec.torch_dtype)
        # keep_dropped: what the scheduler dropped, pushed again with the next gradient
        self._carried = torch.zeros_like(self._grads) if keep_dropped else None
        self.steps = 0
        self.pull()  # start from the servers' model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Push this step's gradient, finish the iteration (clock) and pull the model."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                self._grads[offset:offset + n].zero_()
            else:
                self._grads[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        if self._carried is not None:
            self._grads.add_(self._carried)
        sent = self.worker.push(self.name, self._grads)
        if self._carried is not None:
            if sent:
                self._carried.zero_()
            else:
                self._carried.copy_(self._grads)
        self.pull(clock=True)  # the clock goes with the pull (PSWorker.pull_in_order says why)
        self.steps += 1

    def pull(self, staleness: int | None = None, *, clock: bool = False) -> None:
        """Load the servers' model into the parameters (the consistency model's wait);
        ``clock=True`` finishes the iteration first (:meth:`PSWorker.pull_flat`)."""
        self.worker.pull_flat(self.name, staleness, out=self._flat, clock=clock)
        self._load()

    def _load(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(self._flat[offset:offset + n].view_as(p))
                offset += n

    def epoch_end(self) -> bool:
        return False  # the servers hold the one model: nothing to average

    def synchronize(self) -> None:
        """Load the model the servers have now, whatever the clocks (MLfabric's get)."""
        for j in range(self.worker.layout.servers):
            offset, length = self.spec.shards(self.worker.layout.servers)[j]
            self._flat[offset:offset + length].copy_(self.worker.get(j, self.name))
        self._load()

    def leave(self) -> None:
        self.worker.leave()

    @property
    def stats(self) -> Any:
        return self.worker.stats

    def __repr__(self) -> str:
        return (f"PSOptimizer(model={self.name!r}, parameters={self.spec.numel}, "
                f"consistency={self.worker.config.consistency})")
