"""The ``scheduled`` policy: MLfabric's scheduler running for real, batches of update requests in, decisions out.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_network_replication.py -q

Split by role: :mod:`.settings` (the settings), :mod:`.core` (the decisions without I/O: batching
and planning, the server's batch orders, model distribution -- what the simulator drives
too), :mod:`.service` (the scheduler thread beside server 0), :mod:`.worker` (the worker
side), :mod:`.server` (the server side), :mod:`.aggregator` (the aggregator thread on every
worker). :class:`ScheduledRouting` is the policy object, both sides in one.

The ``scheduled`` routing policy (MLfabric §4) in three parts, each bounded in time. With
consistency ``async:TAU`` it is MLfabric-A; with ``bsp`` it is MLfabric-S (§6): a round's
updates are ordered and aggregated for the round's makespan (obj_sync), none is dropped, and
the server closes a round only when the updates the scheduler routed for it are in (or
``slack_s`` past their planned commit):

* **Scheduler** (:class:`SchedulerService`, a thread beside server 0, rank 0): workers send it
  a small request per update (its size per server, the model version it was computed from,
  its norm). Every ``interval_s`` (100 ms), or as soon as every worker still in the job has a
  request waiting (the batch cannot grow: a worker has one push outstanding), it plans the
  batch it holds with
  :class:`mlfabric.ps.scheduler.Scheduler` (the pure code the simulator and the benchmarks
  use too): order and drops (Alg. 2, ``tau_max``), aggregation (Alg. 3) on the network state
  the :class:`~mlfabric.ps.monitor.NetworkMonitor` reports minus what earlier batches still
  hold (:class:`~mlfabric.ps.monitor.Ledger`). It answers every worker (drop, or next hop per
  server component, start and rate), tells each aggregator its group, and tells each server
  the batch's application order.
* **Worker daemon** (:class:`ScheduledRouting`, in the pushing thread): asks, waits for the
  decision (at most ``decision_timeout_s``: then it pushes directly, unscheduled, and counts a
  fallback), starts each transfer when the schedule says, paced at its planned rate where the
  transport can pace. A server answers a worker's pull once the batch entries holding that
  worker's updates are applied (or skipped), as a direct push is applied before the pull
  that follows it: the worker computes its next update on a model with its own last one.
* **Aggregators** (:class:`Aggregator`, a thread on every worker): sum the members of a group
  and forward the sum to the server, after its last member or at the group's deadline with
  what arrived.
* **Model distribution** (§10.3, :meth:`ScheduledRouting.answer_pulls` on each server): a
  server answers pulls in batches -- the ones that become ready while its last answers are
  still being sent wait for them, and are then answered together with one model version. Of
  a batch of at least three pulls, ``k°`` (``distributors``) pullers are earmarked
  (those the server reaches soonest, ties drawn with the job's seed) and
  :func:`mlfabric.ps.scheduler.distribute` (Alg. 3 with server->distributor->worker times)
  splits the rest: some are answered directly, the others get a small "via" note and their
  model from a distributor, which forwards it as soon as it has it (the worker's
  :meth:`~mlfabric.ps.worker.PSWorker.pull_flat`). A worker whose distributor is lost asks
  the server again, to be answered directly.

**Replication** (MLfabric §5.3, ``ScheduledSettings(replication="network", divergence=...)``,
MLfabric-A with replicas): the server no longer forwards what it applies. After each batch's
plan the scheduler makes one *unit* per entry of the server's order (an update, or a group's
aggregate; norm bound ``lr x weight x`` the members' gradient norms) and runs
:func:`mlfabric.ps.scheduler.replication.plan_replication` per replica on the network the
batch leaves (ledger + the batch's reservations): the frozen units' transfers are reserved and
ordered -- each member worker gets a ``replicate`` (send your copy of update X, component j,
to host H at start S and rate R), each replica aggregator its ``runit`` (members, replica),
each replica the units' order -- the punted ones wait for the next batch (or, with no batch
coming, go at the next tick), and the server order's last entry gets a not-before time when
§5.3 step 3 delays it. Workers keep a copy of each scheduled update until asked (the
:class:`Aggregator` thread: at most ``MAX_COPIES``, freed once sent to every replica, when the
scheduler drops the update, or when the worker leaves). The server tells each replica, per
applied unit, only its key and version (``applied``); the replica applies units in that order
(:mod:`mlfabric.ps.replica`) and acks, and the server holds a batch's last entry while a
replica would be beyond Div_max (eq. (11) on the acked state; ``slack_s`` at most, then it goes
on and counts ``bound_overruns``): the plan's times are predictions, the acks are facts.

Servers apply a batch's updates in the scheduler's order (:class:`.server.ScheduledServerSide` keeps the
orders): an entry that has not arrived ``slack_s`` after its planned commit is skipped. A
version planned for an update is ``v_init + position``, with ``v_init`` the server's version
plus the updates of earlier batches it has not applied or skipped yet
(``ScheduledServerSide.planned_ahead``: a skipped or dropped one no longer counts), so every
planned delay is <= ``tau_max``; an update pushed outside any batch (a fallback) is checked
against the bound at the server, as in vanilla async.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...monitor import TraceFeed
from ...policy import Policy, register_policy
from ..replication import ChainFeed, NetworkFeed
from .aggregator import Aggregator
from .server import ScheduledServerSide
from .service import SchedulerService
from .settings import (DEFAULT_RATE_BPS, REPLICATION_MODES, UNITS_PER_BATCH, ScheduledSettings, aggregator_ranks,
                       unit_scheduler)
from .worker import DaemonStats, ScheduledWorkerSide

if TYPE_CHECKING:
    from mlfabric.ps.config import PSConfig
    from mlfabric.ps.layout import PSLayout
    from mlfabric.ps.policy import ServerPort


class ScheduledRouting(ScheduledWorkerSide, ScheduledServerSide, Policy):
    """The ``scheduled`` policy (module docstring): on a worker its worker side, on a server
    its server side (one object per rank, as every policy)."""

    name = "scheduled"
    needs_push_norm = True  # the scheduler plans replica units on update norms (§5.3)

    def __init__(self, settings: ScheduledSettings | None = None) -> None:
        settings = settings or ScheduledSettings()
        ScheduledWorkerSide.__init__(self, settings)
        ScheduledServerSide.__init__(self, settings)
        self._stop_feed: Callable[[], None] | None = None

    def start(self, server: "ServerPort") -> None:
        """Server 0 starts the scheduler; on the emulator under churn its monitor follows the
        churn's capacity trace (:class:`~mlfabric.ps.monitor.TraceFeed`): the rates the
        scheduler plans on are the ones the NICs run at, ``monitor_lag_s`` late."""
        ScheduledServerSide.start(self, server)
        service = self.scheduler_service
        feed = TraceFeed.from_env() if service is not None else None
        if service is not None and feed is not None:
            self._stop_feed = feed.follow(service.report)

    def stop(self, server: "ServerPort") -> None:
        if self._stop_feed is not None:
            self._stop_feed()
            self._stop_feed = None
        ScheduledServerSide.stop(self, server)

    def validate(self, config: "PSConfig") -> None:
        kind, bound = config.consistency.kind, config.consistency.delay_bound
        if not (kind == "bsp" or (kind == "async" and bound is not None)):
            raise ValueError("routing 'scheduled' is MLfabric-A (consistency async:TAU, a delay bound) or "
                             f"MLfabric-S (consistency bsp), got {config.consistency}")
        if self.settings.replication == "network" and kind == "bsp":
            raise ValueError("replication 'network' (MLfabric §5.3) is planned for MLfabric-A (consistency async:TAU); "
                             "under bsp use replication 'chain'")

    def failover_refusal(self, config: "PSConfig", layout: "PSLayout") -> str | None:
        if layout.servers == 1:
            return None  # the replica takes over the scheduler too (it lives beside server 0)
        return (f"the scheduled policy with {layout.servers} servers: the other servers follow server 0's "
                "scheduler, which a replica does not take over (failover works with one server)")

    def replication_feed(self, config: "PSConfig") -> ChainFeed:
        s = self.settings
        if s.replication == "network":
            return NetworkFeed(bound=s.divergence, slack_s=s.slack_s, measure_divergence=s.measure_divergence)
        return ChainFeed(measure_divergence=s.measure_divergence)

    def worker_report(self) -> dict[str, Any] | None:
        """The worker's scheduled pushes (:class:`DaemonStats`): counts and where their time went."""
        return {"scheduled": self.stats.as_dict()} if self.stats.requested else None

    def claims_pull(self, pull: Any) -> bool:
        return True


def _factory(config: "PSConfig") -> Policy:
    return ScheduledRouting(config.scheduled)


register_policy("scheduled", _factory)

__all__ = ["DEFAULT_RATE_BPS", "REPLICATION_MODES", "UNITS_PER_BATCH", "Aggregator", "DaemonStats",
           "ScheduledRouting", "ScheduledServerSide", "ScheduledSettings", "ScheduledWorkerSide", "SchedulerService",
           "aggregator_ranks", "unit_scheduler"]
