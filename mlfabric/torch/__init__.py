"""PyTorch integration: the "mlfabric" torch.distributed backend, DDP communication hooks, the
eager-SGD and parameter-server optimizer wrappers, and the priority-ordered gradient allreduce."""

from .backend import MlfabricWork, ProcessGroupMlfabric, ProcessGroupOptions
from .eager_sgd import EagerSGD, EagerStats
from .hooks import HookState, allreduce_hook
from .ordered_allreduce import OrderedAllreduce
from .ps_optimizer import PSOptimizer

__all__ = ["EagerSGD", "EagerStats", "HookState", "MlfabricWork", "OrderedAllreduce", "PSOptimizer", "ProcessGroupMlfabric",
           "ProcessGroupOptions", "allreduce_hook"]
