"""PyTorch integration: DDP communication hooks (and, later, optimizers)."""

from .hooks import HookState, allreduce_hook

__all__ = ["HookState", "allreduce_hook"]
