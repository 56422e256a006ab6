"""A plain PyTorch DDP (or FSDP2) training script; one word picks mlfabric as its backend.

    torchrun --nproc-per-node=2 examples/torch_backend.py --backend mlfabric
    torchrun --nproc-per-node=2 examples/torch_backend.py --backend gloo          # the same run on gloo
    torchrun --nproc-per-node=2 examples/torch_backend.py --backend mlfabric --fsdp
    MLFABRIC_ALGORITHM=halving_doubling torchrun --nproc-per-node=2 examples/torch_backend.py

Nothing below is mlfabric-specific except ``import mlfabric`` (which registers the backend;
with mlfabric installed, torch's entry point does it even without the import): DDP's
gradient buckets, its parameter broadcast, FSDP2's all-gathers and reduce-scatters and the
final all_reduce all run on mlfabric's collectives. The model is a small MLP on the synthetic
classification task of ``mlfabric.train.data`` (a random teacher network labels Gaussian
inputs), so nothing is downloaded. Rank 0 prints the loss per epoch, a
fingerprint of the trained parameters (the same on "mlfabric" and on "gloo") and whether every
rank holds exactly the same parameters. On several machines (one torchrun per machine,
docs/multi_node.md)::

    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 --rdzv-id job1 \\
        examples/torch_backend.py --backend mlfabric
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import mlfabric  # noqa: F401 - registers the "mlfabric" torch.distributed backend
from mlfabric.train.data import DataConfig, make_dataset, shard

TASK = DataConfig(features=32, classes=4, train_samples=2048, test_samples=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="mlfabric", help="torch.distributed backend: mlfabric or gloo")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of DDP")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # torchrun's env:// variables
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # one initial model (DDP would broadcast rank 0's anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)

    data = make_dataset(TASK)  # the same on every rank; each trains on its shard
    inputs, labels = shard(data.train_x, data.train_y, rank, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(args.epochs):
        total = torch.zeros(1)
        for start in range(0, len(inputs), args.batch):
            x, y = inputs[start:start + args.batch], labels[start:start + args.batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(x)
        dist.all_reduce(total)  # the mean loss over every rank's shard
        losses.append(total.item() / (len(inputs) * world_size))

    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
    fingerprint = sum(float(p.double().abs().sum()) for p in params)
    # Every rank must end with the same model: the element-wise max and min over the ranks
    # (min as -max(-x)) both equal this rank's parameters exactly.
    flat = torch.cat([p.reshape(-1) for p in params]).double()
    high, low = flat.clone(), -flat
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    identical = torch.equal(high, flat) and torch.equal(-low, flat)
    if rank == 0:
        print(f"backend={dist.get_backend()} {'fsdp2' if args.fsdp else 'ddp'} {world_size} ranks: loss per epoch "
              f"{', '.join(f'{loss:.4f}' for loss in losses)}; parameter fingerprint {fingerprint:.6f}; "
              f"replicas identical: {identical}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
