"""Training through a parameter server: one server, the other ranks workers (MLNET / MLfabric PS).

    torchrun --nproc-per-node=4 examples/ps_train.py --consistency ssp:2
    torchrun --nproc-per-node=4 examples/ps_train.py --consistency bsp      # synchronous SGD
    torchrun --nproc-per-node=5 examples/ps_train.py --servers 2 --consistency async:4

Rank 0 (and 1 with ``--servers 2``) serves; every other rank is a worker that trains a
linear model on its own samples of one least-squares problem with
:class:`mlfabric.torch.PSOptimizer`: push the gradient, clock, pull the model (the pull waits
as the consistency model says). The servers print their statistics (updates applied and
dropped, the delay histogram), the workers their final loss.
"""

from __future__ import annotations

import argparse
import sys

import torch

import mlfabric.ps
import mlfabric.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--consistency", default="ssp:2", help="bsp, ssp:S, async or async:TAU")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    job = mlfabric.ps.init(servers=args.servers, consistency=args.consistency, timeout=60)
    try:
        if job.role != "worker":
            stats = job.serve()
            print(f"{job.layout.describe(job.rank)}: {stats.updates_applied} updates applied, "
                  f"{stats.dropped} dropped, delays {dict(sorted(stats.delays.items()))}")
            return
        worker = job.worker
        torch.manual_seed(0)  # the same initial model on every worker
        model = torch.nn.Linear(16, 1, bias=False)
        ps = mlfabric.torch.PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, worker)
        g = torch.Generator().manual_seed(100 + worker.index)  # each worker's own samples
        w_true = torch.linspace(-1.0, 1.0, 16)
        for _ in range(args.steps):
            x = torch.randn(32, 16, generator=g)
            y = x @ w_true + 0.01 * torch.randn(32, generator=g)
            ps.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            ps.step()
        error = float((model.weight.detach().squeeze(0) - w_true).norm())
        # One write per line: the workers share torchrun's stdout.
        sys.stdout.write(f"{job.layout.describe(job.rank)}: last loss {loss.item():.4f}, |w - w_true| {error:.4f}, "
                         f"pulls {worker.stats.pulls}\n")
        sys.stdout.flush()
    finally:
        job.close()


if __name__ == "__main__":
    main()
