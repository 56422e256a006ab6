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
from .direct import direct_gather, direct_scatter, pairwise_all_to_all
from .halving_doubling import halving_doubling_allreduce
from .hierarchical import (
    HostLayout,
    host_hierarchical_allgather,
    host_hierarchical_allreduce,
    host_hierarchical_broadcast,
)
from .p2p_ps import p2p_ps_allreduce
from .partition import chunks_for
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from .striped import striped_copy
from .tree import binomial_broadcast, binomial_reduce, tree_allreduce

ALLREDUCE_ALGORITHMS: dict[str, Callable[..., Schedule]] = {
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "tree": tree_allreduce,
    "bcube": bcube_allreduce,
    "hierarchical": hierarchical_allreduce,
    "host_hierarchical": host_hierarchical_allreduce,
    "ps": p2p_ps_allreduce,
}

#: Algorithms that need the cluster's shape (BCube digits, switch hierarchy, the ranks'
#: hosts), given by the communicator; the partial collectives cannot run them.
SHAPED_ALGORITHMS = ("bcube", "hierarchical", "host_hierarchical")

# Below this many bytes latency dominates and halving-doubling's log2(N) steps win; above
# it ring's bandwidth-optimal pipelined steps win (cf. gloo's and MPICH's selection rules).
AUTO_RING_MIN_BYTES = 256 * 1024


def choose_allreduce(algorithm: str, nbytes: int, world_size: int, topology: str | None = None,
                     hosts: tuple[int, ...] | None = None) -> str:
    """Resolve ``"auto"`` and reject unknown names with the list of known ones.

    ``topology`` is the cluster's topology spec when known (``"bcube:n=3,k=2"``): on a BCube
    ``auto`` is BML, the only algorithm that talks to 1-hop neighbours only and uses every NIC.
    ``hosts`` is the host of every rank when known: a job over several hosts with several
    ranks each reduces inside the hosts first (``host_hierarchical``).
    """
    if algorithm == "auto":
        if topology is not None and topology.startswith("bcube:"):
            return "bcube"
        if hosts is not None and HostLayout(hosts, world_size).spans_multi_rank_hosts():
            return "host_hierarchical"
        return "ring" if nbytes >= AUTO_RING_MIN_BYTES else "halving_doubling"
    if algorithm not in ALLREDUCE_ALGORITHMS:
        known = ", ".join([*ALLREDUCE_ALGORITHMS, "auto"])
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of {known}")
    return algorithm


#: At most this many parts per call of an algorithm that pipelines in parts: each part adds
#: a full set of the algorithm's messages.
MAX_PARTS = 4


def pipeline_parts(algorithm: str, count: int, world_size: int, chunk_elements: int | None,
                   **shape: object) -> dict[str, int]:
    """The ``parts`` option for the algorithms that pipeline a call in parts (``bcube``: BML,
    ``ps``: the P2P parameter server), empty for the others: as many parts as keep the
    smallest message (one of BML's ``k n^k`` pieces, one of the PS's N shards) at least
    ``chunk_elements`` long, at most :data:`MAX_PARTS`. Without a pipelining chunk (hosts
    whose CPU is the bottleneck, where each message's fixed cost counts more than a NIC idle
    between steps) one part. ``shape``: BML's ``n`` and ``k``. The runtime, the simulator and
    the benchmarks all call this, so they run the same schedule."""
    if algorithm not in ("bcube", "ps"):
        return {}
    if chunk_elements is None:
        return {"parts": 1}
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    pieces_per_part = int(shape["k"]) * world_size if algorithm == "bcube" else world_size
    return {"parts": chunks_for(count // pieces_per_part, chunk_elements, MAX_PARTS)}


@lru_cache(maxsize=256)
def build(kind: str, world_size: int, rank: int, count: int, **options: object) -> Schedule:
    """The schedule of collective ``kind`` ("allreduce:<algorithm>", "broadcast", "reduce",
    "reduce_scatter", "allgather", "gather", "scatter", "all_to_all", "striped_copy") for one
    rank."""
    if kind.startswith("allreduce:"):
        return ALLREDUCE_ALGORITHMS[kind.split(":", 1)[1]](world_size, rank, count, **options)
    builders: dict[str, Callable[..., Schedule]] = {
        "broadcast:host_hierarchical": host_hierarchical_broadcast,
        "allgather:host_hierarchical": host_hierarchical_allgather,
        "broadcast": binomial_broadcast,
        "reduce": binomial_reduce,
        "reduce_scatter": ring_reduce_scatter,
        "allgather": ring_allgather,
        "gather": direct_gather,
        "scatter": direct_scatter,
        "all_to_all": pairwise_all_to_all,
        "striped_copy": striped_copy,
    }
    if kind not in builders:
        raise ValueError(f"unknown collective {kind!r}")
    return builders[kind](world_size, rank, count, **options)


__all__ = [
    "ALLREDUCE_ALGORITHMS", "AUTO_RING_MIN_BYTES", "MAX_PARTS", "bcube_allreduce", "binomial_broadcast",
    "binomial_reduce", "build", "choose_allreduce", "direct_gather", "direct_scatter",
    "halving_doubling_allreduce", "HostLayout", "SHAPED_ALGORITHMS", "host_hierarchical_allgather",
    "host_hierarchical_allreduce", "host_hierarchical_broadcast",
    "hierarchical_allreduce", "p2p_ps_allreduce", "pairwise_all_to_all", "pipeline_parts", "ring_allgather", "ring_allreduce",
    "ring_reduce_scatter", "striped_copy", "tree_allreduce",
]
