"""Minimal mlfabric script; runs unchanged on one process, under torchrun, across machines.

    torchrun --nproc-per-node=4 examples/allreduce.py
"""

import torch

import mlfabric


def main() -> None:
    comm = mlfabric.init()
    t = torch.full((1_000_000,), float(comm.rank))
    comm.allreduce(t, algorithm="ring", op="sum")
    expected = sum(range(comm.world_size))
    assert torch.all(t == expected), t[:4]
    stacked = comm.allgather(torch.tensor([comm.rank]))
    if comm.rank == 0:
        print(f"{comm!r}: allreduce ok (every element = {expected}), allgather {stacked.flatten().tolist()}")
    comm.close()


if __name__ == "__main__":
    main()
