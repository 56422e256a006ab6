"""PyTorch integration: DDP communication hooks, the eager-SGD and parameter-server optimizer wrappers."""

from .eager_sgd import EagerSGD, EagerStats
from .hooks import HookState, allreduce_hook
from .ps_optimizer import PSOptimizer

__all__ = ["EagerSGD", "EagerStats", "HookState", "PSOptimizer", "allreduce_hook"]
