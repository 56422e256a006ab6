"""PyTorch integration: DDP communication hooks and the eager-SGD optimizer wrapper."""

from .eager_sgd import EagerSGD, EagerStats
from .hooks import HookState, allreduce_hook

__all__ = ["EagerSGD", "EagerStats", "HookState", "allreduce_hook"]
