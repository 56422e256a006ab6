"""MLfabric's scheduler running for real (the ``scheduled`` routing policy) on threads: every
update accounted for, the delay bound held, aggregation used, the fallback when the
scheduler does not answer; the network monitor's lag and the ledger of reservations.

    python -m pytest tests/unit/test_ps_scheduled.py -q
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs
from mlfabric.ps.monitor import Ledger, NetworkMonitor
from mlfabric.ps.scheduler import NetState, down_link, up_link
from mlfabric.ps.policies.scheduled import ScheduledSettings, aggregator_ranks
from tests.unit.ps_pulls_by_hand import waiting_pulls
from tests.unit.ps_relay_loss import lost_and_survivors, two_rounds_losing_a_relay


def test_monitor_reports_are_seen_after_the_lag() -> None:
    monitor = NetworkMonitor(hosts=2, default_bps=100.0, lag_s=0.2)
    assert monitor.capacities(0.0) == ([100.0, 100.0], [100.0, 100.0])
    monitor.report(1, 50.0, None, at=1.0)  # down unknown: keeps its previous figure
    assert monitor.capacities(1.1) == ([100.0, 100.0], [100.0, 100.0])
    assert monitor.capacities(1.2) == ([100.0, 50.0], [100.0, 100.0])
    monitor.report(1, None, 10.0, at=2.0)
    assert monitor.capacities(5.0) == ([100.0, 50.0], [100.0, 10.0])
    with pytest.raises(ValueError, match="host 2 is outside"):
        monitor.report(2, 1.0, 1.0, at=3.0)


def test_the_trace_feed_reports_each_row_as_written_for_every_rank_on_its_host(tmp_path: Any) -> None:
    from mlfabric.emu.churn import TraceWriter
    from mlfabric.ps.monitor import TraceFeed
    from mlfabric.topo.trace import TraceRow, capacity_trace_env

    path = tmp_path / "trace.csv"
    env = capacity_trace_env(str(path), 100.0, [0, 1, 1])  # ranks 1 and 2 share host 1
    feed = TraceFeed.from_env(env)
    assert feed is not None and TraceFeed.from_env({}) is None
    assert feed.poll() == []  # not written yet
    writer = TraceWriter(path)
    writer.write([TraceRow(time_s=0.0, host=0, nic=0, direction="egress", rate_bps=8e9),
                  TraceRow(time_s=0.0, host=1, nic=0, direction="ingress", rate_bps=4e9),
                  TraceRow(time_s=0.0, host=1, nic=1, direction="ingress", rate_bps=1e9)])  # another NIC: not ours
    assert feed.poll() == [(0, 1e9, None, 100.0), (1, None, 5e8, 100.0), (2, None, 5e8, 100.0)]
    assert feed.poll() == []  # each row once
    with path.open("a") as handle:  # half a line: held back until its end is written
        handle.write("5.0,0,0,ingress,2e9")
        handle.flush()
        assert feed.poll() == []
        handle.write("\n")
    assert feed.poll() == [(0, None, 2.5e8, 105.0)]
    writer.close()
    with pytest.raises(ValueError, match="MLFABRIC_CAPACITY_TRACE"):
        TraceFeed.from_env({"MLFABRIC_CAPACITY_TRACE": "{}"})


def test_the_scheduler_plans_on_the_churned_rates_of_the_emulators_trace(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue #35, check 4): under the emulator's churn the scheduler's monitor got no
    report at all and planned every NIC at its default rate. It follows the churn's trace now."""
    from mlfabric.emu.churn import TraceWriter
    from mlfabric.ps.policies.scheduled import SchedulerService
    from mlfabric.topo.trace import TraceRow, capacity_trace_env

    layout = PSLayout(servers=1, workers=2)
    path = tmp_path / "trace.csv"
    writer = TraceWriter(path)
    # the server's ingress at a quarter of the line rate from the start
    writer.write([TraceRow(time_s=0.0, host=0, nic=0, direction="ingress", rate_bps=2.5e8),
                  TraceRow(time_s=0.0, host=1, nic=0, direction="egress", rate_bps=5e8)])
    writer.close()
    monkeypatch.setenv("MLFABRIC_CAPACITY_TRACE",
                       capacity_trace_env(str(path), time.monotonic() - 1.0, range(3))["MLFABRIC_CAPACITY_TRACE"])
    seen: list[tuple[list[float], list[float]]] = []
    network = SchedulerService.network

    def recording(self: Any, now: float) -> Any:
        seen.append(self.core.monitor.capacities(now))
        return network(self, now)

    monkeypatch.setattr(SchedulerService, "network", recording)
    config = PSConfig(consistency="async:2", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.02, aggregators=0, rate_bps=1e9))
    _run(layout, config, steps=3, pause=0.0)
    assert seen, "the server never asked the scheduler for the network"
    up, down = seen[-1]
    assert down[0] == pytest.approx(2.5e8 / 8) and up[1] == pytest.approx(5e8 / 8)
    assert up[0] == down[1] == up[2] == down[2] == pytest.approx(1e9 / 8)  # not in the trace: the settings' rate


def test_ledger_keeps_running_reservations_out_of_the_next_batch() -> None:
    net = NetState.star(3, 100.0, origin=0.0)
    transfer = net.reserve(0, 2, 300.0, 0.0)  # host 0 -> 2 at 100 B/s: busy until t = 3
    ledger = Ledger()
    ledger.add([transfer])
    later = ledger.state(1.0, [100.0] * 3, [100.0] * 3)
    assert later.residual(up_link(0), 1.5) == 0.0 and later.residual(down_link(2), 2.9) == 0.0
    assert later.residual(up_link(0), 3.0) == 100.0 and later.residual(up_link(1), 1.0) == 100.0
    # host 1 -> 2 has to wait for the link into host 2
    assert later.t_en(1, 2, 100.0, 1.0) == pytest.approx(4.0)
    # a capacity cut below the reservation leaves nothing, never a negative residual
    assert ledger.state(1.0, [50.0] * 3, [50.0] * 3).residual(up_link(0), 1.0) == 0.0
    assert len(ledger) == 1 and len(Ledger().state(5.0, [1.0], [1.0]).timeline(0)[0]) == 1
    ledger.state(3.5, [100.0] * 3, [100.0] * 3)
    assert len(ledger) == 0  # finished transfers are forgotten


def test_aggregators_are_spread_over_the_workers() -> None:
    assert aggregator_ranks(range(2, 10), 2) == [2, 6]
    assert aggregator_ranks(range(2, 4), 5) == [2, 3] and aggregator_ranks(range(2, 4), 0) == []


def _run(layout: PSLayout, config: PSConfig, steps: int, pause: float = 0.01) -> tuple[dict[int, Any], list[Any]]:
    jobs = local_jobs(layout, config)
    out: dict[int, Any] = {}

    def serve(job: Any) -> None:
        out[job.rank] = job.serve()

    def work(job: Any) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(500), lr=0.1)
        for _ in range(steps):
            params = w.pull_flat("m")
            time.sleep(pause * (1 + w.index))
            w.push("m", params - 1)
            w.clock()
        w.leave()
        out[job.rank] = {**w.routing.stats.as_dict(), "pushes_dropped": w.stats.pushes_dropped}

    threads = [threading.Thread(target=serve if j.role == "server" else work, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for j in jobs:
        j.comm.close()
    return out, jobs


@pytest.mark.parametrize("servers", [1, 2])
def test_scheduled_policy_accounts_for_every_update_and_bounds_delays(servers: int) -> None:
    layout = PSLayout(servers=servers, workers=4)
    tau = 4
    config = PSConfig(consistency=f"async:{tau}", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9))
    # No compute pause: the workers' requests meet in batches of up to 4, where a group of
    # several commits earlier than direct pushes (a group of one never does: the scheduler
    # sends it direct).
    out, _ = _run(layout, config, steps=8, pause=0.0)
    workers = [out[r] for r in layout.worker_ranks]
    requested = sum(w["requested"] for w in workers)
    assert requested == 32 and sum(w["fallbacks"] for w in workers) == 0
    dropped_by_scheduler = sum(w["dropped_by_scheduler"] for w in workers)
    for server in layout.server_ranks:
        stats = out[server]
        assert max(stats.delays) <= tau
        # every request: applied here, dropped by the scheduler, dropped or skipped at the server
        assert stats.worker_updates + stats.dropped + stats.skipped + dropped_by_scheduler == requested
        assert stats.unscheduled == 0 and stats.errors == []
    sched = out[0].scheduler
    assert sched["requests"] == requested and sched["batches"] >= 2
    assert sched["aggregated"] == sum(w["sent_to_aggregators"] for w in workers)
    if servers == 1:  # (with two, equal updates from 4 workers tie: the scheduler sends them direct)
        assert sched["aggregated"] > 0
    assert sched["dropped_by_scheduler"] == dropped_by_scheduler
    # push() said False exactly for the updates the scheduler dropped
    assert sum(w["pushes_dropped"] for w in workers) == dropped_by_scheduler


def test_lost_decisions_make_workers_push_unscheduled_and_the_server_bounds_the_delay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlfabric.ps.policies.scheduled import SchedulerService

    # The scheduler plans, but its decisions and orders never arrive (lost control messages).
    monkeypatch.setattr(SchedulerService, "_dispatch", lambda self, *args: None)
    layout = PSLayout(servers=1, workers=2)
    config = PSConfig(consistency="async:2", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.02, decision_timeout_s=0.1, aggregators=0))
    started = time.monotonic()
    out, _ = _run(layout, config, steps=3, pause=0.0)
    assert time.monotonic() - started < 10  # each push waited 0.1 s at most
    assert sum(out[r]["fallbacks"] for r in layout.worker_ranks) == 6
    stats = out[0]
    assert stats.unscheduled == 6 and stats.worker_updates + stats.dropped == 6 and max(stats.delays) <= 2


def test_skipped_updates_do_not_shorten_the_deadlines_of_later_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the scheduler planned each batch's versions from what it had planned
    before, so every planned update that never reached the server (skipped past its slack)
    moved all later deadlines one version closer for good: a few skips under a small TAU and
    the scheduler dropped every later update. Now the versions start from the server's
    version plus the planned updates it has not applied or skipped yet."""
    import mlfabric.ps.policies.scheduled.worker as scheduling

    delayed: dict[str, int] = {}

    class SlowFirstPushes:
        """time for the scheduling module: each worker thread's first two planned starts come
        0.6 s late (an update stuck on its way), past the server's 0.1 s of slack."""

        monotonic = staticmethod(time.monotonic)
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def sleep(seconds: float) -> None:
            name = threading.current_thread().name
            if delayed.get(name, 0) < 2:
                delayed[name] = delayed.get(name, 0) + 1
                seconds += 0.6
            time.sleep(seconds)

    monkeypatch.setattr(scheduling, "time", SlowFirstPushes)
    layout = PSLayout(servers=1, workers=2)
    tau = 2
    config = PSConfig(consistency=f"async:{tau}", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.02, aggregators=0, slack_s=0.1, rate_bps=1e9))
    out, _ = _run(layout, config, steps=10, pause=0.01)
    stats = out[0]
    dropped_by_scheduler = sum(out[r]["dropped_by_scheduler"] for r in layout.worker_ranks)
    # after the skips the later updates go through (with the skips counted as planned
    # versions, every update after the second skip was dropped as doomed: none applied)
    assert stats.worker_updates >= 10, (stats.worker_updates, stats.skipped, dropped_by_scheduler)
    assert stats.skipped >= 3  # the late updates' entries; their late arrivals are not counted again
    assert stats.worker_updates + stats.dropped + stats.skipped + dropped_by_scheduler == 20
    assert max(stats.delays) <= tau


def test_scheduled_policy_needs_a_delay_bound() -> None:
    with pytest.raises(ValueError, match="async:TAU"):
        PSConfig(consistency="async", routing="scheduled")
    with pytest.raises(ValueError, match="unknown routing policy 'trees'"):
        local_jobs(PSLayout(servers=1, workers=1), PSConfig(routing="trees"))


def test_a_scheduled_update_that_arrives_before_its_batch_order_is_kept() -> None:
    """Regression: the order travels from the scheduler on another connection than the update,
    so the update may come first; it was dropped as late, then its entry skipped."""
    from mlfabric.ps import protocol
    from mlfabric.ps.model import ModelSpec

    layout = PSLayout(servers=1, workers=1)
    config = PSConfig(consistency="async:4", timeout_s=10, routing="scheduled")
    jobs = local_jobs(layout, config)
    server, worker = jobs[0].server, jobs[1].worker
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        worker.init_model("m", torch.zeros(4), lr=1.0)
        spec = ModelSpec.of("m", torch.zeros(4))
        assert worker.models["m"] == spec
        header = protocol.encode(op=protocol.PUSH, model="m", clock=0, version=0, norm=2.0, batch=1, id=7, rank=1)
        worker.transport.send(0, protocol.request_tag(0), memoryview(torch.ones(4).numpy()).cast("B"), meta=header)
        time.sleep(0.3)  # the server has taken the update; no order yet
        assert server.shards["m"].version == 0 and server.stats.dropped == 0
        server.routing.add_order(server, {"op": protocol.ORDER, "batch": 1, "model": "m", "v_init": 0,
                          "entries": [["u", 1, 7, 5.0, [1]]]}, time.monotonic())
        deadline = time.monotonic() + 3
        while server.shards["m"].version == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.shards["m"].version == 1 and server.stats.skipped == 0
        assert server.shards["m"].values.tolist() == [-1.0] * 4  # lr 1, weight 1/W = 1
    finally:
        worker.leave()
        thread.join(5)
        for j in jobs:
            j.comm.close()


@pytest.mark.parametrize("servers", [1, 2])
def test_mlfabric_s_is_synchronous_sgd_through_the_scheduler(servers: int) -> None:
    """BSP routed by the scheduler (aggregators included) gives exactly the rounds of direct BSP."""
    layout = PSLayout(servers=servers, workers=4)
    results = {}
    for routing in ("direct", "scheduled"):
        config = PSConfig(consistency="bsp", timeout_s=20, routing=routing,
                          scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9))
        jobs = local_jobs(layout, config)
        finals: dict[int, torch.Tensor] = {}
        stats: dict[int, Any] = {}
        relayed: dict[int, int] = {}

        def work(job: Any) -> None:
            if job.role == "server":
                stats[job.rank] = job.serve()
                return
            w = job.worker
            w.init_model("m", torch.zeros(64), lr=0.1, momentum=0.5)
            for _ in range(5):
                params = w.pull_flat("m")
                w.push("m", params - torch.arange(64.0) * (w.index + 1))
                w.clock()
            finals[w.index] = w.pull_flat("m")
            relayed[w.index] = w.stats.relayed
            w.leave()

        threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        for j in jobs:
            j.comm.close()
        results[routing] = (finals, stats, relayed)
    direct, scheduled = results["direct"], results["scheduled"]
    for w in range(4):
        torch.testing.assert_close(scheduled[0][w], direct[0][0])
    for server in range(servers):
        s = scheduled[1][server]
        assert s.updates_applied == 5 and s.worker_updates == 20 and s.skipped == 0 and s.dropped == 0
        assert s.missing_rounds == [] and s.unscheduled == 0
    sched = scheduled[1][0].scheduler
    assert sched["batches"] == 5 and sched["dropped_by_scheduler"] == 0
    if servers == 1:  # a round's 4 equal updates: two groups beat four direct pushes (with two
        assert sched["aggregated"] > 0  # servers they tie, and ties go direct)
    # Model distribution (§10.3; how many of a round's pulls meet in one batch depends on
    # timing, test_a_batch_of_pulls_goes_through_distributors is deterministic): distributors
    # forwarded exactly what their servers did not send themselves.
    for server in range(servers):
        assert direct[1][server].pulls_relayed == 0
        s = scheduled[1][server]
        assert s.pulls == 4 * 6 and s.pulls_relayed < s.pulls and s.pull_batches <= s.pulls
    assert sum(scheduled[2].values()) == sum(scheduled[1][j].pulls_relayed for j in range(servers))
    assert sum(direct[2].values()) == 0


def test_a_batch_of_pulls_goes_through_distributors() -> None:
    """§10.3 on a server that is not serving, driven by hand: four pulls answered as one batch
    reach every worker with the server's values, part of them relayed by a distributor, and
    the next batch waits for the planned end of this one's sends."""
    from mlfabric.ps import protocol

    layout = PSLayout(servers=1, workers=4)
    config = PSConfig(consistency="async:4", timeout_s=10, routing="scheduled",
                      scheduled=ScheduledSettings(distributors=1, rate_bps=8e6))  # planned at 1 MB/s
    jobs = local_jobs(layout, config)
    server = jobs[0].server
    values = torch.arange(1000.0)
    try:
        pulls, collect = waiting_pulls(layout, jobs)
        assert server.routing.ready_to_answer(server)
        before = time.monotonic()
        server.routing.answer_pulls(server, pulls, values, protocol.ModelReply(version=7, model_clock=None))
        # the server's own sends of 4 KB each at the planned 1 MB/s: the next batch waits >= 8 ms
        assert server.routing.answer_at() >= before + 0.008 and not server.routing.ready_to_answer(server)
        got = collect()
        assert sorted(got) == [1, 2, 3, 4]
        for version, payload in got.values():
            assert version == 7 and torch.equal(payload, values)
        relayed = sum(j.worker.stats.relayed for j in jobs[1:])
        assert server.stats.pulls_relayed == relayed >= 1 and server.stats.pull_batches == 1
        deadline = time.monotonic() + 1
        while not server.routing.ready_to_answer(server) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert server.routing.ready_to_answer(server) and server.routing.answer_at() <= time.monotonic()
    finally:
        for j in jobs:
            j.comm.close()


def test_a_distributor_lost_before_relaying_makes_its_workers_ask_the_server_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker the server earmarks as distributor closes its transport instead of
    forwarding: the workers it was to serve are answered directly (no hang, no timeout)."""
    from mlfabric.ps.worker import PSWorker

    receive = PSWorker._await
    died: list[int] = []
    lock = threading.Lock()

    def dies_when_asked_to_relay(self: PSWorker, server: int, request_id: int, what: str) -> Any:
        header, msg = receive(self, server, request_id, what)
        with lock:
            first = header.get("forward") and not died  # only the first distributor dies
            if first:
                died.append(self.index)
        if first:
            self.transport.close()
            raise RuntimeError("distributor gone")
        return header, msg

    monkeypatch.setattr(PSWorker, "_await", dies_when_asked_to_relay)
    config = PSConfig(consistency="bsp", timeout_s=20, routing="scheduled",
                      # planned at 1 MB/s: each 64 KB answer holds the server's next batch for
                      # 64 ms, so a round's pulls meet in one batch whatever the threads' timing
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=0, distributors=1, rate_bps=8e6))
    finals = two_rounds_losing_a_relay(config, 16_384)
    gone, alive = lost_and_survivors(finals)
    assert gone == died, finals  # the distributor that died, and no one else
    server = finals["server"]
    assert server.pulls_relayed >= 1 and server.errors == []
    for params in alive:  # all answered, with the same model of round 1
        torch.testing.assert_close(params, alive[0])


def test_a_workers_scheduled_pushes_say_where_their_time_went() -> None:
    from mlfabric.train.ps_modes import _scheduled_figures

    layout = PSLayout(servers=1, workers=3)
    config = PSConfig(consistency="async:4", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=0, rate_bps=1e9))
    out, _ = _run(layout, config, steps=4, pause=0.0)
    daemons = [out[r] for r in layout.worker_ranks]
    for d in daemons:
        assert d["requested"] == 4 and d["fallbacks"] == 0
        # every push waited for its batch's plan (the batching interval, at most, plus the round trip)
        assert 0 < d["decision_wait_s"] < 4 * 2.0 and d["start_wait_s"] >= 0 and d["send_s"] > 0
    figures = _scheduled_figures([{"skipped": 2}], daemons)
    sent = 12 - figures["dropped_by_scheduler"]
    assert figures["skipped"] == 2 and figures["fallbacks"] == 0
    assert figures["decision_wait_ms"] == pytest.approx(1e3 * sum(d["decision_wait_s"] for d in daemons) / 12)
    assert figures["send_ms"] == pytest.approx(1e3 * sum(d["send_s"] for d in daemons) / sent)
    assert _scheduled_figures([{"skipped": 0}], []) == {}  # not a scheduled run: nothing added
    # the part of the wait the scheduler held each request (batching, planning): at most the
    # batching interval and a plan, and less than the worker's whole wait (the round trip's rest)
    stats = out[layout.server_ranks[0]]
    held = stats.scheduler["request_to_decision_ms"]
    assert 0 < held < figures["decision_wait_ms"] and held < 50 + 1_000
    assert _scheduled_figures([{"skipped": 0, "scheduler": stats.scheduler}], daemons)["request_to_decision_ms"] == held


def test_a_pull_answer_to_a_dead_worker_does_not_hold_the_next_pulls() -> None:
    """Regression: the transport never completes a send to a peer that died or left, and the
    scheduled server waited for its last batch of pull answers to be sent before answering
    the next: one answer to a SIGKILLed worker stopped the server answering anyone."""
    from types import SimpleNamespace

    from mlfabric.ps.policies.scheduled.server import ScheduledServerSide
    from mlfabric.transport.base import SendHandle

    side = ScheduledServerSide(ScheduledSettings())
    transport = SimpleNamespace(lost_peers={}, departed_peers=set())
    server = SimpleNamespace(transport=transport)
    side._answering = [(3, SendHandle(done=False)), (4, SendHandle(done=True))]
    assert not side.ready_to_answer(server)  # rank 3's answer is still being sent
    transport.lost_peers[3] = "sending to it failed; process died?"
    assert side.ready_to_answer(server) and side._answering == []
    side._answering = [(5, SendHandle(done=False))]
    transport.departed_peers.add(5)  # a worker that left is no different
    assert side.ready_to_answer(server)
