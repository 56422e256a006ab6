"""DDP communication hook: let mlfabric allreduce DDP's gradient buckets.

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(mlfabric.torch.HookState(comm, algorithm="ring"),
                           mlfabric.torch.allreduce_hook)

DDP still needs a torch.distributed process group for its own bookkeeping (parameter
broadcast at construction, bucket rebuilding); only the gradient traffic goes through
mlfabric. Like DDP's default hook the result is the average over ranks.

DDP inspects the hook's annotations at registration, so this module does not use
``from __future__ import annotations``.

Exercise it with ``python -m pytest tests/local/test_ddp_hook.py``.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlfabric.runtime.communicator import Communicator


@dataclass
class HookState:
    """What the hook needs: the communicator, the algorithm, and counters for monitoring."""

    comm: Communicator
    algorithm: str = "ring"
    buckets_reduced: int = field(default=0, init=False)
    bytes_reduced: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.comm, Communicator):
            raise TypeError(f"HookState needs an mlfabric Communicator, got {type(self.comm).__name__}")
        from mlfabric.collectives import choose_allreduce

        choose_allreduce(self.algorithm, 0, self.comm.world_size)  # reject unknown names now


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s flat gradient buffer over all ranks with mlfabric."""
    buffer = bucket.buffer()
    state.buckets_reduced += 1
    state.bytes_reduced += buffer.numel() * buffer.element_size()
    return state.comm.allreduce_async(buffer, algorithm=state.algorithm, op="avg")
