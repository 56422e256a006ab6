"""PyTorch integration: the "mlfabric" torch.distributed backend, DDP communication hooks, the
eager-SGD and parameter-server optimizer wrappers, the priority-ordered gradient allreduce, and
elastic training (``Elastic``: a lost rank costs a step; docs/elastic.md)."""

from .backend import MlfabricWork, ProcessGroupMlfabric, ProcessGroupOptions
from .eager_sgd import EagerSGD, EagerStats
from .elastic import Elastic, ElasticProcessGroup
from .hooks import HookState, allreduce_hook
from .ordered_allreduce import OrderedAllreduce
from .ps_optimizer import PSOptimizer

__all__ = ["EagerSGD", "EagerStats", "Elastic", "ElasticProcessGroup", "HookState", "MlfabricWork", "OrderedAllreduce", "PSOptimizer", "ProcessGroupMlfabric",
           "ProcessGroupOptions", "allreduce_hook"]
