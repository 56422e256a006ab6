"""The scheduled policy's sans-I/O cores, and check 3 of issue 35: one core, two drivers, the same decisions.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled_core.py -q

A recorded sequence of worker update requests, monitor reports (network states) and clock
ticks is fed to the scheduled policy's :class:`BatchingCore` once through the runtime's
driver (the :class:`SchedulerService` thread on server 0's transport, the requests arriving
as messages from the workers' transports, the time from a recorded clock) and once through
the simulator's driver (``mlfabric.sim.mlfabric._Scheduled``: the requests as its workers'
computes, the reports as its churn, its own turns); the plans -- the servers' orders, drops,
next hops, start times, rates and aggregation groups -- must be identical.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs, protocol
from mlfabric.ps.model import ModelSpec
from mlfabric.ps.policies.scheduled import ScheduledSettings, SchedulerService
from mlfabric.ps.policies.scheduled.core import BatchingCore, Entry, OrderBook, PullBatcher, Request
from mlfabric.ps.rules import SGDMomentum
from mlfabric.ps.shard import Shard

WORKERS, TAU, SIZE, RATE = 6, 2, 1_000_000, 1e9


def recorded_sequence(seed: int = 3) -> list[tuple[Any, ...]]:
    """(t, "request", worker, version, clock) / (t, "monitor", host, up, down) / (t, "tick"):
    every worker asks about every 70 ms with a version that lags; two NICs slow down and
    recover; ticks at every 50 ms (where the runtime's thread wakes)."""
    rng = random.Random(seed)
    events: list[tuple[Any, ...]] = [(0.0, "monitor", h, RATE / 8, RATE / 8) for h in range(WORKERS + 1)]
    for w in range(WORKERS):
        t = rng.uniform(0.001, 0.05)
        clock = 0
        while t < 0.9:
            events.append((round(t, 6), "request", w, max(0, clock * 2 - rng.randrange(4)), clock))
            clock += 1
            t += rng.uniform(0.04, 0.1)
    events += [(0.31, "monitor", 2, RATE / 40, RATE / 8), (0.33, "monitor", 0, RATE / 8, RATE / 16),
               (0.62, "monitor", 2, RATE / 8, RATE / 8)]
    events += [(round(0.05 * k, 6), "tick") for k in range(1, 21)]
    return sorted(events, key=lambda e: (e[0], e[1] != "monitor", e[1] != "request"))


def _settings() -> ScheduledSettings:
    return ScheduledSettings(interval_s=0.1, aggregators=2, distributors=2, rate_bps=RATE, monitor_lag_s=0.05,
                             slack_s=1.0)


def run_runtime_driver(events: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The SchedulerService thread on server 0 of a local job, fed the events as messages."""
    layout = PSLayout(servers=1, workers=WORKERS)
    config = PSConfig(consistency=f"async:{TAU}", timeout_s=20, routing="scheduled", scheduled=_settings())
    jobs = local_jobs(layout, config)
    server = jobs[0].server
    spec = ModelSpec.of("m", torch.zeros(4))
    server.shards["m"] = Shard(spec, 0, 4, torch.zeros(4), SGDMomentum(0.1, 0.0), lr=0.1, momentum=0.0)
    now = [0.0]
    service = SchedulerService(server, _settings(), orders=server.routing, clock=lambda: now[0])
    service.record = []
    tag = protocol.tag(protocol.SCHEDULE, config.session)

    def two_turns() -> None:
        """Wait until a whole turn of the thread ran after what was just handed to it (the
        turn in progress when the lock was let go may have read the old time: the next one
        has both)."""
        target = service.turns + 2
        deadline = time.monotonic() + 10
        while service.turns < target:
            assert time.monotonic() < deadline, "the scheduler thread stopped turning"
            server.transport.mailbox.notify()
            time.sleep(0.001)

    ids = {w: 0 for w in range(WORKERS)}  # each worker numbers its requests from 1
    service.start()
    try:
        for event in events:
            with service.turn_lock:  # the thread's next turn sees the new time and the message together
                now[0] = event[0]
                if event[1] == "request":
                    _, _, w, version, clock = event
                    transport = jobs[layout.worker_rank(w)].comm.transport
                    ids[w] += 1
                    transport.send(0, tag, b"", channel=server.channel, meta=protocol.encode(
                        op="request", id=ids[w], model="m", version=version, norm=0.0, clock=clock, sizes=[SIZE]))
                elif event[1] == "monitor":
                    _, _, host, up, down = event
                    if host == 0:  # the server's own NIC, measured beside the scheduler
                        service.report(0, up, down)
                    else:
                        jobs[host].comm.transport.send(0, tag, b"", channel=server.channel,
                                                       meta=protocol.encode(op="monitor", up=up, down=down))
            two_turns()
    finally:
        service.stop()
        for j in jobs:
            j.comm.close()
    return [p.summary() for p in service.record]


def run_sim_driver(events: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The simulator's MLfabric-A driver, fed the same events (its flows never run)."""
    from mlfabric.sim.mlfabric import MLfabricSimConfig, _Clock, _Environment, _Scheduled, _StarNet

    config = MLfabricSimConfig(workers=WORKERS, update_bytes=SIZE, rate_bps=RATE, compute_s=0.0, straggler=None,
                               churn=None, interval_s=0.1, aggregators=2, distributors=2, monitor_lag_s=0.05,
                               slack_s=1.0, seed=0)
    env = _Environment(config)
    up, down = env.capacities_at(0.0)
    ps = _Scheduled(config, env, _Clock(_StarNet(up, down)), 10**9, tau=TAU)
    ps.record_plans = True
    for event in events:
        t = event[0]
        if event[1] == "request":
            _, _, w, version, clock = event
            ps.model_version[w], ps.iteration[w] = version, clock + 1
            ps.computed(w, t)
        elif event[1] == "monitor":
            _, _, host, up_rate, down_rate = event
            ps.monitor.report(host, up_rate, down_rate, t)
        ps.turn(t)  # the thread's turn when it wakes
    return [p.summary() for p in ps.plans]


def test_check3_the_runtime_and_the_simulator_drive_the_same_scheduled_core_to_the_same_decisions() -> None:
    events = recorded_sequence()
    runtime = run_runtime_driver(events)
    simulated = run_sim_driver(events)
    assert len(runtime) >= 8  # batches planned
    decisions = [d for p in runtime for d in p["decisions"]]
    assert any(d["drop"] for d in decisions) and any(not d["drop"] for d in decisions)  # drops and kept
    assert any(p["groups"] for p in runtime)  # aggregation happened
    assert runtime == simulated


def test_the_batching_core_plans_when_everyone_waits_or_the_interval_is_over() -> None:
    core = BatchingCore(servers=[0], aggregators=[], hosts=3, tau=4, seed=0, interval_s=0.1, slack_s=0.5,
                        rate_bps=8e6, monitor_lag_s=0.0)
    assert core.turn(0.0, {1, 2}, lambda m: 0) == [] and core.wake_at() == pytest.approx(0.1)
    core.request(Request(rank=1, id=1, model="m", version=0, sizes=(1e6,)))
    assert core.turn(0.05, {1, 2}, lambda m: 0) == []  # rank 2 may still ask: wait
    core.request(Request(rank=2, id=1, model="m", version=0, sizes=(1e6,)))
    (plan,) = core.turn(0.06, {1, 2}, lambda m: 0)  # everyone waits: no reason to wait longer
    assert [e[:3] for e in plan.entries] == [["u", 1, 1], ["u", 2, 1]] or \
        [e[:3] for e in plan.entries] == [["u", 2, 1], ["u", 1, 1]]
    assert core.wake_at() == pytest.approx(0.16)
    first, second = plan.decisions
    assert first.start_in == 0.0 and second.start_in == pytest.approx(1.0)  # 1 MB at 1 MB/s each, in turn
    assert plan.entries[1][3] == pytest.approx(2.0 + 0.5)  # deadline: planned commit + slack


class _Port:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def apply(self, model: str, entry: Entry, arrived: Any) -> None:
        self.log.append(("apply", arrived))

    def skipped(self, model: str, batch: int, entry: Entry) -> None:
        self.log.append(("skip", entry.key))

    def hold_last(self, model: str, entry: Entry, now: float) -> bool:
        return False

    def batch_done(self, model: str, batch: int) -> None:
        self.log.append(("done", batch))


def test_the_order_book_applies_in_order_and_skips_what_is_late() -> None:
    book = OrderBook()
    book.add_order({"model": "m", "batch": 1, "entries": [["u", 1, 1, 0.5, [1]], ["g", 1, 2, 0.8, [2, 3]]]}, 10.0)
    assert book.planned["m"] == 3 and book.held_ranks("m") == {1, 2, 3}
    port = _Port()
    book.arrived("m", 1, ("g", 1), "sum")  # the second entry first: it waits for the first
    book.step(10.1, port)
    assert port.log == [] and book.wake_at() == pytest.approx(10.5)
    book.step(10.5, port)  # the first never came: skipped at its deadline, then the group applies
    assert port.log == [("skip", (1, 1)), ("apply", "sum"), ("done", 1)]
    assert book.planned["m"] == 0 and book.held_ranks("m") == set()


def test_the_pull_batcher_waits_for_the_last_batch_and_splits_through_distributors() -> None:
    from mlfabric.ps.scheduler import NetState

    batcher = PullBatcher(distributors=1, seed=0, server=0)
    net = NetState([1e6] * 5, [1e6] * 5, origin=0.0)
    plan = batcher.plan(net, me=0, pullers=[1, 2, 3, 4], model_size=1e5, now=0.0)
    assert len(plan.groups) == 1 and sum(len(m) for _, m in plan.groups) + 1 + len(plan.by_server) == 4
    assert batcher.answer_at() > 0.0 and not batcher.ready(0.0, True) and not batcher.ready(1e9, False)
    assert batcher.ready(batcher.answer_at(), True)
    again = PullBatcher(distributors=1, seed=0, server=0).plan(net, me=0, pullers=[1, 2, 3, 4], model_size=1e5,
                                                               now=0.0)
    assert again.groups == plan.groups and np.isclose(again.transfers[0].end, plan.transfers[0].end)
