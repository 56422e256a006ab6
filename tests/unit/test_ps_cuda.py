"""The parameter server with a model on a CUDA device: PSOptimizer stages gradients and
parameters through host memory, and BSP stays synchronous SGD exactly. Skips without CUDA;
runs on the lent GPU machine as a plain script too:

    python -m pytest tests/unit/test_ps_cuda.py -q
    PYTHONPATH=. python3 tests/unit/test_ps_cuda.py
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs
from mlfabric.torch import PSOptimizer

from test_ps_optimizer import synchronous_sgd  # noqa: E402 - the same reference, on the GPU

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bsp_on_cuda_parameters_equals_synchronous_sgd() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    batches = [[(torch.randn(8, 32), torch.randn(8, 1)) for _ in range(4)] for _ in range(2)]
    jobs = local_jobs(PSLayout(servers=2, workers=2), PSConfig(consistency="bsp", timeout_s=30))
    finals: dict[int, torch.Tensor] = {}

    def work(job) -> None:  # noqa: ANN001
        if job.role == "server":
            job.serve()
            return
        model = copy.deepcopy(initial).to(device)
        ps = PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, job.worker)
        for x, y in batches[job.worker.index]:
            ps.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            ps.step()
        assert all(p.is_cuda for p in model.parameters())
        finals[job.worker.index] = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
        ps.leave()

    threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for j in jobs:
        j.comm.close()
    expected = synchronous_sgd(copy.deepcopy(initial).to(device), batches, device)
    assert sorted(finals) == [0, 1]
    for final in finals.values():
        torch.testing.assert_close(final, expected, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    test_bsp_on_cuda_parameters_equals_synchronous_sgd()
    print("cuda PS check passed on", torch.cuda.get_device_name(0), "torch", torch.__version__)
