"""The ``direct`` policy: every worker sends each server its component; each server answers each pull.

    .venv/bin/python -m pytest tests/unit/test_ps.py -q

BASELINE in MLNET, vanilla Async in MLfabric. It is :class:`mlfabric.ps.policy.Policy` itself
(the seam's defaults are this behaviour); this module names and registers it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlfabric.ps.policy import Policy, register_policy

if TYPE_CHECKING:
    from mlfabric.ps.config import PSConfig


class DirectRouting(Policy):
    name = "direct"
    takes_back_workers = True  # nothing per worker to rebuild: a restarted worker may rejoin


def _factory(config: "PSConfig") -> Policy:
    return DirectRouting()


register_policy("direct", _factory)

__all__ = ["DirectRouting"]
