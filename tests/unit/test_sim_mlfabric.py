"""MLfabric §7 in the simulator (mlfabric.sim.mlfabric): the fluid star network, each mode's
timing against closed forms, the runtime's scheduler in the loop, determinism, the CLI.

    .venv/bin/python -m pytest tests/unit/test_sim_mlfabric.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from mlfabric.sim.mlfabric import (MLfabricSimConfig, _StarNet, cycle_floor_s, simulate_mlfabric, simulate_mode,
                                   simulate_table2, table2)

MB = 1e6
# 4 workers, 1 MB updates at 80 Mbit/s (10 MB/s): a transfer takes 0.1 s on an idle NIC.
SMALL = {"workers": 4, "update_bytes": 1 * MB, "rate_bps": 80e6, "compute_s": 0.05, "straggler": None,
         "churn": None, "updates": 40, "compute_jitter": 0.0}


def test_flows_share_a_nic_max_min_and_keep_to_their_cap() -> None:
    net = _StarNet(np.array([10.0, 10.0, 10.0]), np.array([10.0, 10.0, 10.0]))
    ends: dict[str, float] = {}
    net.add(1, 0, 10.0, lambda t: ends.setdefault("a", t))
    net.add(2, 0, 10.0, lambda t: ends.setdefault("b", t), cap=2.0)
    assert [f.rate for f in net.flows] == pytest.approx([8.0, 2.0])  # b capped, a takes the rest of 0's down-link
    while net.flows:
        for f in net.advance(net.next_finish()):
            f.done(net.now)
    assert ends["a"] == pytest.approx(1.25)  # 10 B at 8 B/s
    assert ends["b"] == pytest.approx(1.25 + 7.5 / 2.0)  # 2.5 B by then, the rest still capped at 2
    net.add(1, 2, 10.0, lambda t: None)
    net.set_capacity(np.array([10.0, 4.0, 10.0]), np.array([10.0, 10.0, 10.0]))
    assert net.flows[0].rate == pytest.approx(4.0)  # a churn redraw applies at once


def test_flows_that_share_no_nic_run_at_their_slower_end() -> None:
    """The allocation's fast path (a ring's steps: one flow per NIC direction) gives what
    progressive filling gives: each flow at the slower of its two ends, or its cap."""
    net = _StarNet(np.array([10.0, 4.0, 10.0, 10.0]), np.array([10.0, 10.0, 6.0, 10.0]))
    for src, dst in ((1, 2), (2, 3), (3, 1)):
        net.add(src, dst, 10.0, lambda t: None, cap=5.0 if src == 3 else math.inf)
    assert [f.rate for f in net.flows] == pytest.approx([4.0, 10.0, 5.0])  # up 1; 2 -> 3 free; capped
    net.add(2, 1, 10.0, lambda t: None)  # now 2's up-link is shared: max-min by filling
    assert [f.rate for f in net.flows] == pytest.approx([4.0, 5.0, 5.0, 5.0])


def test_synchronous_modes_are_compute_plus_the_collective() -> None:
    from mlfabric.sim import ring_closed_form_s

    config = MLfabricSimConfig(**SMALL)
    ring = simulate_mode(config, "allreduce")
    assert ring["iterations"] == 10 and ring["applied"] == 40
    assert ring["time_s"] == pytest.approx(10 * (0.05 + ring_closed_form_s(4, 1 * MB, 80e6)), rel=1e-6)
    tree = simulate_mode(config, "tree-allreduce")
    assert tree["time_s"] > ring["time_s"]  # the binomial tree's root sends log2(4) copies


def test_a_slow_nic_drains_the_rings_buffered_sends_while_the_others_compute() -> None:
    """RR-Sync runs the ring's schedule (the IR) iteration after iteration: a send completes
    once queued, so one host's slow egress keeps carrying an iteration's last steps while the
    hosts compute the next (the runtime over TCP does; docs/simulator.md)."""
    from mlfabric.sim.mlfabric import ChurnReplay, _Environment, _SyncIterations

    full = 10e6  # bytes/s: SMALL's 80 Mbit/s
    up = [full] * 5
    up[2] = full / 4  # worker host 2's egress (simulated host 2; host 0 is the unused server)
    slow = ChurnReplay(changes=((0.0, tuple(up), (full,) * 5),))
    config = MLfabricSimConfig(**{**SMALL, "churn_replay": {"allreduce": slow}})
    loop = _SyncIterations(config, _Environment(config, "allreduce"), "ring")
    loop.net.watch = (1, 2, 3, 4)
    elapsed = loop.run(10)
    per_host = 2 * 3 / 4 * 1 * MB  # 2(n-1)/n of the update leaves every host each iteration
    for h in (1, 2, 3, 4):  # every op ran once per iteration: no more, no fewer bytes
        assert loop.net.sent[("u", h)] == pytest.approx(10 * per_host, rel=1e-9)
        assert loop.net.sent[("d", h)] == pytest.approx(10 * per_host, rel=1e-9)
    slow_link = per_host / (full / 4)  # 0.6 s of work for the slow egress per iteration
    assert elapsed >= 10 * slow_link
    # compute, then the collective at its bottleneck, iteration by iteration: 10 x 0.65 s
    assert elapsed < 0.95 * 10 * (0.05 + slow_link)
    assert simulate_mode(config, "allreduce")["time_s"] == pytest.approx(elapsed)
    # stragglers: a host starts its iteration with its neighbour's message already there, which
    # readies a send while the iteration's first ops are being started (it once ran twice)
    late = dataclasses.replace(config, straggler="0.5,3")
    loop = _SyncIterations(late, _Environment(late, "allreduce"), "ring")
    loop.net.watch = (1, 2, 3, 4)
    loop.run(10)
    assert [loop.net.sent[("u", h)] for h in (1, 2, 3, 4)] == pytest.approx([10 * per_host] * 4, rel=1e-9)


def test_vanilla_async_on_one_worker_is_compute_push_and_pull() -> None:
    config = MLfabricSimConfig(**{**SMALL, "workers": 2, "updates": 10})
    run = simulate_mode(config, "ps-async")
    # two workers in lockstep share the server's NIC both ways: 0.05 + 2 x 0.2 per update pair;
    # the 10th update is applied when the 5th pair's pushes land (before their pulls)
    assert run["applied"] == 10 and run["dropped"] == 0
    assert run["time_s"] == pytest.approx(4 * (0.05 + 0.2 + 0.2) + 0.05 + 0.2, rel=1e-6)
    # the other worker's update lands in between: applied onto the version after the one it
    # was computed from, a delay of 1 as the runtime's server records it
    assert run["max_delay"] == 1
    # the delay bound is the server's async:TAU: a delay of TAU is applied, TAU + 1 dropped
    bounded = simulate_mode(config, "ps-async:1")
    assert bounded["dropped"] == 0 and bounded["max_delay"] == 1
    strict = simulate_mode(config, "ps-async:0")
    assert strict["dropped"] > 0 and strict["max_delay"] == 0 and strict["applied"] >= 10


def test_the_compute_spread_breaks_the_fluid_models_lock_step() -> None:
    # 8 identical async workers that start together: with every step's compute the same, max-min
    # sharing ends their pushes together and their pulls together, so the server's NIC carries
    # all pushes, then all pulls (each direction under half busy) -- the phase never breaks.
    # Regression: the simulated ps-async was up to 24% slower than the emulated runs for this.
    fields = {**SMALL, "workers": 8, "compute_s": 0.2, "updates": 160}
    locked = simulate_mode(MLfabricSimConfig(**fields), "ps-async")
    # 20 rounds of compute 0.2 s, 8 pushes sharing the server's down-link (0.8 s), 8 pulls (0.8 s)
    assert locked["time_s"] == pytest.approx(20 * 1.8 - 0.8, rel=0.02)
    assert locked["server_busy_in"] < 0.5 and locked["server_busy_out"] < 0.5
    spread = simulate_mode(MLfabricSimConfig(**{**fields, "compute_jitter": 0.3}), "ps-async")
    assert spread["time_s"] < 0.65 * locked["time_s"]  # the two directions overlap
    assert spread["server_busy_in"] > 0.7 and spread["server_busy_out"] > 0.7
    # the default spread is on, mean-preserving and seeded: the same run twice, another seed differs
    default = MLfabricSimConfig(**{**fields, "compute_jitter": MLfabricSimConfig().compute_jitter})
    assert default.compute_jitter == 0.1
    from mlfabric.sim.mlfabric import _Environment

    env = _Environment(default)
    times = np.array([[env.compute(w, i) for w in range(8)] for i in range(400)])
    assert times.min() >= 0.2 * 0.9 and times.max() <= 0.2 * 1.1 and times.mean() == pytest.approx(0.2, rel=0.01)
    assert len(np.unique(times)) > 3000
    assert simulate_mode(default, "ps-async") == simulate_mode(default, "ps-async")
    # the synchronous collectives take no spread (their iterations start together: no phase)
    ring = simulate_mode(dataclasses.replace(default, updates=40), "allreduce")
    assert ring == simulate_mode(dataclasses.replace(default, updates=40, compute_jitter=0.0), "allreduce")
    other = simulate_mode(dataclasses.replace(default, seed=1), "ps-async")
    assert other["time_s"] != simulate_mode(default, "ps-async")["time_s"]


def test_mlfabric_modes_run_the_runtimes_scheduler_and_bound_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlfabric.ps.scheduler import Scheduler, distribute

    calls = {"schedule": 0, "distribute": 0}
    schedule = Scheduler.schedule

    def counted(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        calls["schedule"] += 1
        return schedule(self, *args, **kwargs)

    def counted_distribute(*args: Any, **kwargs: Any) -> Any:
        calls["distribute"] += 1
        return distribute(*args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", counted)
    monkeypatch.setattr("mlfabric.ps.scheduler.aggregation.distribute", counted_distribute)  # via plan_pull_batch
    config = MLfabricSimConfig(**{**SMALL, "workers": 6, "updates": 120, "straggler": "C2", "churn": "N2",
                                  "churn_period_s": 0.5})
    a = simulate_mode(config, "mlfabric-a:3")
    assert a["applied"] >= 120 and a["max_delay"] <= 3
    # aggregates reached the server, and (as in the runtime) an aggregate of m updates took m
    # versions: the delays the scheduler planned are the delays applied (regression: the
    # simulator advanced one version per aggregate, so its delays were smaller than planned)
    assert a["server_transfers_per_batch"] * a["batches"] < a["applied"]
    assert a["versions"] == a["applied"]
    assert calls["schedule"] > 0
    s = simulate_mode(config, "mlfabric-s")
    assert s["applied"] == 120 and s["versions"] == 20 and s["max_delay"] == 0  # one version per round
    assert calls["distribute"] > 0  # a round's 6 pulls are answered through distributors
    assert simulate_mode(config, "mlfabric-a:3") == a  # deterministic for a seed


def test_table2_grid_and_speedups_against_rr_sync() -> None:
    config = MLfabricSimConfig(**{**SMALL, "updates": 20})
    rows = simulate_table2(config, ["allreduce", "ps-async"], ["none", "C2"], [None, "N3"])
    assert len(rows) == 8 and {(r["inject"], r["churn"]) for r in rows} == {
        ("none", "none"), ("C2", "none"), ("none", "N3"), ("C2", "N3")}
    for r in rows:
        if r["mode"] == "allreduce":
            assert r["speedup"] == 1.0
    grid = table2(rows, "ps-async")
    assert set(grid) == {"none", "C2"} and set(grid["C2"]) == {"none", "N3"}
    # N3 halves the average NIC rate: the same work takes longer
    slow = [r["time_s"] for r in rows if r["mode"] == "allreduce" and r["inject"] == "none"]
    assert slow[1] > slow[0]
    runs = simulate_mlfabric(MLfabricSimConfig(**{**SMALL, "updates_needed": {"ps-async": 80}}),
                             ["allreduce", "ps-async"])
    assert runs[1]["applied"] == 80 and runs[0]["applied"] == 40


@pytest.mark.parametrize(("fields", "message"), [
    ({"workers": 1}, "at least 2 workers"),
    ({"update_bytes": 0.0}, "update_bytes must be a positive"),
    ({"straggler": "C9"}, "C1"),
    ({"churn": "N7"}, "N1, N2, N3"),
    ({"updates_needed": {"ps-async": 0}}, "updates"),
    ({"compute_jitter": 1.0}, "compute_jitter must be in"),
    ({"control_latency_s": -0.01}, "control_latency_s must be >= 0"),
    ({"compute_slowest_s": -1.0}, "compute_slowest_s must be >= 0"),
    ({"compute_jitter": -0.1}, "compute_jitter must be in"),
])
def test_config_errors_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLfabricSimConfig(**fields)
    with pytest.raises(ValueError, match="unknown simulated mode 'ps-bsp'"):
        simulate_mode(MLfabricSimConfig(**SMALL), "ps-bsp")


def test_simulate_mlfabric_cli_writes_table2(tmp_path: Any) -> None:
    from mlfabric.cli import app

    out = tmp_path / "t2.json"
    result = CliRunner().invoke(app, ["simulate", "mlfabric", "--workers", "4", "--update-size", "1MB", "--rate",
                                      "80mbit", "--compute", "50ms", "--inject", "C1", "--churn", "N1", "--sync",
                                      "allreduce,mlfabric-a:4", "--updates", "40", "--json", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "mlfabric-a:4 vs RR-Sync" in result.output and "[1.74]" in result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "simulate-mlfabric" and len(data["runs"]) == 2
    speedup = data["table2"]["mlfabric-a:4"]["C1"]["N1"]
    assert math.isfinite(speedup) and speedup > 0 and data["paper_table2"]["C2"]["N1"] == 2.96
    bad = CliRunner().invoke(app, ["simulate", "mlfabric", "--updates-needed", "ps-async"], env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "MODE=N" in bad.output


def _curve(values: list[float], steps_per_epoch: int = 5) -> list[dict[str, Any]]:
    return [{"epoch": i + 1, "step": (i + 1) * steps_per_epoch, "val_metric": v} for i, v in enumerate(values)]


def test_emulated_cells_are_simulated_with_the_updates_they_needed(tmp_path: Any) -> None:
    from mlfabric.cli import app
    from mlfabric.sim.mlfabric import compare_with_emulation, updates_to_target

    run = {"metric": "accuracy", "curve": _curve([0.3, 0.6, 0.9])}
    assert updates_to_target(run, 0.6, 4) == 10 * 4 and updates_to_target(run, 0.95, 4) is None
    assert updates_to_target({"metric": "mse", "curve": _curve([3.0, 1.0])}, 2.0, 2) == 20
    train = {
        "metadata": {"emulation": {"churn": "N1"}},
        "config": {"workers": 4, "injects": ["C2"]},
        "runs": [{"inject": "C2", "mode": "allreduce", "metric": "accuracy", "curve": _curve([0.5, 0.8])},
                 {"inject": "C2", "mode": "mlfabric-a:4", "metric": "accuracy", "curve": _curve([0.7, 0.9])},
                 {"inject": "C2", "mode": "eager-solo", "metric": "accuracy", "curve": _curve([0.9])}],
        "comparisons": [{"inject": "C2", "mode": "mlfabric-a:4", "target": 0.8, "time_speedup": 1.5},
                        {"inject": "C2", "mode": "eager-solo", "target": 0.8, "time_speedup": 2.0}],
    }
    config = MLfabricSimConfig(**SMALL)
    rows = compare_with_emulation(config, train)
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"allreduce", "mlfabric-a:4"}  # eager modes are not simulated
    assert by_mode["allreduce"]["updates"] == 40 and by_mode["mlfabric-a:4"]["updates"] == 40
    a = by_mode["mlfabric-a:4"]
    assert a["simulated"]["applied"] >= 40 and a["emulated_speedup"] == 1.5
    assert a["sim_over_emu"] == pytest.approx(a["simulated_speedup"] / 1.5)
    path = tmp_path / "train.json"
    path.write_text(json.dumps(train))
    out = tmp_path / "cmp.json"
    result = CliRunner().invoke(app, ["simulate", "mlfabric", "--update-size", "1MB", "--rate", "80mbit",
                                      "--compute", "50ms", "--emulated", str(path), "--json", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["rows"][1]["mode"] == "mlfabric-a:4"
    assert "within 15%: " in result.output and "launches" not in result.output
    twice = CliRunner().invoke(app, ["simulate", "mlfabric", "--update-size", "1MB", "--rate", "80mbit",
                                     "--compute", "50ms", "--emulated", str(path), "--emulated", str(path),
                                     "--json", str(out)], env={"COLUMNS": "200"})
    assert twice.exit_code == 0, twice.output
    assert "over the 2 launches: median speedups" in twice.output
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["mode"] == "mlfabric-a:4" and cell["launches"] == 2 and cell["emulated_speedup"] == 1.5
    assert not a["compute_measured"] and a["compute_s"] == 0.05 and a["compute_jitter"] == 0.0
    # a run that measured its steps' compute is simulated with it: the mean, and a uniform
    # spread of the same standard deviation
    measured = json.loads(json.dumps(train))
    measured["runs"][1]["compute_s"] = {"mean": 0.08, "cv": 0.1, "steps": 200}
    rows = {r["mode"]: r for r in compare_with_emulation(config, measured)}
    assert rows["mlfabric-a:4"]["compute_measured"] and not rows["allreduce"]["compute_measured"]
    assert rows["mlfabric-a:4"]["compute_s"] == 0.08
    assert rows["mlfabric-a:4"]["compute_jitter"] == pytest.approx(math.sqrt(3) * 0.1)
    assert rows["mlfabric-a:4"]["simulated"]["time_s"] > a["simulated"]["time_s"]  # 80 ms steps instead of 50
    assert rows["allreduce"]["simulated"]["time_s"] == by_mode["allreduce"]["simulated"]["time_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    refused = CliRunner().invoke(app, ["simulate", "mlfabric", "--emulated", str(bad)], env={"COLUMNS": "200"})
    assert refused.exit_code == 2 and "not the JSON of an emulated" in refused.output


def test_a_scheduled_run_says_where_a_workers_cycle_went() -> None:
    # No stragglers, no churn: every cycle is compute + the three waits, so their means add
    # up to the run's time per update; every computed update went into exactly one batch.
    config = MLfabricSimConfig(**{**SMALL, "workers": 6, "updates": 120, "straggler": None, "churn": None})
    run = simulate_mode(config, "mlfabric-a:20")
    computed = run["applied"] + run["dropped"]
    assert run["batches"] > 0
    assert run["mean_batch"] * run["batches"] == pytest.approx(computed, abs=config.workers)
    assert 1 <= run["server_transfers_per_batch"] <= run["mean_batch"]
    assert 0 <= run["batch_wait_s"] <= config.interval_s + 1e-9
    cycle = config.compute_s + run["batch_wait_s"] + run["commit_wait_s"] + run["model_wait_s"]
    assert cycle == pytest.approx(run["time_s"] * config.workers / computed, rel=0.1)
    transfer_s = config.update_bytes * 8 / config.rate_bps
    assert run["commit_wait_s"] >= transfer_s and run["model_wait_s"] >= transfer_s * (1 - 1e-9)


def test_the_cycle_floors_of_the_papers_setting() -> None:
    # C2: 10% of draws 4x slower -> mean compute 0.13 s; 100 MB at 10 Gbit/s: T = 80 ms.
    floors = cycle_floor_s(MLfabricSimConfig(straggler="C2", churn="N1"))
    assert floors["any"] == pytest.approx(0.13 + 2 * 0.08)
    b = 0.13 + 1.5 * 0.08
    assert floors["one_level"] == pytest.approx((b + math.sqrt(b * b + 2 * 30 * 0.08 ** 2)) / 2)
    assert floors["one_level"] == pytest.approx(0.459, abs=1e-3)
    # the floor is a fixed point of y = c + 1.5 T + W T^2 / (2 y), above the aggregation-free bound
    y = floors["one_level"]
    assert y == pytest.approx(b + 30 * 0.08 ** 2 / (2 * y))
    assert cycle_floor_s(MLfabricSimConfig(straggler=None, churn=None, workers=2))["any"] == pytest.approx(0.26)
    request = cycle_floor_s(MLfabricSimConfig(straggler="C2", churn="N1", pull_after="request"))
    b = 0.13 + 0.5 * 0.08
    assert request["any"] == pytest.approx(0.21)
    assert request["one_level"] == pytest.approx((b + math.sqrt(b * b + 2 * 30 * 0.08 ** 2)) / 2)


def test_no_simulated_run_beats_its_ceiling() -> None:
    # The simulator's MLfabric-A obeys the floors: its measured cycle is at least the one-level
    # floor and its speedup at most the ceilings it reports (a run above them would be a bug).
    config = MLfabricSimConfig(**{**SMALL, "workers": 6, "updates": 120, "straggler": "C1", "churn": None})
    runs = {r["mode"]: r for r in simulate_mlfabric(config, ["allreduce", "mlfabric-a:20"])}
    a = runs["mlfabric-a:20"]
    assert 0 < a["speedup"] <= a["ceiling_one_level"] <= a["ceiling_any"]
    assert a["time_s"] * config.workers / a["applied"] >= cycle_floor_s(config)["one_level"]
    assert "ceiling_any" not in runs["allreduce"]
    # answered at once, the pull takes the update out of the cycle: higher ceilings, still obeyed
    request = dataclasses.replace(config, pull_after="request")
    r = simulate_mlfabric(request, ["allreduce", "mlfabric-a:20"])[1]
    assert 0 < r["speedup"] <= r["ceiling_one_level"] <= r["ceiling_any"]
    assert r["ceiling_any"] > a["ceiling_any"] and r["ceiling_one_level"] > a["ceiling_one_level"]
    assert (r["applied"] + r["dropped"]) * cycle_floor_s(request)["one_level"] <= r["time_s"] * config.workers * 1.05


def test_an_emulated_run_is_simulated_on_the_part_of_its_launchs_churn_it_met(tmp_path: Any) -> None:
    """Regression (issue #35, check 4): the modes of one emulated launch run one after another
    under one churn, so each meets another part of it; the simulator drew every mode's churn
    from time 0. A run that recorded where it started (``churn_offset_s``) replays its part."""
    from mlfabric.emu.churn import TraceWriter
    from mlfabric.sim.mlfabric import churn_replay, compare_with_emulation
    from mlfabric.topo.trace import TraceRow

    def rows(t: float, hosts: int, server_rate: float) -> list[TraceRow]:
        return [TraceRow(time_s=t, host=h, nic=0, direction=d, rate_bps=server_rate if h == 0 else 8e7)
                for h in range(hosts) for d in ("egress", "ingress")]

    # the PS launch: the server's NIC at full rate for 100 s, then at a quarter of it
    ps_rows = rows(0.0, 5, 8e7) + rows(100.0, 5, 2e7)
    replay = churn_replay(ps_rows, 60.0, worker_hosts=4, rate_bps=8e7, server_launch=True)
    assert [t for t, _, _ in replay.changes] == [0.0, 40.0]
    assert replay.changes[0][1][0] == 1e7 and replay.changes[1][1][0] == 2.5e6 and replay.changes[1][2][1] == 1e7
    # a collective launch's hosts are the workers: simulated hosts 1..W (the server at the base rate)
    collective = churn_replay(rows(0.0, 4, 4e7), 3.0, worker_hosts=4, rate_bps=8e7, server_launch=False)
    assert collective.changes == ((0.0, (1e7, 5e6, 1e7, 1e7, 1e7), (1e7, 5e6, 1e7, 1e7, 1e7)),)

    for name, launch_rows in (("churn-parameter-server.csv", ps_rows), ("churn-collective.csv", rows(0.0, 4, 8e7))):
        writer = TraceWriter(tmp_path / name)
        writer.write(launch_rows)
        writer.close()
    train = {
        "metadata": {"emulation": {"churn": "N1", "launches": [
            {"launch": "collective", "churn_trace": "/gone/churn-collective.csv"},  # found beside the JSON
            {"launch": "parameter-server", "churn_trace": "/gone/churn-parameter-server.csv"}]}},
        "config": {"workers": 4, "injects": ["C2"]},
        "runs": [{"inject": "C2", "mode": "allreduce", "metric": "accuracy", "curve": _curve([0.5, 0.8]),
                  "churn_offset_s": 1.0},
                 {"inject": "C2", "mode": "ps-async", "metric": "accuracy", "curve": _curve([0.7, 0.9]),
                  "churn_offset_s": 2.0},
                 {"inject": "C2", "mode": "mlfabric-a:4", "metric": "accuracy", "curve": _curve([0.7, 0.9]),
                  "churn_offset_s": 99.0}],
        "comparisons": [{"inject": "C2", "mode": "ps-async", "target": 0.8, "time_speedup": 1.0},
                        {"inject": "C2", "mode": "mlfabric-a:4", "target": 0.8, "time_speedup": 1.0}],
    }
    config = MLfabricSimConfig(**{**SMALL, "rate_bps": 8e7, "update_bytes": 1e6})
    replayed = {r["mode"]: r for r in compare_with_emulation(config, train, base_dir=tmp_path)}
    assert all(r["replayed"] for r in replayed.values())
    # the same work: the scheduled mode met the server's slow NIC, the asynchronous one did not
    assert replayed["mlfabric-a:4"]["simulated"]["time_s"] > 1.5 * replayed["ps-async"]["simulated"]["time_s"]
    drawn = {r["mode"]: r for r in compare_with_emulation(config, train)}  # no traces at hand: drawn from 0
    assert not any(r["replayed"] for r in drawn.values())
    # Regression: a launch's files moved elsewhere (their recorded path, relative to the run's
    # working directory, now names another launch's trace) replay the trace beside the JSON.
    other = tmp_path / "other"
    other.mkdir()
    writer = TraceWriter(other / "churn-parameter-server.csv")
    writer.write(rows(0.0, 5, 8e7))  # that other launch's server never slowed down
    writer.close()
    moved = json.loads(json.dumps(train))
    moved["metadata"]["emulation"]["launches"][1]["churn_trace"] = str(other / "churn-parameter-server.csv")
    again = {r["mode"]: r for r in compare_with_emulation(config, moved, base_dir=tmp_path)}
    assert again["mlfabric-a:4"]["simulated"]["time_s"] == replayed["mlfabric-a:4"]["simulated"]["time_s"]


def test_an_emulated_run_with_workers_sharing_hosts_replays_its_hosts_churn(tmp_path: Any) -> None:
    """Regression: a run with two workers per host (#36's ``--workers-per-host 2``) replayed
    its launch's trace onto one simulated host per worker, which the scheduler's monitor
    (one entry per host) refused: "host 5 is outside 0..4". The replay takes the run's hosts,
    and the cell its co-located workers, from the run's JSON."""
    from mlfabric.emu.churn import TraceWriter
    from mlfabric.sim.mlfabric import compare_with_emulation
    from mlfabric.topo.trace import TraceRow

    def rows(hosts: int, slow: int) -> list[TraceRow]:
        return [TraceRow(time_s=0.0, host=h, nic=0, direction=d, rate_bps=2e7 if h == slow else 8e7)
                for h in range(hosts) for d in ("egress", "ingress")]

    for name, launch_rows in (("churn-parameter-server.csv", rows(5, 2)), ("churn-collective.csv", rows(4, 1))):
        writer = TraceWriter(tmp_path / name)
        writer.write(launch_rows)
        writer.close()
    train = {
        "metadata": {"emulation": {"churn": "N1", "launches": [
            {"launch": "collective", "churn_trace": "churn-collective.csv"},
            {"launch": "parameter-server", "churn_trace": "churn-parameter-server.csv"}]}},
        "config": {"workers": 8, "workers_per_host": 2, "injects": ["C1"]},
        "runs": [{"inject": "C1", "mode": "allreduce", "metric": "accuracy", "curve": _curve([0.5, 0.8]),
                  "churn_offset_s": 1.0},
                 {"inject": "C1", "mode": "mlfabric-a:8", "metric": "accuracy", "curve": _curve([0.7, 0.9]),
                  "churn_offset_s": 2.0}],
        "comparisons": [{"inject": "C1", "mode": "mlfabric-a:8", "target": 0.8, "time_speedup": 1.0}],
    }
    config = MLfabricSimConfig(**{**SMALL, "rate_bps": 8e7, "update_bytes": 1e6, "trees": True,
                                  "chunk_bytes": 1 << 16})  # one worker a host: the JSON says two
    rows_out = {r["mode"]: r for r in compare_with_emulation(config, train, base_dir=tmp_path)}
    assert all(r["replayed"] for r in rows_out.values()) and set(rows_out) == {"allreduce", "mlfabric-a:8"}
    # the ring ran over the 4 hosts, the slowest NIC (host 1 at a quarter) its bottleneck:
    # 80 updates (two epochs of 5 steps, 8 workers) = 10 iterations of at least 2 x 3/4 x 1 MB
    # at 2.5 MB/s each
    assert rows_out["allreduce"]["simulated"]["iterations"] == 10
    assert rows_out["allreduce"]["simulated"]["time_s"] >= 10 * (2 * 3 / 4 * 1e6 / 2.5e6)


# --------------------------------------------------------------------------- #36: trees, hosts

HOSTS2 = {**SMALL, "workers": 8, "workers_per_host": 2, "updates": 160, "straggler": "C1", "churn": "N1",
          "churn_period_s": 0.5, "trees": True, "chunk_bytes": 1 << 16}


def test_a_tree_flow_moves_every_edge_at_one_rate_sharing_nics_by_streams() -> None:
    net = _StarNet(np.full(4, 10.0), np.full(4, 10.0))
    ends: dict[str, tuple[float, float]] = {}
    # hosts 1 and 3 into 2, 2 into the server 0: host 2's down-link carries two streams
    net.add_tree([(1, 2), (3, 2), (2, 0)], 10.0, lambda t, r: ends.setdefault("tree", (t, r)))
    assert net.flows[0].rate == pytest.approx(5.0)
    net.add(2, 3, 10.0, lambda t: ends.setdefault("other", (t, 0.0)))  # shares host 2's up-link max-min
    assert [f.rate for f in net.flows] == pytest.approx([5.0, 5.0])
    while net.flows:
        for f in net.advance(net.next_finish()):
            f.done(net.now)
    assert ends["tree"] == pytest.approx((2.0, 5.0))


def test_rr_sync_rings_the_hosts_when_workers_share_them() -> None:
    from mlfabric.sim import ring_closed_form_s

    config = MLfabricSimConfig(**{**SMALL, "workers": 8, "workers_per_host": 2, "updates": 80})
    ring = simulate_mode(config, "allreduce")
    # the host sums its two workers' gradients for free; the ring runs over the 4 hosts
    assert ring["time_s"] == pytest.approx(10 * (0.05 + ring_closed_form_s(4, 1 * MB, 80e6)), rel=1e-6)
    with pytest.raises(ValueError, match="multiple of workers_per_host"):
        MLfabricSimConfig(**{**SMALL, "workers": 5, "workers_per_host": 2})


def test_trees_and_host_requests_keep_the_delay_bound_and_spare_the_servers_nic() -> None:
    config = MLfabricSimConfig(**HOSTS2)
    a = simulate_mode(config, "mlfabric-a:6")
    assert a["applied"] >= 160 and a["versions"] == a["applied"]
    assert a["max_delay"] <= 6  # no applied update's delay above tau
    assert a["max_model_lag"] <= 6  # and no worker computed on a version more than tau behind
    assert a["updates_per_server_transfer"] > 1.5  # trees (and hosts) carry several updates per transfer
    assert 0 < a["server_busy_in"] <= 1 and 0 < a["server_busy_out"] <= 1
    assert a["server_busy"] == max(a["server_busy_in"], a["server_busy_out"])
    assert simulate_mode(config, "mlfabric-a:6") == a  # deterministic for a seed
    s = simulate_mode(config, "mlfabric-s")
    assert s["applied"] == 160 and s["versions"] == 20 and s["max_delay"] == 0
    assert s["updates_per_server_transfer"] > 2
    plain = simulate_mode(dataclasses.replace(config, trees=False), "mlfabric-a:6")
    assert plain["updates_per_server_transfer"] < a["updates_per_server_transfer"]


def test_the_trees_ceiling_is_reported_and_obeyed() -> None:
    config = MLfabricSimConfig(**{**HOSTS2, "churn": None})
    floors = cycle_floor_s(config)
    t = 1 * MB * 8 / 80e6
    c = 0.05 * (1 + 0.1 * (2 - 1))  # C1: 10% of draws 2x slower
    assert floors["trees"] == pytest.approx(c + config.interval_s / 2 + 2 * t)
    a = simulate_mlfabric(config, ["allreduce", "mlfabric-a:6"])[1]
    assert 0 < a["speedup"] <= a["ceiling_trees"] <= a["ceiling_any"]


def test_mlfabrics_allreduce_is_mlfabric_s_rooted_at_a_worker_host() -> None:
    config = MLfabricSimConfig(**{**HOSTS2, "churn": None})
    r = simulate_mode(config, "mlfabric-allreduce")
    assert r["applied"] == 160 and r["versions"] == 20 and r["max_delay"] == 0  # one version per round
    assert r["updates_per_server_transfer"] > 1  # the root's NIC takes sums, not single updates
    s = simulate_mode(config, "mlfabric-s")
    assert r["time_s"] != s["time_s"]  # another sink: the root's own workers need no transfer
    with pytest.raises(ValueError, match="unknown simulated mode"):
        simulate_mode(config, "mlfabric-allreduce:3")


def test_the_cli_prints_the_papers_figures_beside_mlfabric_a_only(tmp_path: Any) -> None:
    # regression: "mlfabric-allreduce" starts with "mlfabric-a" and got MLfabric-A-30's figures
    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["simulate", "mlfabric", "--workers", "4", "--workers-per-host", "2",
                                      "--update-size", "1MB", "--rate", "80mbit", "--compute", "50ms", "--inject",
                                      "C1", "--churn", "N1", "--sync", "allreduce,mlfabric-allreduce,mlfabric-a:4",
                                      "--updates", "40", "--chunk-size", "64KiB"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    allreduce_table = result.output.split("mlfabric-allreduce vs RR-Sync")[1].split("vs RR-Sync")[0]
    assert "[1.74]" not in allreduce_table and "[1.74]" in result.output.split("mlfabric-a:4 vs RR-Sync")[1]
    assert "where the PS modes' time went" in result.output


def test_the_measured_compute_summary() -> None:
    from mlfabric.train.harness import compute_summary

    assert compute_summary([]) is None
    summary = compute_summary([[0.1], [0.3]])
    assert summary == {"mean": pytest.approx(0.2), "cv": pytest.approx(0.5), "steps": 2, "slowest_mean": 0.3}
    assert compute_summary([[0.0, 0.0]]) == {"mean": 0.0, "cv": 0.0, "steps": 2, "slowest_mean": 0.0}
    # per step index the slowest worker, over the steps every worker took
    assert compute_summary([[0.1, 0.4, 9.0], [0.2, 0.3]])["slowest_mean"] == pytest.approx(0.3)


def test_cells_over_several_launches_are_held_to_their_medians() -> None:
    from mlfabric.sim.mlfabric import across_launches

    def row(mode: str, emulated: float | None, simulated: float, inject: str = "C1") -> dict[str, Any]:
        return {"inject": inject, "churn": "N1", "mode": mode, "emulated_speedup": emulated,
                "simulated_speedup": simulated}

    rows = [row("allreduce", 1.0, 1.0), row("ps-async", 0.5, 0.40), row("ps-async", 0.6, 0.50),
            row("ps-async", 0.9, 0.45),  # a loaded launch: the median is not pulled by it
            row("mlfabric-s", None, 0.5), row("mlfabric-s", 0.4, 0.52),
            row("mlfabric-s", None, 0.3, inject="C2")]
    cells = {(c["inject"], c["mode"]): c for c in across_launches(rows)}
    assert set(cells) == {("C1", "ps-async"), ("C1", "mlfabric-s"), ("C2", "mlfabric-s")}  # RR-Sync left out
    ps = cells[("C1", "ps-async")]
    assert ps["launches"] == 3 and ps["reached"] == 3
    assert ps["emulated_speedup"] == 0.6 and ps["simulated_speedup"] == 0.45
    assert ps["sim_over_emu"] == pytest.approx(0.75) and not ps["within"]
    s_ = cells[("C1", "mlfabric-s")]  # only the launch that reached the target counts
    assert s_["reached"] == 1 and s_["sim_over_emu"] == pytest.approx(1.3) and not s_["within"]
    never = cells[("C2", "mlfabric-s")]
    assert never["sim_over_emu"] is None and never["within"] is False
    assert across_launches([row("ps-async", 0.5, 0.55)])[0]["within"]  # 1.10: within 15%


def test_control_messages_that_take_time_delay_the_scheduled_modes_only() -> None:
    # A fast network (1 MB in 1 ms), no stragglers: a request reaches the scheduler L late
    # (the batch wait grows by L) and the decision its worker L late (the planned transfer
    # starts L late: the wait for the update's commit grows by L), so each of a worker's 20
    # cycles takes 2 L more; the direct modes send no control messages.
    fields = {**SMALL, "workers": 6, "updates": 120, "rate_bps": 8e9}
    free = MLfabricSimConfig(**fields)
    slow = MLfabricSimConfig(**{**fields, "control_latency_s": 0.02})
    for mode in ("mlfabric-a:20", "mlfabric-s"):
        a, b = simulate_mode(free, mode), simulate_mode(slow, mode)
        assert b["applied"] == a["applied"] == 120
        assert b["time_s"] == pytest.approx(a["time_s"] + 20 * 2 * 0.02, rel=0.02)
        assert b["batch_wait_s"] == pytest.approx(a["batch_wait_s"] + 0.02, abs=2e-3)
        assert b["commit_wait_s"] == pytest.approx(a["commit_wait_s"] + 0.02, abs=2e-3)
    assert simulate_mode(slow, "ps-async") == simulate_mode(free, "ps-async")
    assert simulate_mode(slow, "allreduce") == simulate_mode(free, "allreduce")


def test_an_emulated_runs_measured_inputs() -> None:
    from mlfabric.sim.mlfabric import measured_inputs

    config = MLfabricSimConfig(**SMALL)
    assert measured_inputs(config, {}) == config  # nothing recorded: the config's own
    # a run entry of train's JSON (RunResult.to_dict: the PS figures beside the others)
    run = {"compute_s": {"mean": 0.07, "cv": 0.2, "steps": 10}, "decision_wait_ms": 70.0,
           "request_to_decision_ms": 30.0}
    used = measured_inputs(config, run)
    assert used.compute_s == 0.07 and used.compute_jitter == pytest.approx(math.sqrt(3) * 0.2)
    assert used.control_latency_s == pytest.approx(0.02)
    assert measured_inputs(config, {"compute_s": {"mean": 0.07, "cv": 0.9}}).compute_jitter == 0.9
    assert measured_inputs(config, {"decision_wait_ms": 20.0, "request_to_decision_ms": None}) == config
    # a synchronous collective waits for its slowest worker each iteration: that mean, no spread
    sync = {"mode": "allreduce", "compute_s": {"mean": 0.07, "cv": 0.2, "steps": 10, "slowest_mean": 0.09}}
    ring = measured_inputs(config, sync)
    assert ring.compute_s == 0.07 and ring.compute_slowest_s == 0.09
    assert measured_inputs(config, {**sync, "mode": "ps-async"}).compute_slowest_s is None
    assert measured_inputs(config, {**sync, "compute_s": {"mean": 0.07, "cv": 0.2}}).compute_slowest_s is None
    # the ring's iteration: at least the slowest worker's mean; a straggler's the mean x its slowdown
    calm = dataclasses.replace(config, workers=4, updates=40)
    base = simulate_mode(calm, "allreduce")["time_s"]
    floor = simulate_mode(dataclasses.replace(calm, compute_slowest_s=0.08), "allreduce")["time_s"]
    assert floor == pytest.approx(base + 10 * (0.08 - 0.05))
    strag = dataclasses.replace(calm, straggler="1,3", compute_slowest_s=0.08)  # every worker 3x: 0.15 > 0.08
    assert simulate_mode(strag, "allreduce")["time_s"] == pytest.approx(base + 10 * (0.15 - 0.05))
    from mlfabric.train.harness import RunResult

    entry = RunResult(inject="C1", mode="mlfabric-a:8", metric="accuracy", steps=4, loop_s=1.0, per_rank_loop_s=(1.0,),
                      curve=(), final_val_loss=0.0, final_metric=0.9, mean_active=None, contributed_fraction=None,
                      rounds_skipped=None, injected_s=0.0, samples_per_step=8,
                      ps={"decision_wait_ms": 70.0, "request_to_decision_ms": 30.0},
                      compute_s={"mean": 0.07, "cv": 0.2, "steps": 10}).to_dict()
    assert measured_inputs(config, entry) == used  # read from the JSON as train writes it
