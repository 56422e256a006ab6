"""TicTac on the parameter server: each worker's tensors arrive in the order its forward needs them.

    torchrun --nproc-per-node=3 examples/tictac_ps.py                 # 1 server, 2 workers, BSP
    torchrun --nproc-per-node=5 examples/tictac_ps.py --steps 40 --heuristic tao

Rank 0 serves; every other rank trains the Inception-like CNN of :mod:`mlfabric.order.models`
on synthetic images. The workers register TicTac's priorities with the model
(:func:`mlfabric.order.parameter_priorities`: TIO, or TAO with a time oracle, on the DAG
that eager PyTorch runs); each step pulls the model per tensor in that order
(``pull_in_order``), and :class:`mlfabric.ps.overlap.ParameterGate` starts each module's
forward as soon as its own parameters are in, while the rest are still on the wire. Each
worker prints its first and last loss, how many tensors arrived out of order (0: the
server enforces the order) and whether the last step's tensors came in priority order.
"""

from __future__ import annotations

import argparse
import sys

import torch

import mlfabric.ps
from mlfabric.order import forward_dag, parameter_priorities
from mlfabric.order.models import build
from mlfabric.ps.overlap import ParameterGate, call_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--heuristic", choices=("tio", "tao"), default="tio")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    job = mlfabric.ps.init(servers=1, consistency="bsp", timeout=60)
    try:
        if job.role != "worker":
            stats = job.serve()
            print(f"{job.layout.describe(job.rank)}: {stats.updates_applied} updates applied, {stats.pulls} pulls")
            return
        worker = job.worker
        model, (example,) = build("inception", seed=0, batch=8)  # the same initial model on every worker
        # TAO's oracle: this CPU's compute, transfers at an assumed 100 Mbit/s share of the server's NIC.
        priorities = parameter_priorities(model, (example,), heuristic=args.heuristic, rate_bytes_per_s=12.5e6)
        worker.init_model("net", model, lr=args.lr, priorities=priorities)
        gate = ParameterGate(model, node_names=call_names(forward_dag(model, (example,)).graph_module))
        g = torch.Generator().manual_seed(100 + worker.index)  # each worker's own samples
        losses = []
        arriving = None
        for step in range(args.steps):
            x = torch.randn(8, 3, 32, 32, generator=g)
            y = (x.mean(dim=(1, 2, 3)) > 0).long()  # a learnable synthetic label
            # Returns at once; tensors land in model. clock=True: the previous step's clock goes
            # with the pull, so the server that it lets answer finds this pull already there.
            arriving = worker.pull_in_order("net", model, clock=step > 0)
            gate.attach(arriving)
            loss = torch.nn.functional.cross_entropy(model(x), y)  # each module waits for its own tensors
            model.zero_grad()
            loss.backward()
            worker.push("net", model)
            losses.append(loss.item())
        worker.clock()
        gate.remove()
        assert arriving is not None
        arriving.join()
        arrived = [a.key for a in arriving.arrivals]
        in_order = arrived == sorted(arrived, key=lambda k: (priorities[k], arrived.index(k)))
        # One write per line: the workers share torchrun's stdout.
        sys.stdout.write(f"{job.layout.describe(job.rank)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                         f"{arriving.reordered} tensors out of order, last step in priority order: {in_order}\n")
        sys.stdout.flush()
    finally:
        job.close()


if __name__ == "__main__":
    main()
