"""The ``scheduled`` policy's settings and the small rules its roles share.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py -q

(:mod:`mlfabric.ps.policies.scheduled` describes the policy.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mlfabric.ps.divergence import DivergenceBound

log = logging.getLogger("mlfabric.ps")

DEFAULT_RATE_BPS = 10e9  # what the scheduler assumes of a NIC nobody reported (bit/s)
REPLICATION_MODES = ("chain", "network")
#: The cut-through unit of #36's trees: small against an update (a 100 MB update is ~100
#: chunks, so a tree of depth d adds d% of a transfer), large enough that a chunk's header and
#: per-message cost stay negligible.
DEFAULT_CHUNK_BYTES = 1 << 20
UNITS_PER_BATCH = 1_000_000  # a replica unit's key: batch * this + its entry's position


def unit_scheduler(key: int) -> int:
    """The rank of the scheduler that planned replica unit ``key`` (its batches are numbered
    from ``1 + (rank << 20)``)."""
    return (key // UNITS_PER_BATCH) >> 20


@dataclass(frozen=True, kw_only=True)
class ScheduledSettings:
    """``interval_s``: batching period. ``aggregators``: k aggregators (worker hosts) per
    server, 0 for none. ``rate_bps``: every NIC's line rate (bit/s) when known
    (``MLFABRIC_NIC_RATE``, the emulator's); ``monitor_lag_s``: how late the scheduler sees
    a NIC's measured rate (§7's t_lag). ``decision_timeout_s``: how long a worker waits for
    its decision before pushing unscheduled; ``slack_s``: how long a server waits past an
    entry's planned commit before skipping it.

    Replicas (MLfabric-A only): ``replication`` ``"chain"`` (the baseline: the server forwards
    every update it applies) or ``"network"`` (§5.3: the workers send copies of their
    updates to the replica, through ``replica_aggregators`` k' worker hosts, as the scheduler
    plans them so that the replica never lags the server by more than ``divergence``,
    Div_max; module docstring "Replication"). ``measure_divergence``: the servers send their
    model to their replicas at every batch end, which compare it with theirs (the true
    divergence, and the eq. (11) estimate beside it; costs a model per batch on the server's
    NIC, counted apart).

    #36 (defaults: today's design): ``trees`` plans each batch's aggregation as multi-level
    pipelined trees over the worker hosts chosen from the residual bandwidths
    (:mod:`mlfabric.ps.scheduler.trees`) and distributes each model version down a pipelined
    multicast tree (``PullBatchPlan.tree``), False keeps Alg. 3's one level and §10.3's one
    level of distributors; ``chunk_bytes``: the cut-through unit of those trees (a node
    forwards chunk i once it has chunk i from every input; used with ``trees``);
    ``workers_per_host``: co-located workers whose updates are summed on their host (no NIC)
    into one host request (``Request.members``), and whose host receives the model once."""

    interval_s: float = 0.1
    aggregators: int = 2
    #: k°: distributors earmarked per batch of pulls (§10.3); 0 answers every pull directly.
    distributors: int = 2
    rate_bps: float = DEFAULT_RATE_BPS
    monitor_lag_s: float = 0.2
    decision_timeout_s: float = 2.0
    slack_s: float = 1.0
    replication: str = "chain"
    divergence: DivergenceBound | None = None
    replica_aggregators: int = 1
    measure_divergence: bool = False
    trees: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    workers_per_host: int = 1

    def __post_init__(self) -> None:
        check_tree_settings(self.chunk_bytes, self.workers_per_host)
        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {', '.join(REPLICATION_MODES)}, got {self.replication!r}")
        if self.replication == "network" and self.divergence is None:
            raise ValueError("replication 'network' needs a divergence bound (Div_max: a norm such as 0.5, or a "
                             "number of updates such as 30u)")
        if self.replica_aggregators < 0:
            raise ValueError(f"replica_aggregators must be >= 0, got {self.replica_aggregators}")
        for name in ("interval_s", "rate_bps", "decision_timeout_s", "slack_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decision_timeout_s <= self.interval_s:
            log.warning("decision_timeout_s (%g) <= interval_s (%g): workers will push unscheduled before most "
                        "batches are planned", self.decision_timeout_s, self.interval_s)
        if self.aggregators < 0 or self.distributors < 0 or self.monitor_lag_s < 0:
            raise ValueError(f"aggregators, distributors and monitor_lag_s must be >= 0, got {self.aggregators}, "
                             f"{self.distributors}, {self.monitor_lag_s}")


def check_tree_settings(chunk_bytes: int, workers_per_host: int) -> None:
    """Raise on a ``chunk_bytes`` < 0 or a ``workers_per_host`` < 1 (shared by the runtime's
    and the simulator's settings)."""
    if int(chunk_bytes) != chunk_bytes or chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be an integer >= 0 (0: store-and-forward), got {chunk_bytes}")
    if int(workers_per_host) != workers_per_host or workers_per_host < 1:
        raise ValueError(f"workers_per_host must be an integer >= 1, got {workers_per_host}")


def host_of_rank(rank: int, workers_per_host: int, first: int = 1) -> int:
    """The host (the scheduler's network node) of worker ``rank`` when workers ``first,
    first+1, ...`` sit ``workers_per_host`` to a host, hosts numbered from ``first`` too:
    ranks ``first..first+k-1`` on host ``first``, the next ``k`` on ``first+1``, ..."""
    return first + (rank - first) // workers_per_host


def aggregator_ranks(workers: range, k: int) -> list[int]:
    """``k`` worker ranks spread evenly over the workers (every ``W/k``-th)."""
    w = len(workers)
    k = min(k, w)
    return [workers[(i * w) // k] for i in range(k)] if k else []


def avg_rate_bps(transfer: Any) -> float | None:
    """A planned transfer's mean rate in bit/s (what pacing enforces), None if it moves nothing."""
    if not transfer.times or transfer.end <= transfer.begin:
        return None
    return 8 * transfer.size / (transfer.end - transfer.begin)

