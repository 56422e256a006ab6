"""A late rank on an emulated cluster, measured and simulated side by side.

    sudo mlfabric launch --hosts 4 --topology star --rate 1gbit -- \
        python examples/late_rank.py --rate 1gbit --late 200ms

Every iteration the ranks line up (a small allreduce), the last rank waits ``--late`` (a
straggler), and all run one ring allreduce of ``--size``; each rank times its own call.
Rank 0 then simulates the same schedule (same pipelining chunks, same rates, the last rank
starting ``--late`` after the others) with ``mlfabric.sim`` and prints, per rank, the
emulated median next to the simulated time. In a ring the ranks downstream of the late one
finish later than those upstream of it, and by about ``--late``, not more: messages queued
for the late rank move one at a time over its TCP stream (as the simulator models them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mlfabric
from mlfabric.sim import ComputeModel, simulate_collective
from mlfabric.units import parse_duration, parse_rate, parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="the emulated NIC rate (for the simulation)")
    parser.add_argument("--late", default="200ms", help="how late the last rank starts")
    parser.add_argument("--size", default="64MB", help="allreduce size (float32)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    rate, late, size = parse_rate(args.rate), parse_duration(args.late), int(parse_size(args.size))

    comm = mlfabric.init()
    world, count = comm.world_size, size // 4
    data = torch.ones(count)
    times = []
    for _ in range(args.iters):
        comm.allreduce(torch.ones(1), algorithm="tree")  # line up
        start = time.perf_counter()
        if comm.rank == world - 1:
            time.sleep(late)
        comm.allreduce(data, algorithm="ring")
        times.append(time.perf_counter() - start)
    assert torch.all(data == world ** args.iters)  # every call summed the world's data
    medians = comm.allgather(torch.tensor([statistics.median(times)], dtype=torch.float64)).flatten()

    if comm.rank == 0:
        options = comm.ring_options("ring", data)  # the pipelining the communicator used
        speeds = (1e12,) * (world - 1) + (1.0,)  # only the last rank "computes" (waits)
        compute = ComputeModel(compute_s=late, speeds=speeds) if late > 0 else None
        sim = simulate_collective("ring", f"star:n={world}", rate, size_bytes=count * 4, compute=compute, **options)
        simulated = sim.rank_finish_s()
        print(f"ring allreduce of {args.size} on {world} ranks at {args.rate}, rank {world - 1} late by {args.late} "
              f"({options.get('chunks', 'default')} chunks per segment)")
        print("rank  emulated ms  simulated ms  emulated/simulated")
        for rank in range(world):
            print(f"{rank:>4}  {medians[rank] * 1e3:11.1f}  {simulated[rank] * 1e3:12.1f}  "
                  f"{medians[rank] / simulated[rank]:18.3f}")
        print(f"makespan: emulated {medians.max() * 1e3:.1f} ms, simulated {sim.time_s * 1e3:.1f} ms")
        print("(a rank's call returns once its last message is in its socket buffer; the simulator counts a "
              "send as done when it is delivered, so a rank that ends on a send can finish earlier emulated)")
    comm.close()


if __name__ == "__main__":
    main()
