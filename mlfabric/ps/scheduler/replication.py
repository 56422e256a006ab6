"""MLfabric's replication step (§5.3): which of a batch's updates reach the replica, when, and
whether the server's last update must wait for them -- so that the replica, applying the
server's order, is never more than Div_max behind.

    .venv/bin/python -m pytest tests/unit/test_ps_replication.py -q

Input: the batch's *units* in the server's application order (a unit is what the server
applies as one version: a direct update, or an aggregate of several), each with its members'
hosts and sizes, its norm bound and its tentative commit time at the server; the units earlier
batches *punted* (not yet at the replica, in order, ahead of this batch's); the network state
left after the tentative server schedules (server transfers keep priority: replica transfers
use what they leave); the replica's host and its ``k'`` aggregators.

1. *Tentative replica schedules*: every unit, in order, is sent toward the replica -- a
   single-member unit straight from its worker, a multi-member unit through a replica
   aggregator (round robin over the ``k'``), which sums it and forwards it once its last
   member is in. The replica applies units in order, so a unit commits there at
   ``max(its arrival, the previous unit's commit)``.
2. At ``T_last`` (the batch's last commit at the server) the server leads the replica by the
   units not committed there by then. If Div_max allows that lead (:mod:`mlfabric.ps.divergence`,
   eq. (11) from the units' norms and the replica's history norm), the units committed by
   ``T_last`` are *frozen* (their transfers stand) and the rest are *punted* to the next
   batch (their transfers are not made: the next batch plans them again, with its own).
3. Otherwise the server's *last* unit is delayed to start after the replica has committed
   ``a_e``, the first unit of the replica schedule whose commit brings the lead within the
   bound (the lead then counts the last server unit and the units after ``a_e``); units up to
   ``a_e`` are frozen, the rest punted. If even ``a_e`` = everything before the last unit does
   not bring the lead within the bound (one unit alone is over Div_max), the plan says so
   (``violated``): no schedule can meet it.

Decisions where the paper is vague (docs/mlfabric_scheduler.md): replica aggregators sum only
within a unit -- merging two of the server's versions into one would not give the server's
model under momentum (eq. (2) is not linear in the order of application); the replica's
history norm is bounded recursively from the units' norms (``||h'|| <= gamma ||h|| + ||u||``);
with several replicas each is planned in turn on the network the previous ones left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mlfabric.ps.divergence import DivergenceBound
from mlfabric.ps.scheduler.netstate import NetState, Transfer

__all__ = ["ReplicaUnit", "ReplicationPlan", "plan_replication"]


@dataclass(frozen=True, kw_only=True)
class ReplicaUnit:
    """One version the server applies: ``members`` as ``(worker host, bytes)``, ``norm`` a
    bound of its update's norm (:func:`mlfabric.ps.divergence.update_norm`)."""

    key: int
    members: tuple[tuple[int, float], ...]
    norm: float

    def __post_init__(self) -> None:
        if not self.members or any(size <= 0 for _, size in self.members) or self.norm < 0:
            raise ValueError(f"unit {self.key}: needs members of positive size and a norm >= 0")


@dataclass(frozen=True, kw_only=True)
class ReplicationPlan:
    frozen: tuple[int, ...]
    """Unit keys the replica gets in this batch (a prefix of punted + batch units, in order)."""
    punted: tuple[ReplicaUnit, ...]
    """Units left for the next batch, in order."""
    transfers: dict[int, tuple[Transfer, ...]] = field(repr=False)
    """Per frozen unit: its members' transfers (to the replica or its aggregator) and the aggregate's."""
    replica_commit: dict[int, float] = field(repr=False)
    t_last: float
    delay_last_until: float | None
    """When the server's last unit may start (step 3), None if it keeps its schedule."""
    lead_norms: tuple[float, ...]
    """Norms of the units the server leads by at ``t_last`` (after a delay, if any)."""
    estimate: float
    """Eq. (11) for that lead (the replica's history norm included)."""
    history_norm: float
    """Bound of the replica's history norm after the frozen units (carry to the next batch)."""
    violated: bool = False


def _estimate(bound: DivergenceBound, history_norm: float, lead: Sequence[float], momentum: float) -> float:
    from mlfabric.ps.divergence import estimate_divergence

    return float(len(lead)) if bound.updates is not None else estimate_divergence(history_norm, lead, momentum)


def plan_replication(net: NetState, *, units: Sequence[ReplicaUnit], punted: Sequence[ReplicaUnit],
                     server_commit: Sequence[float], replica: int, aggregators: Sequence[int],
                     bound: DivergenceBound, momentum: float, history_norm: float,
                     start: float) -> ReplicationPlan:
    """§5.3 for one replica (module docstring). ``units`` and ``server_commit`` are this
    batch's, in the server's order; ``net`` is the state after the server's tentative
    schedules and is not changed (the caller reserves ``transfers`` of the frozen units)."""
    if len(units) != len(server_commit):
        raise ValueError("one tentative server commit time per unit")
    order = list(punted) + list(units)
    keys = [u.key for u in order]
    if len(set(keys)) != len(keys):
        raise ValueError("unit keys must be distinct")
    probe = net.fork()
    transfers: dict[int, tuple[Transfer, ...]] = {}
    commit: list[float] = []
    last = start
    for i, unit in enumerate(order):
        if len(unit.members) == 1:
            host, size = unit.members[0]
            trs = (probe.reserve(host, replica, size, start),)
            arrival = trs[0].end
        else:
            if not aggregators:
                raise ValueError(f"unit {unit.key} aggregates {len(unit.members)} updates: the replica needs "
                                 "aggregators (k' >= 1)")
            agg = aggregators[i % len(aggregators)]
            member_trs = tuple(probe.reserve(host, agg, size, start) for host, size in unit.members)
            ready = max(t.end for t in member_trs)
            out = probe.reserve(agg, replica, max(size for _, size in unit.members), ready)
            trs, arrival = (*member_trs, out), out.end
        transfers[unit.key] = trs
        last = max(last, arrival)
        commit.append(last)
    t_last = max(server_commit, default=start)
    norms = [u.norm for u in order]
    # the server, by T_last, has applied every punted unit and every unit of the batch
    done = sum(1 for c in commit if c <= t_last)
    lead = norms[done:]
    h = history_norm
    delay = None
    violated = False
    if _estimate(bound, _history_after(h, norms[:done], momentum), lead, momentum) > _threshold(bound):
        # step 3: hold the server's last unit until the replica has committed a_e
        frozen_to = None
        for e in range(done, len(order) - 1):  # a_e before the last unit (the server's, delayed)
            lead_e = norms[e + 1:]
            if _estimate(bound, _history_after(h, norms[:e + 1], momentum), lead_e, momentum) <= _threshold(bound):
                frozen_to = e + 1
                break
        if frozen_to is None:
            violated = True
            frozen_to = len(order) - 1 if order else 0
        done = frozen_to
        delay = commit[done - 1] if done else start
        lead = norms[done:]
    h_after = _history_after(h, norms[:done], momentum)
    return ReplicationPlan(
        frozen=tuple(keys[:done]), punted=tuple(order[done:]),
        transfers={k: transfers[k] for k in keys[:done]},
        replica_commit={k: commit[i] for i, k in enumerate(keys[:done])},
        t_last=t_last, delay_last_until=delay, lead_norms=tuple(lead),
        estimate=_estimate(bound, h_after, lead, momentum), history_norm=h_after, violated=violated)


def _threshold(bound: DivergenceBound) -> float:
    return float(bound.updates) if bound.updates is not None else float(bound.norm)  # type: ignore[arg-type]


def _history_after(history_norm: float, norms: Sequence[float], momentum: float) -> float:
    """A bound of the update history's norm after applying units of these norms (eq. (2):
    ``h' = gamma h + u``)."""
    h = history_norm
    for n in norms:
        h = momentum * h + n
    return h
