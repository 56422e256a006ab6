"""eager-SGD: keep training while one worker straggles (partial allreduce, eager-SGD §4).

    torchrun --nproc-per-node=4 examples/eager_sgd.py --quorum majority --straggler-ms 40
    torchrun --nproc-per-node=4 examples/eager_sgd.py --quorum all       # synchronous, for comparison

Every step, one rank drawn at random (the same draw on every rank: eager-SGD's "one random
worker delayed" injection) sleeps ``--straggler-ms`` before its backward pass (a slow GPU, a
busy host). With ``--quorum all`` every step waits for that step's straggler; with ``solo``
or ``majority`` the others go on with the gradients that are ready, and the straggler's late
gradient joins a later round (it is never dropped), so a rank is slowed only on the steps
where it is the straggler itself. ``synchronize()`` at the end averages the models and
leaves the same one on every rank, which the script checks.
Rank 0 prints the time per step, the loss, and how many ranks each round had on average.
"""

from __future__ import annotations

import argparse
import time

import torch

import mlfabric
import mlfabric.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quorum", default="majority", choices=["solo", "majority", "all"])
    parser.add_argument("--straggler-ms", type=float, default=40.0, help="extra time of one random rank per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    args = parser.parse_args()

    comm = mlfabric.init()
    torch.manual_seed(comm.rank)
    # A least-squares problem every rank samples from: y = x @ w_true + noise.
    w_true = torch.linspace(-1.0, 1.0, 16)
    model = torch.nn.Linear(16, 1, bias=False)
    eager = mlfabric.torch.EagerSGD(torch.optim.SGD(model.parameters(), lr=0.05), model, comm,
                                    quorum=args.quorum, sync_every_epochs=0)  # averaged once, at the end
    draws = torch.Generator().manual_seed(1)  # the same straggler sequence on every rank
    start = time.perf_counter()
    for _ in range(args.epochs):
        for _ in range(args.steps):
            x = torch.randn(32, 16)
            y = x @ w_true + 0.01 * torch.randn(32)
            eager.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            straggler = int(torch.randint(comm.world_size, (1,), generator=draws))
            if comm.rank == straggler and comm.world_size > 1:
                time.sleep(args.straggler_ms / 1000)
            loss.backward()
            eager.step()
        eager.epoch_end()
    elapsed = time.perf_counter() - start
    eager.synchronize()                       # the same model everywhere before evaluating

    weights = comm.allgather(model.weight.detach().flatten())
    same = bool(torch.allclose(weights, weights[0].expand_as(weights), rtol=0, atol=1e-6))
    error = float((model.weight.detach().flatten() - w_true).norm())
    steps = args.epochs * args.steps
    if comm.rank == 0:
        stats = eager.stats
        print(f"{comm.world_size} ranks, quorum={args.quorum}, straggler +{args.straggler_ms:g} ms: "
              f"{1000 * elapsed / steps:.1f} ms/step, |w - w_true| = {error:.4f}, "
              f"mean active ranks per round {stats.mean_active:.2f}, "
              f"rank 0 contributed to {stats.contributed_fraction:.0%} of its rounds; replicas identical: {same}")
    comm.close()
    if not same:
        raise SystemExit("replicas differ after synchronize()")


if __name__ == "__main__":
    main()
