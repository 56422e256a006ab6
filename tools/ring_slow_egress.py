"""An emulated ring with one slow NIC: how much of a synchronous iteration's compute the ring's
buffered sends overlap (the measurement behind the simulator's pipelined RR-Sync,
docs/simulator.md "Pipelined synchronous iterations").

    sudo .venv/bin/mlfabric launch --hosts 8 --rate 1gbit -- .venv/bin/python tools/ring_slow_egress.py

Each rank runs ``--iterations`` of "sleep ``--compute``, then allreduce ``--size`` bytes on the
ring" (synchronous SGD without the model), after rank ``--slow-rank`` has set its own egress
to ``--slow-rate`` (``tc class change`` on its emulated NIC, as the emulator's churn does).
Rank 0 prints the loop's time per iteration, the slow rank's egress throughput over the loop,
and the two models: compute + the ring at its bottleneck (iteration by iteration, what the
simulator assumed before) and the bottleneck's work alone (the slow NIC never idles).
Per-call times are not the figure: a rank returns from its allreduce as soon as its own
receives are in, before the slow NIC has drained what it queued.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

import mlfabric


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4_447_784, help="bytes per allreduce (LeNet-5's gradient)")
    parser.add_argument("--compute", type=float, default=0.07, help="seconds of emulated compute per iteration")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-rate", type=float, default=250e6, help="bit/s of the slow rank's egress")
    parser.add_argument("--dev", default="eth0", help="the emulated host's NIC")
    args = parser.parse_args()

    comm = mlfabric.init()
    n = comm.world_size
    if comm.rank == args.slow_rank:
        rate = int(args.slow_rate)
        burst = max(64 * 1024 + 1514, rate // 8 // 1000)  # the emulator's HTB burst for this rate
        subprocess.run(["tc", "class", "change", "dev", args.dev, "parent", "1:", "classid", "1:1", "htb",
                        "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", str(burst), "cburst", str(burst)],
                       check=True)
    grad = torch.ones(args.size // 4)
    comm.barrier()
    tx_path = f"/sys/class/net/{args.dev}/statistics/tx_bytes"
    sent_before = int(open(tx_path).read())
    start = time.perf_counter()
    for _ in range(args.iterations):
        time.sleep(args.compute)
        comm.allreduce(grad, algorithm="ring", op="avg")
    comm.barrier()
    loop = time.perf_counter() - start
    sent = int(open(tx_path).read()) - sent_before
    egress = comm.allgather(torch.tensor([sent * 8 / loop]))
    if comm.rank == 0:
        work = 2 * (n - 1) / n * args.size * 8 / args.slow_rate
        print(f"{n} ranks, {args.size} B ring, rank {args.slow_rank}'s egress at {args.slow_rate / 1e6:g} Mbit/s, "
              f"{args.compute * 1e3:g} ms compute: {loop / args.iterations * 1e3:.0f} ms an iteration; "
              f"the slow egress carried {egress.flatten()[args.slow_rank].item() / 1e6:.0f} Mbit/s over the loop; "
              f"compute + the ring at its bottleneck {(args.compute + work) * 1e3:.0f} ms, "
              f"the bottleneck's work alone {work * 1e3:.0f} ms")
    comm.close()


if __name__ == "__main__":
    main()
