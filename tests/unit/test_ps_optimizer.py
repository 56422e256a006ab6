"""PSOptimizer on threads: in BSP it is synchronous data-parallel SGD exactly; bad optimizers
are refused with the reason.

    python -m pytest tests/unit/test_ps_optimizer.py -q
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs
from mlfabric.torch import PSOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batches(worker: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + worker)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]


def synchronous_sgd(ref: torch.nn.Module, batches: list[list[tuple[torch.Tensor, torch.Tensor]]],
                    device: torch.device | None = None) -> torch.Tensor:
    """The reference: one model (SGD, lr 0.1, momentum 0.9) stepping on the mean of the
    workers' gradients (``batches[w][step]``); its final parameters, flat, on the CPU."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(batches[0])):
        grads = []
        for worker_batches in batches:
            ref.zero_grad()
            x, y = worker_batches[step]
            torch.nn.functional.mse_loss(ref(x.to(device)), y.to(device)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
    return torch.nn.utils.parameters_to_vector(ref.parameters()).detach().cpu()


def test_bsp_ps_optimizer_matches_synchronous_sgd() -> None:
    workers, steps = 3, 5
    layout = PSLayout(servers=2, workers=workers)
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=10))
    finals: dict[int, torch.Tensor] = {}
    # Built here, not in the threads: torch's global generator is shared by threads, so models
    # built concurrently after manual_seed differ (the test then compared with another start).
    initial = _model()

    def work(job) -> None:  # noqa: ANN001
        if job.role == "server":
            job.serve()
            return
        model = copy.deepcopy(initial)
        ps = PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, job.worker)
        for x, y in _batches(job.worker.index, steps):
            ps.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            ps.step()
        finals[job.worker.index] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        ps.leave()

    threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for j in jobs:
        j.comm.close()
    expected = synchronous_sgd(_model(), [_batches(w, steps) for w in range(workers)])
    assert sorted(finals) == [0, 1, 2]
    for final in finals.values():
        torch.testing.assert_close(final, expected, rtol=1e-5, atol=1e-6)


def test_refuses_what_the_servers_cannot_apply() -> None:
    layout = PSLayout(servers=1, workers=1)
    jobs = local_jobs(layout, PSConfig(timeout_s=5))
    model = _model()
    try:
        with pytest.raises(TypeError, match="needs torch.optim.SGD"):
            PSOptimizer(torch.optim.Adam(model.parameters()), model, jobs[1].worker)
        with pytest.raises(ValueError, match="weight_decay"):
            PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4), model, jobs[1].worker)
        with pytest.raises(TypeError, match="PSWorker"):
            PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, jobs[0].comm)
    finally:
        for j in jobs:
            j.comm.close()


@pytest.mark.parametrize("keep", [False, True])
def test_a_gradient_the_scheduler_dropped_is_carried_only_when_asked(keep: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """push() returns False for an update MLfabric's scheduler dropped; keep_dropped adds it to
    the next step's gradient (LDA's deltas), otherwise it is lost (SGD, as the paper does)."""
    from mlfabric.ps.worker import PSWorker

    push = PSWorker.push
    calls = []

    def first_dropped(self: PSWorker, *args: object, **kwargs: object) -> bool:
        calls.append(args)
        if len(calls) == 1:
            return False  # what a scheduler drop looks like to the caller: nothing sent
        return push(self, *args, **kwargs)

    monkeypatch.setattr(PSWorker, "push", first_dropped)
    layout = PSLayout(servers=1, workers=1)
    jobs = local_jobs(layout, PSConfig(consistency="async", timeout_s=10))
    server = threading.Thread(target=jobs[0].serve, daemon=True)
    server.start()
    try:
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        ps = PSOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, jobs[1].worker, keep_dropped=keep)
        for g in (1.0, 2.0):
            ps.zero_grad()
            model.weight.grad = torch.full((1, 4), g)
            ps.step()
        ps.leave()
    finally:
        server.join(5)
        for j in jobs:
            j.comm.close()
    expected = -3.0 if keep else -2.0  # lr 1, one worker (weight 1): minus what reached the server
    assert model.weight.detach().tolist() == [[expected] * 4]
