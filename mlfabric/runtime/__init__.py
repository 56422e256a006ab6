"""Executor (progress thread), rendezvous and the Communicator.

The names below are resolved on first use (:func:`mlfabric._lazy.lazy_exports`), so that
importing a light submodule (``mlfabric.runtime.fair_share``, as the emulator's launcher
does) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlfabric._lazy import lazy_exports

if TYPE_CHECKING:
    from .communicator import DEFAULT_TIMEOUT_S, Communicator
    from .executor import Executor, RunInfo

__all__ = ["DEFAULT_TIMEOUT_S", "Communicator", "Executor", "RunInfo"]
__getattr__ = lazy_exports(__name__, {"DEFAULT_TIMEOUT_S": "communicator", "Communicator": "communicator",
                                      "Executor": "executor", "RunInfo": "executor"})
