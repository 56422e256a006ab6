"""Priority-ordered gradient allreduce with per-parameter updates: TicTac's priorities on allreduce training.

    priorities = mlfabric.order.parameter_priorities(model, (example_x,))      # TIO, from the DAG
    opt = mlfabric.torch.OrderedAllreduce(model, comm, torch.optim.SGD, lr=0.01, priorities=priorities)
    for x, y in batches:
        loss_fn(model(x), y).backward()      # no optimizer.step() nor zero_grad(): done per parameter
    opt.synchronize()                        # before reading the parameters (evaluation, checkpoint)
    opt.close()

Exercise it with ``.venv/bin/python -m pytest tests/local/test_ordered_allreduce.py -q``.

What it does, ByteScheduler-style (docs/tictac.md, "Gradients of allreduce training"):

* a post-accumulate-grad hook per parameter tells a background *comm thread* that the
  parameter's gradient is ready;
* the comm thread allreduces (average) the gradients in fixed partitions of at most
  ``partition_bytes`` (large parameters cut, small consecutive ones fused, as DDP's buckets),
  at most ``credit`` at a time, in one order for every iteration
  (:mod:`mlfabric.order.gradients`). The first :data:`CALIBRATION_ITERATIONS` take the
  parameters in reverse and measure when each gradient is ready and how long each partition
  holds the link (its completion after the previous one's, the least over those
  iterations: an optimistic link makes the order wait for a gradient less often); from then
  on, the order is DDP's first come, first served without ``priorities``, or with them the
  order a priority scheduler would serve them in. Rank 0 computes it and broadcasts it, so
  every rank issues the same collectives in the same order by construction;
* once all of a parameter's partitions are reduced, its own optimizer
  (``optimizer_class([param], **defaults)``) steps and its gradient is cleared;
* a forward pre-hook on every module that owns parameters waits (bounded) until that
  module's parameters are updated, so the next forward starts as soon as the first layers
  are, while the later layers' gradients are still on the wire.

The communicator belongs to it while it is open: collectives the script issues on the same
communicator would interleave with the comm thread's differently on each rank (call
:meth:`OrderedAllreduce.synchronize` first; several may share one communicator when they
train in turns, each synchronized before the next trains, as ``mlfabric bench grad-order``
does). Every parameter that requires a gradient must get
one in every backward (as DDP without ``find_unused_parameters``), and each backward must come
after a forward through the gated model (no gradient accumulation across backward passes).
Learning-rate schedulers see one optimizer per parameter: use :meth:`set_lr`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from mlfabric.errors import CollectiveTimeoutError
from mlfabric.order.gradients import Partition, fifo_order, partition_params, priority_order
from mlfabric.runtime.communicator import Communicator

__all__ = ["CALIBRATION_ITERATIONS", "DEFAULT_PARTITION_BYTES", "OrderedAllreduce"]

#: ByteScheduler tunes its partition size per job (MBs on 10-100 Gbit/s). On the 2-core
#: test machine each collective costs ~2.4 ms of its own, so smaller pieces let a first
#: layer overtake sooner but cost more than they save (docs/tictac.md has the figures).
DEFAULT_PARTITION_BYTES = 512 * 1024
#: Iterations in DDP's reverse order that measure the oracle (the first also warms up the
#: connections, so each partition's least time over them is kept).
CALIBRATION_ITERATIONS = 2


class OrderedAllreduce:
    """See the module docstring. ``priorities``: parameter name -> priority (lower first, as
    :func:`mlfabric.order.parameter_priorities` returns), None for DDP's order; ``gate``:
    install the forward pre-hooks (False: the caller waits with :meth:`wait`, e.g. through
    :class:`mlfabric.ps.overlap.ParameterGate`); ``timeout_s``: bound of those waits (default
    the communicator's); ``grad_ready_at``: parameter -> the instant its gradient counts as
    ready (an emulated accelerator's; default: when the hook runs)."""

    def __init__(self, model: nn.Module, comm: Communicator,
                 optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.SGD, *,
                 priorities: Mapping[str, float] | None = None, partition_bytes: int = DEFAULT_PARTITION_BYTES,
                 credit: int = 2, algorithm: str = "ring", gate: bool = True, timeout_s: float | None = None,
                 grad_ready_at: Callable[[str], float] | None = None, **defaults: Any) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"OrderedAllreduce needs an mlfabric Communicator, got {type(comm).__name__}")
        if credit < 1:
            raise ValueError(f"credit must be >= 1 partition in flight, got {credit}")
        self.comm = comm
        self.rank = comm.rank
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the model has no parameter that requires a gradient")
        if priorities is not None:
            missing = sorted(set(self.params) - set(priorities))
            if missing:
                raise ValueError(f"no priority for parameter(s) {missing[:5]}: priorities must cover every "
                                 "parameter that requires a gradient (parameter_priorities(model, ...) does)")
        self.priorities = None if priorities is None else {k: float(priorities[k]) for k in self.params}
        self.partitions = partition_params(
            [(k, p.numel(), p.element_size(), str(p.dtype)) for k, p in self.params.items()], partition_bytes)
        self.partition_bytes = partition_bytes
        self.credit = credit
        self.algorithm = algorithm
        self.timeout_s = comm.timeout if timeout_s is None else float(timeout_s)
        self._grad_ready_at = grad_ready_at
        self._check_same_everywhere(model)
        self._optimizers = {k: optimizer_class([p], **defaults) for k, p in self.params.items()}
        self._parts_of = {k: sum(part.params.count(k) for part in self.partitions) for k in self.params}
        #: The order the comm thread issues partitions in: until calibrated, the parameters in
        #: reverse (DDP's first guess at the backward's order); then the measured
        #: first-come-first-served order, or the priority order when priorities were given.
        position = {k: i for i, k in enumerate(self.params)}
        self.order: list[Partition] = sorted(self.partitions, key=lambda p: -position[p.params[-1]])
        self.calibrated = False
        #: The calibration's oracle: ready offset (s) per parameter after the first one,
        #: service time (s) per partition.
        self.ready_s: dict[str, float] = {}
        self.service_s: dict[Partition, float] = {}
        self.iterations = 0  # backward passes whose gradients are all reduced and applied
        self._cond = threading.Condition()
        self._produced = dict.fromkeys(self.params, 0)
        self._reduced = dict.fromkeys(self.params, 0)
        self._ready_at = dict.fromkeys(self.params, 0.0)
        now = time.monotonic()
        self._updated_at = dict.fromkeys(self.params, now)
        self._doing = "waiting for the first backward"
        self._error: BaseException | None = None
        self._closed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_hook(k)) for k, p in self.params.items()]
        if gate:
            key_of = {id(p): k for k, p in self.params.items()}
            for name, sub in model.named_modules():
                own = [key_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in key_of]
                if own:
                    self._handles.append(sub.register_forward_pre_hook(self._gate_hook(name or "<root>", own)))
        self._thread = threading.Thread(target=self._run, name=f"mlfabric-ordered-allreduce-{self.rank}",
                                        daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------

    @property
    def complete(self) -> dict[str, float]:
        """Parameter -> when it was last updated, for the parameters with no update pending
        (what :class:`mlfabric.ps.overlap.ParameterGate` reads, as of a pull's arrivals)."""
        with self._cond:
            return {k: self._updated_at[k] for k in self.params if self._reduced[k] == self._produced[k]}

    def wait(self, keys: Iterable[str] | None = None, *, timeout: float | None = None, who: str = "") -> None:
        """Block until ``keys`` (default: every parameter) have no update pending; raises the
        comm thread's error, or :class:`mlfabric.CollectiveTimeoutError` (a TimeoutError)
        after ``timeout`` (default ``timeout_s``) naming
        what is pending and what the comm thread is doing."""
        keys = list(self.params if keys is None else keys)
        unknown = [k for k in keys if k not in self.params]
        if unknown:
            raise KeyError(f"rank {self.rank}: no trainable parameter named {unknown[0]!r}")
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                pending = [k for k in keys if self._reduced[k] != self._produced[k]]
                if not pending:
                    return
                if self._closed:
                    raise RuntimeError(f"rank {self.rank}: OrderedAllreduce is closed with updates of "
                                       f"{pending[:3]} pending")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: {who or 'synchronize'} waited {limit:.1f}s for the reduced gradient of "
                        f"parameter {pending[0]!r} ({len(pending)} pending); the comm thread is {self._doing}. "
                        "A peer that is slow or gone fails its allreduce with its name; a parameter whose "
                        "gradient never came means it was unused in the backward (unsupported)", rank=self.rank)
                self._cond.wait(left)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every gradient produced so far is reduced and applied."""
        self.wait(timeout=timeout, who="synchronize")

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every per-parameter optimizer."""
        for opt in self._optimizers.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def close(self) -> None:
        """Stop the comm thread (after the updates in flight) and remove the hooks; idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "OrderedAllreduce":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = ("fifo" if self.priorities is None else "priority") if self.calibrated else "calibrating"
        return (f"OrderedAllreduce(rank={self.rank}, params={len(self.params)}, partitions={len(self.partitions)}, "
                f"order={kind}, credit={self.credit}, iterations={self.iterations})")

    # -- hooks ---------------------------------------------------------------------------------

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._produced[name] != self._reduced[name]:
                    raise RuntimeError(
                        f"rank {self.rank}: parameter {name!r} got a new gradient before its previous one was "
                        "reduced: run each backward after a forward through the gated model, or call "
                        "synchronize() between backward passes (gradient accumulation is not supported)")
                if param.grad is not None and not param.grad.is_contiguous():
                    param.grad = param.grad.contiguous()  # the partitions are views of the flat gradient
                self._ready_at[name] = time.monotonic() if self._grad_ready_at is None else self._grad_ready_at(name)
                self._produced[name] += 1
                self._cond.notify_all()
        return hook

    def _gate_hook(self, module: str, own: list[str]) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self.wait(own, who=f"the forward of module {module!r}")
        return hook

    # -- the comm thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._run_iteration():
                pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next wait
            with self._cond:
                self._error = e
                self._doing = f"stopped by {type(e).__name__}: {e}"
                self._cond.notify_all()

    def _run_iteration(self) -> bool:
        """Reduce and apply one backward's gradients in ``self.order``; False once closed."""
        calibrating = not self.calibrated
        in_flight: deque[tuple[Partition, list[float], torch.futures.Future]] = deque()
        left = dict(self._parts_of)
        timeline: list[tuple[Partition, float, list[float]]] = []  # calibration: issued, [done]
        for part in self.order:
            if not all(self._await_gradient(k) for k in part.params):
                return False
            while len(in_flight) >= self.credit:
                self._complete(in_flight.popleft(), left)
            issued = time.monotonic()
            future = self.comm.allreduce_async(self._buffer(part), self.algorithm, "avg")
            done: list[float] = []  # when it completed (the first of the callback and the waiter)
            if calibrating:
                future.add_done_callback(lambda _f, done=done: done.append(time.monotonic()))
                timeline.append((part, issued, done))
            in_flight.append((part, done, future))
        while in_flight:
            self._complete(in_flight.popleft(), left)
        self.iterations += 1
        if calibrating:
            self._measure(timeline)
            if self.iterations >= CALIBRATION_ITERATIONS:
                self._calibrate()
        self._doing = "waiting for the next backward"
        return True

    def _await_gradient(self, name: str) -> bool:
        """Wait (as long as the caller computes) for this iteration's gradient of ``name``,
        then until the instant it counts as ready; False once closed."""
        with self._cond:
            while self._produced[name] == self._reduced[name]:
                self._doing = f"waiting for this rank's backward to produce the gradient of parameter {name!r}"
                if self._closed:
                    return False
                self._cond.wait()
            ready_at = self._ready_at[name]
        if not self.calibrated:  # kept now: once applied, the next backward overwrites _ready_at
            self.ready_s[name] = ready_at
        late = ready_at - time.monotonic()
        if late > 0:  # an emulated accelerator's backward has not produced it yet
            time.sleep(late)
        return True

    def _complete(self, item: tuple[Partition, list[float], torch.futures.Future], left: dict[str, int]) -> None:
        part, done, future = item
        self._doing = f"in the allreduce of partition {part.name}"
        reduced = future.wait()
        done.append(time.monotonic())  # (a callback may not have run yet when the wait returns)
        if len(part.segments) > 1:  # a fused partition: back into the gradients
            at = 0
            for name, _, numel in part.segments:
                self._grad_view(name, 0, numel).copy_(reduced[at:at + numel])
                at += numel
        for name in part.params:
            left[name] -= 1
            if not left[name]:
                self._apply(name)

    def _grad_view(self, name: str, offset: int, numel: int) -> torch.Tensor:
        grad = self.params[name].grad
        assert grad is not None  # the hook saw it
        return grad.view(-1)[offset:offset + numel]

    def _buffer(self, part: Partition) -> torch.Tensor:
        """What to allreduce in place: a view of the gradient, or the fused parameters' copy."""
        if len(part.segments) == 1:
            return self._grad_view(*part.segments[0])
        return torch.cat([self._grad_view(*segment) for segment in part.segments])

    def _apply(self, name: str) -> None:
        """Every partition of ``name`` is reduced: its optimizer steps; the forward may use it."""
        self._optimizers[name].step()
        self.params[name].grad = None
        with self._cond:
            self._reduced[name] += 1
            self._updated_at[name] = time.monotonic()
            self._cond.notify_all()

    def _measure(self, timeline: list[tuple[Partition, float, list[float]]]) -> None:
        """One calibration iteration: each partition's hold on the link (its completion after
        the previous one's, or after its issue if the link was idle), least so far."""
        previous = -float("inf")
        for part, issued, done in timeline:
            held = done[0] - max(previous, issued)
            self.service_s[part] = min(self.service_s.get(part, held), held)
            previous = done[0]

    def _calibrate(self) -> None:
        """After the calibration: rank 0 computes the order from what it measured (as DDP
        rebuilds its buckets in the order the first backward produced them) and broadcasts
        it, so every rank issues the same order."""
        start = min(self.ready_s.values())
        self.ready_s = {k: t - start for k, t in self.ready_s.items()}
        index = {p: i for i, p in enumerate(self.partitions)}
        chosen = torch.zeros(len(self.partitions), dtype=torch.int64)
        if self.rank == 0:
            if self.priorities is None:
                order = fifo_order(self.partitions, self.ready_s)
            else:
                order = priority_order(self.partitions, self.ready_s, self.priorities, self.service_s.__getitem__)
            chosen = torch.tensor([index[p] for p in order], dtype=torch.int64)
        self._doing = "receiving the calibrated order from rank 0"
        self.comm.broadcast(chosen, root=0)
        if sorted(chosen.tolist()) != list(range(len(self.partitions))):
            raise RuntimeError(f"rank {self.rank}: the order broadcast by rank 0 is not a permutation of this "
                               "rank's partitions (the ranks' models differ?)")
        self.order = [self.partitions[i] for i in chosen.tolist()]
        self.calibrated = True

    def _check_same_everywhere(self, model: nn.Module) -> None:
        """Every rank must cut and order the same partitions: compare a fingerprint of the
        parameters and options (one allgather at construction) and name a rank that differs."""
        text = repr(([(k, tuple(p.shape), str(p.dtype)) for k, p in self.params.items()], self.partition_bytes,
                     self.credit, self.algorithm, sorted((self.priorities or {}).items())))
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        everyone = self.comm.allgather(torch.tensor([digest], dtype=torch.int64))[:, 0].tolist()
        differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
        if differ:
            raise ValueError(f"rank {self.rank}: OrderedAllreduce differs between ranks 0 and {differ[0]} "
                             "(parameters, shapes, dtypes, priorities, partition_bytes, credit or algorithm): "
                             "construct it with the same model and options on every rank")
