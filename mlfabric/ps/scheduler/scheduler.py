"""The scheduler facade: a batch of update requests in, one decision per update out.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q -k facade

:class:`Scheduler` turns :class:`UpdateRequest` s (worker host, bytes per server component,
model version the update was computed from, norm) plus the server's current version,
``tau_max``, the network state and the aggregator hosts into a :class:`BatchSchedule`: for
every update a :class:`Decision` (dropped or not, position in the application order, next
hop per server component, start, rate profiles, predicted ``t_en`` and commit time), and the
aggregates to send. It runs, in the paper's order (§5):

* MLfabric-A (``mode="async"``): Alg. 2 (deadlines ``dl = v(g) + tau_max - v_init``, eq. 9,
  look-ahead drops), then Alg. 3 choosing the split by ``obj_async`` (eq. 17);
* MLfabric-S (``mode="sync"``, §6): no deadlines and no drops. "Ordering does not apply",
  so the list handed to Alg. 3 is ours to choose: two candidate lists, Alg. 1's
  shortest-first and longest-first (``ordering.longest_first``), each partitioned by Alg. 3
  with the split chosen by ``obj_sync`` (eq. 16, the paper's line 24); the plan with the
  smaller makespan wins (ties: shortest-first). Why: docs/mlfabric_scheduler.md.

Deterministic: requests are processed in ``update_id`` order (whatever order they come in),
ties are broken by that order, and the only randomness, the pre-assignment of aggregators
to groups (§5.2), comes from ``numpy.random.default_rng((seed, version))``.
Replication (§5.3) is not part of this module (docs/mlfabric_scheduler.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from mlfabric.ps.scheduler.aggregation import AggregationResult, GroupPlan, Objective, aggregate
from mlfabric.ps.scheduler.netstate import NetState, Transfer
from mlfabric.ps.scheduler.ordering import Batch, OrderResult, list_order, longest_first, order_updates
from mlfabric.ps.scheduler.trees import tree_aggregate

__all__ = ["BatchSchedule", "Decision", "Plan", "Scheduler", "SchedulerConfig", "UpdateRequest", "plan_batch"]


@dataclass(frozen=True, kw_only=True)
class UpdateRequest:
    update_id: int
    worker: int
    """Host of the worker that pushes the update."""
    sizes: tuple[float, ...]
    """Bytes for each server (one component per server, §10.2)."""
    version: int
    """Model version the update was computed from."""
    norm: float = 0.0
    """``||u||`` (kept for the replication step's divergence bound, §5.3)."""
    count: int = 1
    """Worker updates summed in it (a host request, #36): the server applies it as ``count``
    versions, so the deadlines count positions of the batch's largest request (below)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    tau_max: int = 30
    mode: Literal["async", "sync"] = "async"
    aggregation: bool = True
    seed: int = 0
    trees: bool = False
    """#36: aggregation by pipelined trees over the members' hosts
    (:func:`mlfabric.ps.scheduler.trees.tree_aggregate`) instead of Alg. 3 (one-server
    batches; several servers keep Alg. 3). The ordering step is today's either way."""
    chunk_bytes: int = 0
    """The trees' cut-through chunk (0: store-and-forward)."""

    def __post_init__(self) -> None:
        if self.tau_max < 0:
            raise ValueError(f"tau_max must be >= 0, got {self.tau_max}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")


@dataclass(frozen=True, kw_only=True)
class Decision:
    update_id: int
    worker: int
    dropped: bool
    reason: str | None = None
    """Why it was dropped: ``doomed`` (deadline already passed), ``look-ahead`` (Fig. 5), ``no-capacity``."""
    position: int | None = None
    """1-based place in the batch's application order."""
    next_hop: tuple[int, ...] = ()
    """Per server component: the host to send to (the server's, or an aggregator's)."""
    group: int | None = None
    """0 = straight to the server(s); j = aggregated in group j."""
    start: float | None = None
    t_en: float | None = None
    """When the update's own bytes reach ``next_hop`` (max over components, eq. 18)."""
    commit: float | None = None
    """Predicted time the server applies it (an aggregate's arrival for aggregated updates)."""
    delay: int | None = None
    """Applied model version minus ``version`` (``v_init + position - version``): <= tau_max."""
    transfers: tuple[Transfer, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the pure pipeline returns (batch indices): ordering, then aggregation."""

    ordered: OrderResult
    aggregated: AggregationResult


@dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    decisions: tuple[Decision, ...]
    """Kept updates in application order, then the dropped ones (in ``update_id`` order)."""
    aggregates: tuple[GroupPlan, ...]
    """Members are ``update_id`` s; ``transfers`` go from the aggregator to the server(s)."""
    split: int
    obj_async: float
    obj_sync: float
    version: int

    def applied(self) -> list[Decision]:
        return [d for d in self.decisions if not d.dropped]

    def dropped(self) -> list[Decision]:
        return [d for d in self.decisions if d.dropped]


def plan_batch(batch: Batch, net: NetState, group_hosts: Sequence[Sequence[int]], *, objective: Objective,
               start: float = 0.0, native: bool | None = None) -> Plan:
    """Ordering (Alg. 2, or Alg. 1 when the batch has no deadlines) then aggregation (Alg. 3).

    For ``objective="sync"`` without deadlines (MLfabric-S) a second list, longest first, is
    partitioned too and the plan with the smaller ``obj_sync`` wins (ties: shortest first).
    ``native``: the compiled loops (None: when built and the batch has one server)."""
    ordered = order_updates(batch, net, start=start, native=native)
    plan = Plan(ordered=ordered, aggregated=aggregate(batch, ordered, group_hosts, objective=objective, start=start,
                                                      native=native))
    if objective == "sync" and batch.deadlines is None:
        # the makespan (eq. 16) of time-shared transfers is shortest when the long ones start
        # first; shortest-first stays a candidate, so this never does worse than Alg. 1's list
        lpt = list_order(batch, net, longest_first(batch, net), start=start, native=native)
        alt = aggregate(batch, lpt, group_hosts, objective=objective, start=start, native=native)
        if alt.obj_sync < plan.aggregated.obj_sync:
            plan = Plan(ordered=lpt, aggregated=alt)
    return plan


def fewest_hops(best: AggregationResult, batch: Batch, ordered: OrderResult, objective: Objective,
                start: float) -> AggregationResult:
    """``best``, unless sending every kept update straight to the server does as well: a
    detour through an aggregator that commits nothing earlier (a group of one, typically,
    in a small batch) only adds a hop and the aggregator's link to the path. Alg. 3 (and
    :func:`plan_batch`, kept equal to the reference) breaks ties towards aggregation, the
    smaller split; :class:`Scheduler`, what the runtime and the simulator run, prefers the
    direct path."""
    if best.split == len(ordered.order):
        return best
    direct = aggregate(batch, ordered, [], objective=objective, start=start)
    key = "obj_async" if objective == "async" else "obj_sync"
    return direct if getattr(direct, key) <= getattr(best, key) * (1 + 1e-12) else best


class Scheduler:
    """MLfabric's scheduler for one or more servers (hosts ``servers``)."""

    def __init__(self, config: SchedulerConfig, *, servers: Sequence[int],
                 aggregators: Sequence[int] | Sequence[Sequence[int]] = ()) -> None:
        self.config = config
        self.servers = tuple(int(s) for s in servers)
        if not self.servers:
            raise ValueError("at least one server host")
        aggs = [list(a) if isinstance(a, (list, tuple)) else [int(a)] * len(self.servers) for a in aggregators]
        # aggregators: a list of hosts shared by every server, or one list of hosts per group
        self.aggregators = [tuple(int(h) for h in a) for a in aggs]

    def group_hosts(self, version: int) -> list[tuple[int, ...]]:
        """The seeded random pre-assignment of aggregators to groups 1..k (§5.2)."""
        if not self.config.aggregation or not self.aggregators:
            return []
        perm = np.random.default_rng((self.config.seed, version)).permutation(len(self.aggregators))
        return [self.aggregators[int(i)] for i in perm]

    def batch(self, requests: Sequence[UpdateRequest], *, version: int) -> tuple[list[UpdateRequest], Batch]:
        reqs = sorted(requests, key=lambda r: r.update_id)
        if len({r.update_id for r in reqs}) != len(reqs):
            raise ValueError("update ids must be unique within a batch")
        for r in reqs:
            if len(r.sizes) != len(self.servers):
                raise ValueError(f"update {r.update_id}: {len(r.sizes)} sizes for {len(self.servers)} servers")
            if r.version > version:
                raise ValueError(f"update {r.update_id} was computed from version {r.version} > current {version}")
        deadlines = None
        if self.config.mode == "async":
            # A request of m worker updates takes m versions. Position p then lands at a
            # version <= v_init + M p (M: the batch's largest count), so dl // M positions
            # keep every member within tau_max; with single updates (M = 1) this is eq. 9.
            most = max((r.count for r in reqs), default=1)
            deadlines = tuple((r.version + self.config.tau_max - version) // most for r in reqs)
        sizes = np.array([r.sizes for r in reqs], dtype=float).reshape(len(reqs), len(self.servers))
        return reqs, Batch(src=tuple(r.worker for r in reqs), sizes=sizes, servers=self.servers, deadlines=deadlines)

    def schedule(self, requests: Sequence[UpdateRequest], *, version: int, network: NetState,
                 now: float | None = None) -> BatchSchedule:
        start = network.origin if now is None else float(now)
        reqs, batch = self.batch(requests, version=version)
        hosts = self.group_hosts(version)
        objective: Objective = "async" if self.config.mode == "async" else "sync"
        if self.config.trees and len(self.servers) == 1:
            # the same ordering (Alg. 2: order, drops, positions), aggregation by trees
            ordered = order_updates(batch, network, start=start)
            plan = Plan(ordered=ordered, aggregated=tree_aggregate(batch, ordered, net=network, objective=objective,
                                                                   start=start, chunk_bytes=self.config.chunk_bytes))
            agg = plan.aggregated
        else:
            plan = plan_batch(batch, network, hosts, objective=objective, start=start)
            agg = fewest_hops(plan.aggregated, batch, plan.ordered, objective, start)
        hop = agg.hop()
        groups = {grp.slot: grp for grp in agg.groups}
        position = {g: i + 1 for i, g in enumerate(plan.ordered.order)}
        applied_at: dict[int, int] = {}  # worker updates applied up to and including each position
        total = 0
        for g in plan.ordered.order:
            total += reqs[g].count
            applied_at[g] = total
        kept: list[Decision] = []
        dropped: list[Decision] = []
        for od in plan.ordered.decisions:
            r = reqs[od.index]
            if od.dropped:
                dropped.append(Decision(update_id=r.update_id, worker=r.worker, dropped=True, reason=od.reason))
                continue
            slot = hop[od.index]
            trs = agg.member_transfers[od.index]
            nh = self.servers if slot == 0 else groups[slot].hosts
            pos = position[od.index]
            kept.append(Decision(
                update_id=r.update_id, worker=r.worker, dropped=False, position=pos, next_hop=tuple(nh), group=slot,
                start=min((t.begin for t in trs), default=start), t_en=max((t.end for t in trs), default=start),
                commit=agg.commit[od.index], delay=version + applied_at[od.index] - r.version, transfers=trs))
        kept.sort(key=lambda d: d.position)
        dropped.sort(key=lambda d: d.update_id)
        aggregates = tuple(GroupPlan(slot=grp.slot, hosts=grp.hosts, members=tuple(reqs[g].update_id for g in grp.members),
                                     ready=grp.ready, transfers=grp.transfers, arrival=grp.arrival, commit=grp.commit,
                                     nodes=tuple(dataclasses.replace(n, members=tuple(reqs[g].update_id for g in n.members))
                                                 for n in grp.nodes), chunk_bytes=grp.chunk_bytes)
                           for grp in agg.groups)
        return BatchSchedule(decisions=tuple(kept + dropped), aggregates=aggregates, split=agg.split,
                             obj_async=agg.obj_async, obj_sync=agg.obj_sync, version=version)
