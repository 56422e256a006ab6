"""Elastic data-parallel training with mlfabric.torch.Elastic: kill a worker, the others go on;
start it again, it joins and receives the model and optimizer state.

    # a store that outlives the workers (here: its own process)
    python examples/elastic.py store --port 29650 &
    # three workers, each started by hand (or each under its own torchrun: see docs/elastic.md)
    for m in 0 1 2; do python examples/elastic.py worker --port 29650 --member $m --initial 0,1,2 & done
    kill -9 <pid of member 1>            # members 0 and 2 go on at once
    python examples/elastic.py worker --port 29650 --member 1   # joins the running job

    # or each rank under its own torchrun, restarted by it when it dies (it then joins):
    torchrun --nproc-per-node 1 --max-restarts 1 --master-port 29661 examples/elastic.py worker \
        --port 29650 --member 1 --initial 0,1,2

    # --ddp: the model runs as torch's DistributedDataParallel over the "mlfabric" backend's
    # elastic process group (Elastic.ddp()); the gradients are allreduced during backward

Each worker prints one line per membership change and, at the end, its step count, loss and
a checksum of its parameters: every worker alive at the end prints the same checksum.
Exercised by ``python -m pytest tests/local/test_elastic_processes.py -k torchrun`` (with and
without ``--ddp``).
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from mlfabric.runtime.membership import JobFinishedError
from mlfabric.torch.elastic import Elastic


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of 96 samples, this rank's share of it."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(96, 16, generator=gen)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    return x[rank::world_size], y[rank::world_size]


def worker(args: argparse.Namespace) -> None:
    print(f"member {args.member}: process {os.getpid()} started", flush=True)
    store = dist.TCPStore(args.host, args.port, is_master=False, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    initial = [int(m) for m in args.initial.split(",")] if args.initial else None
    try:
        elastic = Elastic(model, optimizer, store=store, member=args.member, initial=initial, timeout=30)
    except JobFinishedError as exc:
        print(exc, flush=True)
        return
    # DDP over the elastic group (or the wrapper's own allreduce): the loop is the same.
    net = elastic.ddp() if args.ddp else model
    if args.ddp:
        print(f"member {args.member}: DDP over {elastic.process_group!r}", flush=True)
    seen = -1
    loss = torch.tensor(float("nan"))
    while elastic.committed < args.steps:
        if elastic.comm.epoch != seen:
            seen = elastic.comm.epoch
            print(f"member {args.member}: epoch {seen}, members {list(elastic.members)}, at step {elastic.committed}",
                  flush=True)
        x, y = batch(elastic.committed, elastic.rank, elastic.world_size)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        time.sleep(args.step_time)  # stands in for a real model's compute
        if args.ddp:
            elastic.step()  # every rank's batch is the same size: DDP averages ranks equally
        else:
            elastic.step(weight=len(x))
    elastic.finish()
    _, state = elastic.pack()
    print(f"member {args.member}: done {elastic.committed} steps with members {list(elastic.members)}, "
          f"loss {loss.item():.4f}, aborted {elastic.aborted}, state crc32 {zlib.crc32(state.numpy()):#010x}", flush=True)
    elastic.close()


def serve(args: argparse.Namespace) -> None:
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False)
    print(f"store on {args.host}:{store.port}", flush=True)
    time.sleep(args.serve_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    for name in ("store", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=29650)
        if name == "store":
            p.add_argument("--serve-s", type=float, default=3600.0, help="how long to serve")
        else:
            p.add_argument("--member", type=int, required=True, help="this worker's stable id")
            p.add_argument("--initial", default="", help="the first members' ids (omit to join a running job)")
            p.add_argument("--steps", type=int, default=200)
            p.add_argument("--step-time", type=float, default=0.02, help="seconds of emulated compute per step")
            p.add_argument("--ddp", action="store_true",
                           help="train through torch's DistributedDataParallel over the elastic group")
    args = parser.parse_args()
    (serve if args.role == "store" else worker)(args)


if __name__ == "__main__":
    main()
