"""TicTac's priorities on allreduce training: gradients reduced in the order the next forward needs them.

    torchrun --nproc-per-node=2 examples/ordered_allreduce.py
    torchrun --nproc-per-node=4 examples/ordered_allreduce.py --steps 40 --order fifo

Every rank trains the VGG-like CNN of :mod:`mlfabric.order.models` on its own synthetic
images, data-parallel. :class:`mlfabric.torch.OrderedAllreduce` takes the place of DDP and
the optimizer: the backward's hooks hand each gradient to a comm thread that averages them
over the ranks in partitions (ByteScheduler-style), in TIO's priority order after two
calibration steps (``--order tio``, the default) or first come first served (``--order
fifo``, DDP's), steps each parameter's optimizer as soon as it is reduced, and the next
forward starts each module once its own parameters are updated. There is no
``optimizer.step()`` and no ``zero_grad()`` in the loop. Each rank prints its first and last
loss, the order's first partitions and a fingerprint of its parameters (the same on every
rank: they trained one model).
"""

from __future__ import annotations

import argparse
import sys

import torch

import mlfabric
from mlfabric.order import parameter_priorities
from mlfabric.order.models import build
from mlfabric.torch import OrderedAllreduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--order", choices=("tio", "fifo"), default="tio")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    comm = mlfabric.init(timeout=60)  # the torchrun variables say who and where
    model, (example,) = build("vgg", seed=0, batch=8)  # the same initial model on every rank
    priorities = parameter_priorities(model, (example,)) if args.order == "tio" else None
    g = torch.Generator().manual_seed(100 + comm.rank)  # each rank's own samples
    losses = []
    with OrderedAllreduce(model, comm, torch.optim.SGD, lr=args.lr, priorities=priorities,
                          partition_bytes=256 * 1024) as opt:
        for _ in range(args.steps):
            x = torch.randn(8, 3, 32, 32, generator=g)
            y = (x.mean(dim=(1, 2, 3)) > 0).long()  # a learnable synthetic label
            loss = torch.nn.functional.cross_entropy(model(x), y)  # each module waits for its update
            loss.backward()                                         # the hooks hand the gradients over
            losses.append(loss.item())
        opt.synchronize()  # every update applied before the parameters are read
        first = ", ".join(p.name for p in opt.order[:3])
    fingerprint = sum(float(p.detach().double().sum()) for p in model.parameters())
    # One write per line: the ranks share torchrun's stdout.
    sys.stdout.write(f"rank {comm.rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {args.order} order starts "
                     f"{first}; parameter fingerprint {fingerprint:.6f}\n")
    sys.stdout.flush()
    comm.close()


if __name__ == "__main__":
    main()
