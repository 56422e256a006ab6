"""Executor (progress thread), rendezvous and the Communicator."""

from .communicator import DEFAULT_TIMEOUT_S, Communicator
from .executor import Executor, RunInfo

__all__ = ["DEFAULT_TIMEOUT_S", "Communicator", "Executor", "RunInfo"]
