"""Collective algorithms, each written once as a schedule builder (one file per algorithm).

A builder is a pure function ``(world_size, rank, count, ...) -> Schedule``; the runtime,
the simulator and the tests all consume the same objects. ``build`` memoizes them, since a
training loop asks for the same schedule every step.

Exercise it with ``python -m pytest tests/unit/test_collectives.py``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from mlfabric.schedule import Schedule

from .bcube import bcube_allreduce, hierarchical_allreduce
from .halving_doubling import halving_doubling_allreduce
from .p2p_ps import p2p_ps_allreduce
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from .tree import binomial_broadcast, binomial_reduce, tree_allreduce

ALLREDUCE_ALGORITHMS: dict[str, Callable[..., Schedule]] = {
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "tree": tree_allreduce,
    "bcube": bcube_allreduce,
    "hierarchical": hierarchical_allreduce,
    "ps": p2p_ps_allreduce,
}

# Below this many bytes latency dominates and halving-doubling's log2(N) steps win; above
# it ring's bandwidth-optimal pipelined steps win (cf. gloo's and MPICH's selection rules).
AUTO_RING_MIN_BYTES = 256 * 1024


def choose_allreduce(algorithm: str, nbytes: int, world_size: int, topology: str | None = None) -> str:
    """Resolve ``"auto"`` and reject unknown names with the list of known ones.

    ``topology`` is the cluster's topology spec when known (``"bcube:n=3,k=2"``): on a BCube
    ``auto`` is BML, the only algorithm that talks to 1-hop neighbours only and uses every NIC.
    """
    if algorithm == "auto":
        if topology is not None and topology.startswith("bcube:"):
            return "bcube"
        return "ring" if nbytes >= AUTO_RING_MIN_BYTES else "halving_doubling"
    if algorithm not in ALLREDUCE_ALGORITHMS:
        known = ", ".join([*ALLREDUCE_ALGORITHMS, "auto"])
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of {known}")
    return algorithm


@lru_cache(maxsize=256)
def build(kind: str, world_size: int, rank: int, count: int, **options: object) -> Schedule:
    """The schedule of collective ``kind`` ("allreduce:<algorithm>", "broadcast",
    "reduce_scatter", "allgather") for one rank."""
    if kind.startswith("allreduce:"):
        return ALLREDUCE_ALGORITHMS[kind.split(":", 1)[1]](world_size, rank, count, **options)
    builders: dict[str, Callable[..., Schedule]] = {
        "broadcast": binomial_broadcast,
        "reduce": binomial_reduce,
        "reduce_scatter": ring_reduce_scatter,
        "allgather": ring_allgather,
    }
    if kind not in builders:
        raise ValueError(f"unknown collective {kind!r}")
    return builders[kind](world_size, rank, count, **options)


__all__ = [
    "ALLREDUCE_ALGORITHMS", "AUTO_RING_MIN_BYTES", "bcube_allreduce", "binomial_broadcast",
    "binomial_reduce", "build", "choose_allreduce", "halving_doubling_allreduce",
    "hierarchical_allreduce", "p2p_ps_allreduce", "ring_allgather", "ring_allreduce",
    "ring_reduce_scatter", "tree_allreduce",
]
