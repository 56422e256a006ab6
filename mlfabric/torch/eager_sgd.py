"""eager-SGD (eager-SGD §5, Algorithm 5): data-parallel SGD whose gradient allreduce is partial.

    import mlfabric, mlfabric.torch
    comm = mlfabric.init()                                    # under torchrun / mlfabric launch
    model = MyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)        # any torch optimizer
    eager = mlfabric.torch.EagerSGD(opt, model, comm, quorum="majority", sync_every_epochs=10)
    for epoch in range(epochs):
        for x, y in batches:
            eager.zero_grad()
            loss_fn(model(x), y).backward()
            eager.step()                                      # partial allreduce, then opt.step()
        eager.epoch_end()                                     # every 10th epoch: average the models
    eager.synchronize()                                       # same model everywhere, to evaluate/save
    print(eager.stats)                                        # rounds, contributed fraction, active

Every step flattens this rank's gradients into one buffer and calls
``comm.partial_allreduce(buffer, quorum, op="sum")`` (:mod:`mlfabric.runtime.partial`):

* ``quorum="solo"``: the first rank to get there starts the round, the others contribute
  what they have (eager-SGD §4.1); ``"majority"``: a randomly designated rank (the same draw
  on every rank) starts it, so on average half the ranks contribute fresh gradients (§4.2);
  ``"all"``: wait for everyone (synchronous SGD through the same machinery).
* The round's sum divided by the number of live ranks is written into every parameter's
  ``.grad`` and the wrapped optimizer steps: ``G_global = partial_allreduce(G_local) / P``.
* A rank whose gradient missed the round still applies the round's result (the fresh
  gradients of the others) and its own gradient waits in the collective's *send buffer*,
  added to whatever it hands in next: stale gradients are carried into a later round, never
  lost (``stats.contributed_fraction`` says how often a step's gradient made its round).
* A rank more than one round behind only sees the latest result, so models drift apart
  slightly; :meth:`epoch_end` therefore averages the parameters every ``sync_every_epochs``
  epochs (``sync_every_steps`` for a step count), with a synchronous (quorum ``"all"``)
  partial allreduce that, like the partial ones, goes on without ranks that were lost.

All ranks must construct the wrapper (it broadcasts rank 0's parameters, so every rank starts
from the same model), call :meth:`epoch_end`/:meth:`synchronize` the same number of times and
use the same ``seed``. The rounds of different ranks need not line up: that is the point.

Exercise it with ``python -m pytest tests/local/test_eager_sgd.py -q``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mlfabric.runtime.communicator import Communicator
from mlfabric.runtime.partial import QUORUM_CHOICES, PartialResult

__all__ = ["EagerSGD", "EagerStats"]

# The model average runs on its own persistent collective: a distinct seed keeps it apart from
# the gradients' one even when both have quorum "all" and the same size.
_SYNC_SEED_OFFSET = 1_000_003
_ARRIVAL_SEED_OFFSET = 2_000_003
_SERVE_PAUSE_S = 0.002  # between calls that found nothing to apply, while waiting in synchronize()


@dataclass
class EagerStats:
    """What the partial allreduce did for this rank's steps."""

    steps: int = 0               # calls of step()
    contributed: int = 0         # steps whose gradient was in the round the step applied
    active_sum: int = 0          # sum over steps of the round's active ranks
    rounds_skipped: int = 0      # rounds this rank never applied (it caught up past them)
    last_round: int = -1
    syncs: int = 0               # model averages
    served: int = 0              # non-empty rounds applied while waiting in synchronize()
    comm_s: float = 0.0          # seconds spent waiting in the gradient collective
    sync_s: float = 0.0          # seconds spent in model averages
    lost: frozenset[int] = field(default_factory=frozenset)

    @property
    def contributed_fraction(self) -> float:
        return self.contributed / self.steps if self.steps else 0.0

    @property
    def mean_active(self) -> float:
        return self.active_sum / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "contributed": self.contributed,
                "contributed_fraction": self.contributed_fraction, "mean_active": self.mean_active,
                "rounds_skipped": self.rounds_skipped,
                "last_round": self.last_round, "syncs": self.syncs, "served": self.served, "comm_s": self.comm_s,
                "sync_s": self.sync_s, "lost": sorted(self.lost)}


class EagerSGD:
    """Wrap ``optimizer`` so that its gradients are summed with a partial allreduce (see module).

    ``model`` gives the parameters to exchange (those with ``requires_grad``, in
    ``model.parameters()`` order; all of one dtype). ``quorum`` is ``"solo"``,
    ``"majority"`` or ``"all"``. ``sync_every_epochs`` (``0``: never) and
    ``sync_every_steps`` (``None``: never) schedule model averages. ``algorithm`` is the
    reduction's schedule (``"ring"``, ``"halving_doubling"``, ``"tree"``, ``"ps"``);
    ``seed`` seeds majority's initiator draws (equal on every rank). ``timeout`` bounds one
    step's wait (default: the communicator's). ``broadcast_initial`` copies rank 0's
    parameters to every rank now (a synchronous collective every rank must call).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, comm: Communicator,
                 quorum: str = "majority", sync_every_epochs: int = 10, *,
                 sync_every_steps: int | None = None, algorithm: str = "ring", seed: int = 0,
                 timeout: float | None = None, broadcast_initial: bool = True) -> None:
        if quorum not in QUORUM_CHOICES:
            raise ValueError(f"unknown quorum {quorum!r}; choose one of {', '.join(QUORUM_CHOICES)}")
        if sync_every_epochs < 0:
            raise ValueError(f"sync_every_epochs must be >= 0 (0: never), got {sync_every_epochs}")
        if sync_every_steps is not None and sync_every_steps < 1:
            raise ValueError(f"sync_every_steps must be >= 1 or None, got {sync_every_steps}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"EagerSGD needs an mlfabric Communicator, got {type(comm).__name__}")
        self.optimizer = optimizer
        self.model = model
        self.comm = comm
        self.quorum = quorum
        self.sync_every_epochs = sync_every_epochs
        self.sync_every_steps = sync_every_steps
        self.algorithm = algorithm
        self.seed = seed
        self.timeout = timeout
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"EagerSGD exchanges one flat buffer: all parameters must share a dtype, got {dtypes}")
        self.dtype = self.params[0].dtype
        self.numel = sum(p.numel() for p in self.params)
        self.epochs = 0
        self.stats = EagerStats()
        self.last_result: PartialResult | None = None
        self._grads = torch.zeros(self.numel, dtype=self.dtype)
        self._pending: torch.futures.Future | None = None  # a call synchronize() left outstanding
        if broadcast_initial:
            self.broadcast_parameters()

    # -- the step --------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> PartialResult:
        """Partial-allreduce the gradients, write their average into ``.grad``, step the
        optimizer; returns the collective's result (``contributed``, ``active``, ``round``)."""
        flat = self._grads
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(p.grad.detach().reshape(-1))
            offset += n
        start = time.perf_counter()
        res = self.comm.partial_allreduce(flat, self.quorum, algorithm=self.algorithm, op="sum",
                                          seed=self.seed, timeout=self.timeout)
        self.stats.comm_s += time.perf_counter() - start
        self._apply(res)
        self._account(res)
        if self.sync_every_steps is not None and self.stats.steps % self.sync_every_steps == 0:
            self.synchronize()
        return res

    def _apply(self, res: PartialResult) -> None:
        """Write the round's average into ``.grad`` and step the optimizer."""
        average = res.tensor / (self.comm.world_size - len(res.lost))
        offset = 0
        for p in self.params:
            n = p.numel()
            piece = average[offset:offset + n].view_as(p).to(p.device)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            offset += n
        self.optimizer.step()

    def _account(self, res: PartialResult) -> None:
        s = self.stats
        s.steps += 1
        s.contributed += int(res.contributed)
        s.active_sum += res.active
        s.rounds_skipped += max(0, res.round - s.last_round - 1)
        s.last_round = res.round
        s.lost = res.lost
        self.last_result = res

    # -- model synchronization -------------------------------------------------------------

    def epoch_end(self) -> bool:
        """Count an epoch; every ``sync_every_epochs``-th average the models. True if it did."""
        self.epochs += 1
        if self.sync_every_epochs and self.epochs % self.sync_every_epochs == 0:
            self.synchronize()
            return True
        return False

    def synchronize(self) -> None:
        """Average the parameters over the live ranks (synchronous: every rank must call).

        First every rank waits for all to arrive, and while it waits it keeps taking part in
        the gradient collective (calls with a zero gradient, results applied): with
        ``"majority"`` a rank still in :meth:`step` may be waiting for a round whose designated
        initiator is this one, and would otherwise wait forever. Then the parameters are
        averaged with a synchronous (quorum ``"all"``) partial allreduce, which goes on without
        ranks that were lost. Call it once more after the last step, before evaluating."""
        start = time.perf_counter()
        arrived = self.comm.partial_allreduce_async(torch.ones(1, dtype=self.dtype), "all",
                                                    algorithm=self.algorithm, op="sum",
                                                    seed=self.seed + _ARRIVAL_SEED_OFFSET, timeout=self.timeout)
        self._serve_until(arrived)
        flat = self._flat_parameters()
        res = self.comm.partial_allreduce(flat, "all", algorithm=self.algorithm, op="sum",
                                          seed=self.seed + _SYNC_SEED_OFFSET, timeout=self.timeout)
        self._load_parameters(res.tensor / (self.comm.world_size - len(res.lost)))
        self.stats.syncs += 1
        self.stats.sync_s += time.perf_counter() - start

    def _serve_until(self, future: torch.futures.Future) -> None:
        """Keep a call of the gradient collective outstanding until ``future`` completes.

        Only majority needs it (with solo every call starts its round, with all every rank
        calls every round). A call left outstanding when ``future`` completes carries zeros;
        its round is answered to this rank's next :meth:`step` as well."""
        if self.quorum != "majority":
            future.wait()
            return
        zeros = torch.zeros(self.numel, dtype=self.dtype)
        pending = self._pending
        next_call = 0.0
        while not future.done():
            if pending is None:
                if time.perf_counter() >= next_call:
                    pending = self.comm.partial_allreduce_async(zeros, self.quorum, algorithm=self.algorithm,
                                                                op="sum", seed=self.seed, timeout=self.timeout)
            elif pending.done():
                res = pending.value()
                if (self.last_result is None or res.round > self.last_result.round) and bool(res.tensor.any()):
                    self._apply(res)  # the others' gradients: train on them like they do
                    self.stats.served += 1
                else:
                    # Nothing in it (every rank waiting here): pace the calls rather than spin
                    # empty rounds while the last ranks finish their steps.
                    next_call = time.perf_counter() + _SERVE_PAUSE_S
                self.last_result = res
                self.stats.last_round = max(self.stats.last_round, res.round)
                pending = None
                continue
            time.sleep(0.0005)
        future.wait()  # raises if the arrival failed
        self._pending = pending if pending is not None and not pending.done() else None

    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every rank's parameters with ``root``'s (synchronous)."""
        flat = self._flat_parameters()
        self.comm.broadcast(flat, root=root, timeout=self.timeout)
        self._load_parameters(flat)

    def _flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", self.dtype) for p in self.params])

    def _load_parameters(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def __repr__(self) -> str:
        return (f"EagerSGD(quorum={self.quorum!r}, sync_every_epochs={self.sync_every_epochs}, "
                f"parameters={self.numel}, optimizer={type(self.optimizer).__name__})")
