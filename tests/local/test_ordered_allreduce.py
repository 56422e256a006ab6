"""OrderedAllreduce: the same training as synchronous SGD, a calibrated priority order that
every rank shares, and fast, named failures.

Run: python -m pytest tests/local/test_ordered_allreduce.py
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import mlfabric
from mlfabric.order import parameter_priorities
from mlfabric.torch import OrderedAllreduce

pytestmark = pytest.mark.local

LR = 0.05


def _build() -> nn.Module:
    # A small first layer and a large last one: the backward hands the big one over first.
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4096))


torch.manual_seed(0)
_INITIAL = _build().state_dict()


def _model() -> nn.Module:
    """The same initial model on every rank (the ranks are threads: no global seeding here)."""
    model = _build()
    model.load_state_dict(_INITIAL)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4096, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _reference(world: int, steps: int, optimizer: type = torch.optim.SGD, **options: float) -> list[torch.Tensor]:
    """Plain synchronous training on the mean of the ranks' losses (= the average gradient)."""
    model = _model()
    opt = optimizer(model.parameters(), **(options or {"lr": LR}))
    for step in range(steps):
        opt.zero_grad()
        sum(_loss(model, *_batch(r, step)) for r in range(world)).div(world).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(comm: mlfabric.Communicator, steps: int, prioritised: bool) -> tuple[list[torch.Tensor], list, bool]:
    model = _model()
    priorities = parameter_priorities(model, (_batch(0, 0)[0],)) if prioritised else None
    with OrderedAllreduce(model, comm, torch.optim.SGD, lr=LR, priorities=priorities,
                          partition_bytes=4096, timeout_s=30) as opt:
        for step in range(steps):
            _loss(model, *_batch(comm.rank, step)).backward()
        opt.synchronize()
        assert opt.iterations == steps
        return [p.detach().clone() for p in model.parameters()], list(opt.order), opt.calibrated


@pytest.mark.parametrize("prioritised", [False, True], ids=["fifo", "priority"])
def test_training_equals_synchronous_sgd_and_every_rank_shares_the_order(prioritised: bool) -> None:
    steps = 4
    results = mlfabric.run_threads(3, lambda comm: _train(comm, steps, prioritised), timeout=60)
    expected = _reference(3, steps)
    for params, _, calibrated in results:
        assert calibrated
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    orders = [order for _, order, _ in results]
    assert orders[0] == orders[1] == orders[2]
    names = [p.params[-1] for p in orders[0]]
    # The two small layers are fused into one partition (under 4096 bytes); the last layer's
    # weight (256 KiB) is cut into 64 and its bias into 4.
    assert [p.params for p in orders[0]].count(("0.weight", "0.bias", "2.weight", "2.bias")) == 1
    assert names.count("4.weight") == 64 and names.count("4.bias") == 4 and len(names) == 69
    if not prioritised:  # DDP's order: the last layer's partitions first, the first layers last
        assert set(names[:68]) == {"4.weight", "4.bias"} and names[-1] == "2.bias", names
    else:  # the first layers overtake the last layer's queue of partitions
        first_layers = names.index("2.bias")
        last_layer = max(i for i, n in enumerate(names) if n == "4.weight")
        assert names[0].startswith("4.") and first_layers < last_layer, names


def test_the_forward_waits_for_its_own_layer_only() -> None:
    """With the priority order, the first layer is updated while the last layer's gradient
    is still being reduced: the next forward starts before everything is applied."""

    def run(comm: mlfabric.Communicator) -> list[float]:
        model = _model()
        priorities = parameter_priorities(model, (_batch(0, 0)[0],))
        seen: list[float] = []
        with OrderedAllreduce(model, comm, lr=LR, priorities=priorities, partition_bytes=1024, credit=1) as opt:
            model[0].register_forward_pre_hook(lambda *_: seen.append(
                sum(1 for k in opt.params if k not in opt.complete)), prepend=False)
            for step in range(4):
                _loss(model, *_batch(comm.rank, step)).backward()
            opt.synchronize()
        return seen

    pending = mlfabric.run_threads(2, run, timeout=60)
    # Iterations 2-3 run the calibrated order: the first layer's forward started with the
    # last layer's update still pending on at least one rank.
    assert any(p[2] > 0 or p[3] > 0 for p in pending), pending


def test_ranks_that_disagree_fail_at_construction_naming_a_rank() -> None:
    def run(comm: mlfabric.Communicator) -> str:
        try:
            OrderedAllreduce(_model(), comm, lr=LR, partition_bytes=4096 * (1 + comm.rank))
        except ValueError as exc:
            return str(exc)
        return "constructed"

    messages = mlfabric.run_threads(2, run, timeout=30)
    assert all("differs between ranks 0 and 1" in m for m in messages), messages


@pytest.mark.parametrize("optimizer, options", [(torch.optim.SGD, {"lr": LR, "momentum": 0.9}),
                                                (torch.optim.Adam, {"lr": 1e-3})], ids=["sgd-momentum", "adam"])
def test_per_parameter_optimizers_equal_the_whole_model_optimizer(optimizer: type, options: dict) -> None:
    """One optimizer per parameter, stepped when that parameter is reduced, is the same as
    one optimizer over the model for optimizers whose update is per parameter."""

    def run(comm: mlfabric.Communicator) -> list[torch.Tensor]:
        model = _model()
        with OrderedAllreduce(model, comm, optimizer, partition_bytes=4096, **options) as opt:
            for step in range(4):
                _loss(model, *_batch(comm.rank, step)).backward()
            opt.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    expected = _reference(2, 4, optimizer, **options)
    for params in mlfabric.run_threads(2, run, timeout=60):
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_rank_that_leaves_is_named_by_the_others_within_seconds() -> None:
    def run(comm: mlfabric.Communicator) -> tuple[str, float]:
        model = _model()
        opt = OrderedAllreduce(model, comm, lr=LR, partition_bytes=4096, timeout_s=60)
        _loss(model, *_batch(comm.rank, 0)).backward()
        opt.synchronize()
        if comm.rank == 1:
            opt.close()
            comm.close()
            return "left", 0.0
        start = time.monotonic()
        try:
            _loss(model, *_batch(comm.rank, 1)).backward()  # its allreduce has no peer
            model(_batch(comm.rank, 2)[0])                    # the gate raises the comm thread's error
        except mlfabric.MlfabricError as exc:
            return f"{type(exc).__name__}: {exc}", time.monotonic() - start
        finally:
            opt.close()
        return "completed", time.monotonic() - start

    results = mlfabric.run_threads(2, run, timeout=60)
    message, elapsed = results[0]
    assert message.startswith("PeerLeftError") and "rank 1" in message, message
    assert elapsed < 5.0, results[0]


def test_a_second_backward_before_the_update_is_an_error() -> None:
    comm = mlfabric.local_world(1)[0]
    model = _model()
    with OrderedAllreduce(model, comm, lr=LR, gate=False) as opt:
        x, y = _batch(0, 0)
        loss = _loss(model, x, y)
        loss.backward(retain_graph=True)
        opt.synchronize()
        # Accumulating a second gradient into one being reduced would corrupt it: with the
        # comm thread held up, the hook refuses.
        with opt._cond:
            opt._produced["4.weight"] += 1  # as if this rank's previous gradient were still in flight
            with pytest.raises(RuntimeError, match="new gradient before its previous one was reduced"):
                opt._grad_hook("4.weight")(model[4].weight)
            opt._produced["4.weight"] -= 1
    comm.close()


def test_a_wait_that_times_out_says_what_is_pending_and_what_the_comm_thread_does() -> None:
    comms = mlfabric.local_world(2, timeout=30)
    models = [_model(), _model()]
    opts: list[OrderedAllreduce] = [None, None]  # type: ignore[list-item]

    def make(r: int) -> None:
        opts[r] = OrderedAllreduce(models[r], comms[r], lr=LR, partition_bytes=4096)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    _loss(models[0], *_batch(0, 0)).backward()  # rank 1 never runs its backward
    with pytest.raises(mlfabric.CollectiveTimeoutError,
                       match=r"rank 0: synchronize waited 0.3s .* parameter '0.weight' .* in the allreduce of partition "
                       r"4.bias\[0:1024\]") as raised:
        opts[0].synchronize(timeout=0.3)
    assert raised.value.rank == 0 and isinstance(raised.value, TimeoutError)
    for opt, comm in zip(opts, comms):
        comm.close()
        opt.close()


def test_unknown_priorities_and_bad_options_are_refused() -> None:
    comm = mlfabric.local_world(1)[0]
    with pytest.raises(ValueError, match=r"no priority for parameter\(s\) \['0.bias'"):
        OrderedAllreduce(_model(), comm, priorities={"0.weight": 0})
    with pytest.raises(ValueError, match="credit"):
        OrderedAllreduce(_model(), comm, credit=0)
    with pytest.raises(TypeError, match="Communicator"):
        OrderedAllreduce(_model(), object())  # type: ignore[arg-type]
    comm.close()


def test_set_lr_reaches_every_per_parameter_optimizer() -> None:
    comm = mlfabric.local_world(1)[0]
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with OrderedAllreduce(model, comm, lr=LR, partition_bytes=4096) as opt:
        opt.set_lr(0.0)  # a learning rate of 0: a step changes nothing
        _loss(model, *_batch(0, 0)).backward()
        opt.synchronize()
        assert opt.iterations == 1 and all(p.grad is None for p in model.parameters())  # applied and cleared
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        opt.set_lr(LR)
        _loss(model, *_batch(0, 1)).backward()
        opt.synchronize()
        assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    comm.close()
