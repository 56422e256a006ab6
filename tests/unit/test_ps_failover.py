"""Server failover (MLfabric §3.3, issue #23): a replica takes over a lost server -- under the
direct policy and under MLfabric-A's scheduler with network replication -- the workers
redirect without restarting, and further replicas follow the one that took over.

    .venv/bin/python -m pytest tests/unit/test_ps_failover.py -q
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout
from mlfabric.ps.failover import failover_refusal
from mlfabric.ps.server import ServerStats
from tests.unit.test_ps import run_job
from tests.unit.test_ps_network_replication import _settings


def _kill(jobs: list[Any], rank: int) -> None:
    """A server's process dies: its loop (and a scheduler beside it) stops first -- a dead
    process does nothing more -- then its transport vanishes without a goodbye."""
    job = jobs[rank]
    (job.server or job.replica.promoted).stop()
    job.comm.transport.fabric.kill(rank)


def test_a_replica_takes_over_the_scheduler_and_the_other_replica_follows_it() -> None:
    """MLfabric-A with network replication, one server, two replicas: the server dies between
    two steps (so the replicas are within Div_max); replica 0 takes over the shard and the
    scheduler, replica 1 mirrors it from then on, the workers go on."""
    layout = PSLayout(servers=1, replicas=2, workers=3)
    div_max = 5.0
    config = PSConfig(consistency="async:6", timeout_s=10, routing="scheduled",
                      scheduled=_settings("network", str(div_max)))
    jobs: list[Any] = []
    at_kill = threading.Barrier(3)
    after_kill = threading.Barrier(3)
    seen: dict[str, Any] = {}

    def work(w: Any) -> tuple[int, torch.Tensor]:
        w.init_model("m", torch.zeros(400), lr=0.1, momentum=0.5)
        target = torch.linspace(-1, 1, 400) + 1
        for step in range(10):
            if step == 5:
                at_kill.wait(10)
                if w.index == 0:
                    seen["server"] = jobs[0].server.shards["m"].values.clone()
                    _kill(jobs, 0)
                after_kill.wait(10)
            w.push("m", w.pull_flat("m") - target)
            w.clock()
        return w.failovers, w.pull_flat("m")

    out, _ = run_job(layout, config, work, setup=jobs.extend, killed={0})
    promoted, follower = jobs[1].replica, jobs[2].replica
    stats = out[1]
    assert isinstance(stats, ServerStats) and stats.server == 0 and stats.errors == []
    assert stats.scheduler["batches"] > 0  # the replica ran the scheduler after the takeover
    assert stats.worker_updates + stats.dropped + stats.skipped + stats.unscheduled >= 1
    assert promoted.stats.promoted_at is not None and stats.first_update_at >= promoted.stats.promoted_at
    # the model lost with the server: within Div_max (its last batch had ended)
    at_takeover = promoted.promoted.shards["m"]  # values moved on since; the version tells where it started
    assert at_takeover.version > 0
    assert follower.stats.followed == 1 and follower.primary == 1
    # the follower ends with exactly the promoted server's model (replicated by the new scheduler)
    assert out[2] == {"m": at_takeover.version}
    assert torch.equal(follower.values["m"], at_takeover.values)
    for rank in (3, 4, 5):
        failovers, final = out[rank]
        assert failovers == 1
        target = torch.linspace(-1, 1, 400) + 1
        # training went on on the promoted server: the model is near the workers' optimum
        assert float(torch.linalg.vector_norm(final - target)) < 0.5 * float(torch.linalg.vector_norm(target))
    # the lost model: the server's at its death against the replica's at its takeover
    lost = promoted.stats.lost_updates
    # The barrier before the kill waits for the workers' clocks, not for the scheduler's last
    # batch: on a loaded machine one of its updates (1 in 2 of 5 full CI runs) was applied at
    # the server and not yet at the replica. At most that batch, one update per worker, is
    # lost; MLfabric §3.3 guarantees the Div_max bound below, not zero loss.
    assert 0 <= lost <= 3
    assert float(torch.linalg.vector_norm(seen["server"] - promoted.takeover_values["m"])) <= div_max


def test_replicas_take_over_one_after_the_other_under_the_direct_policy() -> None:
    """Chain replication, two replicas: the server dies, replica 0 takes over; then replica 0
    dies too and replica 1 (which followed it) takes over. The workers redirect twice."""
    layout = PSLayout(servers=1, replicas=2, workers=2)
    jobs: list[Any] = []
    barriers = [threading.Barrier(2), threading.Barrier(2), threading.Barrier(2), threading.Barrier(2)]

    def work(w: Any) -> tuple[int, torch.Tensor]:
        w.init_model("m", torch.zeros(64), lr=0.1, momentum=0.5)
        for step in range(12):
            if step in (4, 8):
                first, second = barriers[:2] if step == 4 else barriers[2:]
                w.pull_flat("m")  # answered after this worker's last push was applied: none in flight
                first.wait(10)
                if w.index == 0:
                    _kill(jobs, 0 if step == 4 else 1)
                second.wait(10)
            w.push("m", w.pull_flat("m") - 1)
            w.clock()
        return w.failovers, w.pull_flat("m")

    out, _ = run_job(layout, PSConfig(consistency="async", timeout_s=10), work, setup=jobs.extend, killed={0, 1})
    last = out[2]
    assert isinstance(last, ServerStats) and last.server == 0 and last.errors == []
    assert last.worker_updates == 8  # steps 8..11 of both workers
    assert jobs[2].replica.stats.followed == 1 and jobs[2].replica.promoted is not None
    for rank in (3, 4):
        failovers, final = out[rank]
        assert failovers == 2 and torch.all(final > 0.5)
    # 24 updates pushed; at each kill the chain forward of each worker's last update may still
    # have been on its way to the replica (lost with the server, as MLfabric §3.3 allows)
    assert 24 - 2 * 2 <= jobs[2].replica.promoted.shards["m"].version <= 24


@pytest.mark.parametrize(("changes", "servers", "reason"), [
    ({"consistency": "bsp"}, 1, "a round in flight"),
    ({"consistency": "async:4", "routing": "scheduled"}, 2, "follow server 0's scheduler"),
    ({"consistency": "bsp", "routing": "mlnet"}, 1, "a round in flight"),
])
def test_where_failover_cannot_be_done_the_reason_is_named(changes: dict, servers: int, reason: str) -> None:
    layout = PSLayout(servers=servers, replicas=1, workers=2)
    refusal = failover_refusal(PSConfig(**changes), layout)
    assert refusal is not None and reason in refusal
    assert failover_refusal(PSConfig(consistency="async:4", routing="scheduled"), PSLayout(servers=1, replicas=1, workers=2)) is None
    assert failover_refusal(PSConfig(consistency="ssp:2"), PSLayout(servers=2, replicas=2, workers=2)) is None
    assert failover_refusal(PSConfig(consistency="ssp:1", routing="mlnet"), PSLayout(servers=2, replicas=1, workers=2)) is None


def test_a_leaving_worker_does_not_wait_for_replica_units_that_can_no_longer_complete() -> None:
    """Regression (a CI hang, 1 run in ~5 of test_a_killed_server_is_replaced_by_its_replica...):
    a worker was the replica aggregator of a unit the lost scheduler had planned toward the
    replica that then followed the promoted one; the unit's other members were told nothing
    more, and the worker's leave waited for them until the timeout."""
    from mlfabric.ps import local_jobs
    from mlfabric.ps.policies.scheduled import UNITS_PER_BATCH as _UNITS_PER_BATCH
    from mlfabric.ps.policies.scheduled import Aggregator, ScheduledSettings, unit_scheduler
    from mlfabric.ps.policies.scheduled.aggregator import _ReplicaSum

    layout = PSLayout(servers=1, replicas=2, workers=2)
    jobs = local_jobs(layout, PSConfig(consistency="async", timeout_s=5))
    try:
        worker = jobs[layout.worker_rank(0)].worker
        aggregator = Aggregator(worker, ScheduledSettings(replication="network", divergence="2.0"))
        old_unit = 23 * _UNITS_PER_BATCH + 1                     # batch 23 of the scheduler at rank 0
        new_unit = ((1 << 20) + 4) * _UNITS_PER_BATCH + 2       # a batch of the one at rank 1
        assert unit_scheduler(old_unit) == 0 and unit_scheduler(new_unit) == 1
        follower = layout.replica_ranks[1]
        for unit in (old_unit, new_unit):
            aggregator._replica_sums[(unit, follower)] = _ReplicaSum(members=[(3, 1), (4, 1)], since=0.0)
        assert aggregator._open()  # both wait for their members while every scheduler lives
        jobs[0].comm.transport.fabric.kill(0)  # the server (and its scheduler) dies
        worker.serving[0] = layout.replica_ranks[0]  # the worker failed over to replica 0
        assert aggregator._open()  # the promoted scheduler's unit still completes
        assert list(aggregator._replica_sums) == [(new_unit, follower)]
    finally:
        for job in jobs[1:]:
            job.comm.close()


def test_a_leaving_worker_does_not_wait_for_a_group_whose_members_never_came() -> None:
    """Regression (a hang, 1 run in ~5 of test_a_killed_server_is_replaced_by_its_replica...,
    2026-11-29): a planned group none of whose members arrived (after the failover they pushed
    to the promoted server) was never forwarded and never closed, so its host's leave waited
    for it until the launch's timeout. Past its deadline and slack it is closed."""
    import time

    from mlfabric.ps import local_jobs
    from mlfabric.ps.policies.scheduled import Aggregator, ScheduledSettings
    from mlfabric.ps.policies.scheduled.aggregator import _Group

    layout = PSLayout(servers=1, workers=2)
    jobs = local_jobs(layout, PSConfig(consistency="async", timeout_s=5))
    try:
        aggregator = Aggregator(jobs[layout.worker_rank(0)].worker, ScheduledSettings(slack_s=0.05))
        now = time.monotonic()
        aggregator._groups[(7, 1)] = _Group(model="m", members=[(2, 1), (3, 1)], servers=[0], planned=True,
                                            deadline=now + 0.02)
        aggregator._forward_ready(now)
        assert aggregator._open()  # before its deadline its members may still come
        aggregator._forward_ready(now + 0.03)
        assert aggregator._open()  # past the deadline, within the slack: still open
        aggregator._forward_ready(now + 0.1)
        assert not aggregator._open() and (7, 1) not in aggregator._groups  # nothing came: closed
    finally:
        for job in jobs:
            job.comm.close()


def test_ordered_pulls_keep_the_registered_priorities_after_failover() -> None:
    """TicTac's priorities reach the replicas with the model: after the server dies, the
    replica that takes over answers priority pulls in the registered order, and the replica
    that follows it has them too (its own takeover would keep them)."""
    from torch import nn

    layout = PSLayout(servers=1, replicas=2, workers=2)
    jobs: list[Any] = []
    barrier = [threading.Barrier(2), threading.Barrier(2)]
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    order = ["2.bias", "0.weight", "2.weight", "0.bias"]  # not the registration order
    priorities = {key: order.index(key) for key, _ in net.named_parameters()}

    def work(w: Any) -> tuple[int, list[str]]:
        w.init_model("net", net, priorities=priorities)
        w.clock()
        w.pull_flat("net")
        barrier[0].wait(10)
        if w.index == 0:
            _kill(jobs, 0)
        barrier[1].wait(10)
        w.clock()
        replica = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        arriving = w.pull_in_order("net", replica)
        arriving.join()
        return w.failovers, [a.key for a in arriving.arrivals]

    out, _ = run_job(layout, PSConfig(consistency="async", timeout_s=10), work, setup=jobs.extend, killed={0})
    for rank in (3, 4):
        failovers, arrived = out[rank]
        assert failovers == 1 and arrived == order
    assert jobs[1].replica.promoted.shards["net"].priorities == priorities
    assert jobs[2].replica._priorities["net"] == priorities  # the follower got them from the new server
