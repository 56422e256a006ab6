"""DDP training whose gradients move through mlfabric (a DDP communication hook).

    torchrun --nproc-per-node=2 examples/ddp_train.py [--algorithm ring|halving_doubling|tree|auto]
    sudo mlfabric launch --hosts 4 --topology star --rate 1gbit -- python examples/ddp_train.py

DDP keeps its own (gloo) process group for bookkeeping — parameter broadcast at
construction, unused-parameter detection — and hands every gradient bucket to
``mlfabric.torch.allreduce_hook``, which averages it with the chosen mlfabric algorithm.
The model is a small MLP on a synthetic classification task (each rank its own shard), so
the script needs nothing downloaded. At the end every rank checks that all replicas hold the
same parameters and rank 0 prints the loss curve.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import mlfabric
import mlfabric.torch


def synthetic_shard(rank: int, world_size: int, n: int = 2048, features: int = 32, classes: int = 4):
    """A fixed linearly separable-ish task (same for every rank), then this rank's shard."""
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, features, generator=generator) * 2.0
    labels = torch.randint(0, classes, (n,), generator=generator)
    inputs = centers[labels] + torch.randn(n, features, generator=generator)
    return inputs[rank::world_size], labels[rank::world_size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="ring", help="mlfabric allreduce algorithm for the gradients")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group("gloo")           # torchrun's env:// variables
    comm = mlfabric.init()                     # the same variables; its own connections
    torch.manual_seed(comm.rank)              # different init per rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = mlfabric.torch.HookState(comm, algorithm=args.algorithm)
    ddp.register_comm_hook(state, mlfabric.torch.allreduce_hook)

    inputs, labels = synthetic_shard(comm.rank, comm.world_size)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for epoch in range(args.epochs):
        total = 0.0
        for start in range(0, len(inputs), args.batch):
            x, y = inputs[start:start + args.batch], labels[start:start + args.batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()                   # buckets are averaged by mlfabric here
            optimizer.step()
            total += loss.item() * len(x)
        losses.append(total / len(inputs))

    # Every replica must hold the same parameters (the hook averaged the same gradients).
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = comm.allgather(flat)
    same = bool(torch.allclose(replicas, flat.expand_as(replicas), rtol=0, atol=1e-6))
    if comm.rank == 0:
        curve = ", ".join(f"{loss:.3f}" for loss in losses)
        print(f"{comm.world_size} ranks, algorithm={args.algorithm}: loss per epoch {curve}; "
              f"{state.buckets_reduced} buckets ({state.bytes_reduced / 1e6:.2f} MB) reduced by mlfabric; "
              f"replicas identical: {same}")
    comm.close()
    dist.destroy_process_group()
    if not same:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
