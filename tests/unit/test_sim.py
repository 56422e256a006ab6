"""Flow-level simulator: closed forms, bytes on links, PS/SSP/trees, priorities, watchdog, determinism, CLI.

    .venv/bin/python -m pytest tests/unit/test_sim.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mlfabric.collectives import build
from mlfabric.schedule import ScheduleBuilder, ScheduleError, Slice
from mlfabric.sim import (
    STRAGGLER_PRESETS,
    TRANSFER,
    ComputeModel,
    EngineConfig,
    GraphBuilder,
    PSConfig,
    SimulationStalled,
    StragglerModel,
    compile_schedules,
    iteration_times,
    merge_graphs,
    ps_graph,
    ps_placement,
    rack_of,
    ring_closed_form_s,
    run_graph,
    simulate_collective,
    simulate_ps,
    straggler_preset,
    tree_parents,
)
from mlfabric.sim.bench import EngineBenchConfig, benchmark_engine, format_engine_benchmark
from mlfabric.topo import bcube, fat_tree, parse_topology, star

RATE = 10e9  # 10 Gbps


def rel_err(value: float, expected: float) -> float:
    return abs(value - expected) / expected


def ring_schedules(n: int, count: int, **options: object) -> list:
    return [build("allreduce:ring", n, r, count, **options) for r in range(n)]


# ---------------------------------------------------------------------------- closed forms (BML §2)


@pytest.mark.parametrize("spec", ["star:n=4", "star:n=8", "star:n=16", "fat-tree:k=4"])
@pytest.mark.parametrize("routing", ["ecmp", "spray"])
@pytest.mark.parametrize("size", [1_000_000, 99_999_999, 100_000_000])
def test_ring_allreduce_matches_closed_form(spec: str, routing: str, size: int) -> None:
    topo = parse_topology(spec, RATE)
    n = topo.n_hosts
    result = simulate_collective("ring", topo, size_bytes=size, config=EngineConfig(routing=routing))
    count = size // 4
    closed = ring_closed_form_s(n, count * 4, RATE)
    assert rel_err(result.time_s, closed) < 1e-3
    if count % n == 0:  # equal segments: exact up to rounding
        assert rel_err(result.time_s, closed) < 1e-9
    # Bytes on the wire equal each builder's stated cost, rank by rank (one rank per host).
    sent = result.host_bytes_sent()
    for r, sched in enumerate(ring_schedules(n, count)):
        assert sent[r] == sched.cost.bytes_sent(4)
    # Every host's ingress link carries what its left neighbour sent it.
    ingress = result.link_bytes[topo.nic_links[:, 0, 1]]
    assert np.array_equal(ingress, np.roll(sent, 1))


@pytest.mark.parametrize("algorithm", ["halving_doubling", "tree"])
@pytest.mark.parametrize("n", [5, 8])
def test_bytes_on_links_equal_stated_cost(algorithm: str, n: int) -> None:
    topo = star(n, RATE)
    count = 1 << 18
    result = simulate_collective(algorithm, topo, size_bytes=count * 4)
    sent = result.host_bytes_sent()
    for r in range(n):
        assert sent[r] == build(f"allreduce:{algorithm}", n, r, count).cost.bytes_sent(4)
    assert result.time_s > 0


@pytest.mark.parametrize("spec", ["star:n=4", "star:n=8", "star:n=16", "fat-tree:k=4"])
@pytest.mark.parametrize("size", [10_000_000, 64_000_000])
def test_p2p_parameter_server_matches_closed_form_with_spraying(spec: str, size: int) -> None:
    topo = parse_topology(spec, RATE)
    n = topo.n_hosts
    ps = PSConfig(workers=n, servers=n, model_bytes=size, placement="colocated")
    result = simulate_ps(topo, ps=ps, config=EngineConfig(routing="spray"))
    assert rel_err(result.time_s, ring_closed_form_s(n, size, RATE)) < 1e-3
    # Push + pull: every host sends (N-1)/N of the model in each phase, through its NIC.
    assert np.allclose(result.host_bytes_sent(), 2 * (n - 1) * size / n, rtol=1e-12)


def test_p2p_parameter_server_under_ecmp_is_slowed_by_hash_collisions() -> None:
    topo = fat_tree(4, RATE)
    ps = PSConfig(workers=16, servers=16, model_bytes=10_000_000, placement="colocated")
    closed = ring_closed_form_s(16, 10_000_000, RATE)
    ratios = [simulate_ps(topo, ps=ps, config=EngineConfig(routing="ecmp", seed=seed)).time_s / closed
              for seed in range(4)]
    assert min(ratios) >= 1 - 1e-9  # never faster than the non-blocking bound
    assert max(ratios) > 1.1  # collisions on core/aggregation links cost real time


def test_ring_allreduce_with_per_flow_ecmp_on_fat_tree_has_no_collisions() -> None:
    # Consecutive ranks: at most one ring flow leaves each edge switch and each pod.
    topo = fat_tree(4, RATE)
    for seed in range(3):
        result = simulate_collective("ring", topo, size_bytes=16_000_000, config=EngineConfig(seed=seed))
        assert rel_err(result.time_s, ring_closed_form_s(16, 16_000_000, RATE)) < 1e-9


def test_latency_adds_one_per_step() -> None:
    result = simulate_collective("ring", "star:n=4", "10Gbps", size_bytes=4_000_000,
                                 config=EngineConfig(latency_s=1e-3))
    assert rel_err(result.time_s, ring_closed_form_s(4, 4_000_000, RATE) + 2 * 3 * 1e-3) < 1e-9


def test_bcube_channel_selects_the_nic() -> None:
    topo = bcube(4, 2, RATE)  # host h has digits (h % 4, h // 4); NIC l corrects digit l
    # Hosts 0 and 5 differ in both digits: two shortest paths, one leaving through each NIC.
    for nic in (0, 1):
        for routing in ("ecmp", "spray"):
            b = GraphBuilder()
            b.add_transfers(0, 5, 1e6, nic=nic)
            result = run_graph(b.build(), topo, routing=routing)
            assert result.link_bytes[topo.nic_links[0, nic, 0]] == 1e6
            assert result.link_bytes[topo.nic_links[0, 1 - nic, 0]] == 0
    # Ring allreduce on channel "0": every rank's own sends leave through NIC 0; NIC 1 only
    # relays the four hops 3->4, 7->8, 11->12, 15->0 whose hosts differ in both digits.
    count = 1 << 20
    schedules = ring_schedules(16, count, channel="0")
    result = run_graph(compile_schedules(schedules), topo)
    egress = result.link_bytes[topo.nic_links[:, :, 0]]  # (hosts, nics)
    assert np.array_equal(egress[:, 0], [s.cost.bytes_sent(4) for s in schedules])
    assert egress[:, 1].sum() == 4 * schedules[3].cost.bytes_sent(4)
    assert rel_err(result.time_s, ring_closed_form_s(16, count * 4, RATE)) < 1e-9


# ---------------------------------------------------------------------------- parameter server


def test_ps_bsp_on_a_star_matches_the_naive_expectation() -> None:
    # W workers, S servers on distinct hosts of a star: in each phase every worker link
    # carries S flows and every server link W, all of model/S bytes, so each phase takes
    # model/S * 8 / min(R/S, R/W).
    workers, servers, model = 6, 2, 60_000_000
    topo = star(workers + servers, RATE)
    result = simulate_ps(topo, ps=PSConfig(workers=workers, servers=servers, model_bytes=model, placement="sequential"))
    phase = (model / servers * 8) / min(RATE / servers, RATE / workers)
    assert rel_err(result.time_s, 2 * phase) < 1e-9
    # Each server received W shards and sent W shards; each worker sent and received the model.
    bytes_sent = result.host_bytes_sent()
    assert np.allclose(bytes_sent[:workers], model) and np.allclose(bytes_sent[workers:], workers * model / servers)


def test_ps_compute_bsp_vs_ssp_follow_max_of_sums() -> None:
    # With a zero-byte model the network is free: BSP costs sum_i max_w t[i,w], SSP with a
    # staleness >= iterations costs max_w sum_i t[i,w]; staleness 0 is BSP.
    workers, iterations, seed = 6, 5, 3
    compute = ComputeModel(compute_s=1.0, speed_range=(1.0, 2.0), straggler=StragglerModel(probability=0.3, slowdown=4))
    times = compute.compute_times(iterations, workers, seed)
    topo = star(workers + 1, RATE)
    runs = {}
    for staleness in (0, iterations):
        ps = PSConfig(workers=workers, servers=1, model_bytes=0, iterations=iterations, staleness=staleness,
                      compute=compute, placement="sequential")
        runs[staleness] = simulate_ps(topo, ps=ps, config=EngineConfig(seed=seed))
    assert rel_err(runs[0].time_s, times.max(axis=1).sum()) < 1e-12
    assert rel_err(runs[iterations].time_s, times.sum(axis=0).max()) < 1e-12
    assert runs[iterations].time_s < runs[0].time_s
    ends = iteration_times(runs[0], iterations, workers)
    assert np.allclose(ends, np.cumsum(times.max(axis=1)))


def test_ssp_staleness_bounds_how_far_a_fast_worker_runs_ahead() -> None:
    # Worker 1 is 3x slower; with staleness 1, worker 0 may start iteration i only after the
    # pull of iteration i-2, which needs worker 1's push of iteration i-2.
    ps = PSConfig(workers=2, servers=1, model_bytes=0, iterations=6, staleness=1, placement="sequential",
                  compute=ComputeModel(compute_s=1.0, speeds=(3.0, 1.0)))
    result = simulate_ps(star(3, RATE), ps=ps)
    g = result.graph
    starts = result.task_start_s[g.label == g.label_names.index("compute")].reshape(6, 2)
    fast, slow = starts[:, 0], starts[:, 1]
    assert np.allclose(slow, np.arange(6) * 1.0)  # the slow worker never waits
    assert np.all(fast[2:] >= slow[:-2] + 1.0 - 1e-12)  # gate: pull of i-2 = slow push of i-2
    assert result.time_s == pytest.approx(6.0)


@pytest.mark.parametrize("strategy, degree", [("binary", 2), ("tree", 3)])
def test_tree_parents_have_in_degree_d(strategy: str, degree: int) -> None:
    topo = fat_tree(8, RATE)
    ps = PSConfig(workers=50, servers=4, model_bytes=1e6, strategy=strategy, degree=degree if strategy == "tree" else None)
    workers, servers = np.arange(50), np.arange(50, 54)
    parents = tree_parents(topo, ps, workers, servers)
    for j in range(4):
        children = np.bincount(parents[j][parents[j] >= 0], minlength=50)
        assert children.max() <= degree
        assert np.count_nonzero(parents[j] == -1) == degree  # the server's in-degree
        for w in range(50):  # every worker reaches the server without a cycle
            node, hops = w, 0
            while node >= 0:
                node, hops = parents[j][node], hops + 1
                assert hops <= 50
    # Rotation: different servers' trees use different aggregators.
    assert not np.array_equal(parents[0], parents[1])


def test_rack_trees_aggregate_once_per_rack() -> None:
    topo = fat_tree(8, RATE)  # 4 hosts per rack
    ps = PSConfig(workers=40, servers=3, model_bytes=1e6, strategy="rack")
    workers, servers = np.arange(40), np.arange(40, 43)
    parents = tree_parents(topo, ps, workers, servers)
    racks = rack_of(topo, workers)
    for j in range(3):
        aggregators = np.flatnonzero(parents[j] == -1)
        assert sorted(racks[aggregators].tolist()) == sorted(set(racks.tolist()))  # one per rack
        members = parents[j] >= 0
        assert np.array_equal(racks[parents[j][members]], racks[members])  # children in the same rack
        assert np.all(parents[j][parents[j][members]] == -1)  # depth 2
    assert len({tuple(np.flatnonzero(p == -1)) for p in parents}) == 3  # rotated per server


def test_trees_cut_server_traffic_and_beat_baseline_on_oversubscribed_fat_tree() -> None:
    topo = fat_tree(8, RATE, oversub=4)
    model, workers, servers = 10_000_000, 100, 8
    results = {s: simulate_ps(topo, ps=PSConfig(workers=workers, servers=servers, model_bytes=model, strategy=s))
               for s in ("baseline", "binary", "rack")}
    shard = model / servers
    w_hosts, s_hosts = ps_placement(topo, PSConfig(workers=workers, servers=servers, model_bytes=model), 0)
    for strategy, result in results.items():
        parents = tree_parents(topo, PSConfig(workers=workers, servers=servers, model_bytes=model, strategy=strategy),
                               w_hosts, s_hosts)
        into_server = result.link_bytes[topo.nic_links[s_hosts, 0, 1]]
        # A server receives one message of its shard per child in its tree (W for baseline).
        assert np.allclose(into_server, (parents == -1).sum(axis=1) * shard)
    assert results["binary"].time_s < results["baseline"].time_s
    assert results["rack"].time_s < results["baseline"].time_s
    assert results["rack"].link_bytes.sum() < results["baseline"].link_bytes.sum()


def test_global_barrier_waits_for_every_push() -> None:
    topo = fat_tree(4, RATE, oversub=2)
    ps = PSConfig(workers=10, servers=3, model_bytes=3_000_000, barrier="global")
    result = simulate_ps(topo, ps=ps)
    g = result.graph
    push = g.label == g.label_names.index("push")
    pull = g.label == g.label_names.index("pull")
    assert result.task_start_s[pull].min() >= result.task_finish_s[push].max()
    server = simulate_ps(topo, ps=PSConfig(workers=10, servers=3, model_bytes=3_000_000))
    gs = server.graph
    # With the per-server barrier some pull starts before the last push ends.
    assert server.task_start_s[gs.label == gs.label_names.index("pull")].min() < \
        server.task_finish_s[gs.label == gs.label_names.index("push")].max()


@pytest.mark.parametrize("routing", ["ecmp", "spray"])
def test_compiled_and_numpy_paths_simulate_the_same_iteration(routing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernels (re-solve, finish times) against the numpy paths, on a per-server
    barrier PS iteration with hundreds of events: same makespan and task times (1e-9)."""
    from mlfabric.flow import network as flow_network
    from mlfabric.sim import engine as sim_engine

    topo = fat_tree(8, RATE, oversub=4)
    ps = PSConfig(workers=40, servers=12, model_bytes=7_000_000)

    def simulate() -> object:
        return run_graph(ps_graph(topo, ps, seed=1), topo, EngineConfig(routing=routing, seed=1))

    native = simulate()
    monkeypatch.setattr(sim_engine, "_fill", None)  # numpy finish times, compiled re-solve
    numpy_progress = simulate()
    monkeypatch.setattr(flow_network, "_fill", None)  # numpy everywhere
    numpy_all = simulate()
    assert native.events > (50 if routing == "ecmp" else 5)  # spraying is symmetric: few distinct instants
    for other in (numpy_progress, numpy_all):
        assert other.events == native.events
        np.testing.assert_allclose(other.task_finish_s, native.task_finish_s, rtol=1e-9)
        assert abs(other.time_s - native.time_s) <= 1e-9 * native.time_s


@pytest.mark.parametrize("barrier", ["server", "global"])
def test_dependents_released_in_a_loop_or_vectorized_alike(barrier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine._complete's plain-Python release of a few edges and its numpy release give
    bit-identical runs (same events, task start and finish times)."""
    from mlfabric.sim import engine as sim_engine

    topo = fat_tree(4, RATE, oversub=2)
    graph = ps_graph(topo, PSConfig(workers=10, servers=4, model_bytes=3_000_000, barrier=barrier), seed=2)
    looped = run_graph(graph, topo, EngineConfig(seed=2))
    monkeypatch.setattr(sim_engine, "_FEW_EDGES", 0)
    vectorized = run_graph(graph, topo, EngineConfig(seed=2))
    monkeypatch.setattr(sim_engine, "_FEW_EDGES", 10**9)
    all_looped = run_graph(graph, topo, EngineConfig(seed=2))
    assert looped.events > 10
    for other in (vectorized, all_looped):
        assert other.events == looped.events
        assert np.array_equal(other.task_finish_s, looped.task_finish_s)
        assert np.array_equal(other.task_start_s, looped.task_start_s)


def test_compiled_progress_drains_at_the_old_rate_and_sets_finish_times() -> None:
    from mlfabric.flow.network import _fill

    ids = np.array([3, 0, 1, 2], dtype=np.int64)
    new_rates = np.array([0.0, 2.0, 0.0, np.inf])  # in the order of ids
    # Columns: remaining bits, rate, stamp, finish (engine._FlowClass.record).
    record = np.array([[10.0, 1.0, 0.0, 0.0], [10.0, 1.0, 0.0, 0.0], [10.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    in_candidates = np.array([False, False, False, True])
    near = np.zeros(4, dtype=np.int64)
    n_near = _fill.progress(ids, new_rates, record, in_candidates, near, 4.0, 10.0)
    # 4 s at rate 1: 6 bits left (the last flow had 1: none left, finishes now).
    np.testing.assert_array_equal(record[:, 0], [6.0, 6.0, 6.0, 0.0])
    np.testing.assert_array_equal(record[:, 3], [7.0, np.inf, 4.0, 4.0])
    np.testing.assert_array_equal(record[:, 1], [2.0, 0.0, np.inf, 0.0])
    np.testing.assert_array_equal(record[:, 2], [4.0] * 4)
    # Finishing by the horizon (10) and not yet a candidate: flows 0 and 2, in the order of ids.
    assert near[:n_near].tolist() == [0, 2]
    assert in_candidates.tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match="out of range"):
        _fill.progress(np.array([9], dtype=np.int64), new_rates[:1], record, in_candidates, near, 5.0, 10.0)
    with pytest.raises(ValueError, match="new_rates"):
        _fill.progress(ids, new_rates[:2], record, in_candidates, near, 5.0, 10.0)


def test_compiled_candidate_scans_keep_order_and_reset_what_they_drop() -> None:
    from mlfabric.flow.network import _fill

    # Finish times (column 3 of engine._FlowClass.record) of flows 0-5.
    record = np.zeros((6, 4))
    record[:, 3] = [5.0, 1.0, np.inf, 3.0, 9.0, 2.0]
    in_candidates = np.array([True, True, True, True, True, False])
    cand = np.array([4, 0, 3, 1, 2], dtype=np.int64)
    # earliest: past the horizon (6) go (unmarked), the rest keep their order.
    kept, first, horizon = _fill.earliest(cand, record, in_candidates, 6.0)
    assert (kept, first, horizon) == (3, 1.0, 6.0) and cand[:kept].tolist() == [0, 3, 1]
    assert in_candidates.tolist() == [True, True, False, True, False, False]
    # take: finishing by 3 go to out in order, with finish inf and unmarked.
    cand = cand[:kept]
    out = np.zeros(cand.size, dtype=np.int64)
    kept, taken = _fill.take(cand, record, in_candidates, 3.0, out)
    assert (kept, taken) == (1, 2) and cand[:kept].tolist() == [0] and out[:taken].tolist() == [3, 1]
    assert record[[3, 1], 3].tolist() == [np.inf, np.inf] and record[0, 3] == 5.0
    assert in_candidates.tolist() == [True, False, False, False, False, False]
    # Nothing by the horizon: none kept, earliest inf.
    assert _fill.earliest(np.array([0], dtype=np.int64), record, in_candidates, 4.0) == (0, np.inf, 4.0)
    with pytest.raises(ValueError, match="out of range"):
        _fill.earliest(np.array([6], dtype=np.int64), record, in_candidates, 4.0)
    with pytest.raises(ValueError, match="out of range"):
        _fill.take(np.array([-1], dtype=np.int64), record, in_candidates, 4.0, out)
    with pytest.raises(ValueError, match="out"):
        _fill.take(np.array([0, 4], dtype=np.int64), record, in_candidates, 4.0, np.zeros(1, dtype=np.int64))


def test_candidate_horizon_is_lowered_when_most_flows_are_due() -> None:
    """More than CANDIDATES_MAX candidates due by the horizon: it drops to the CANDIDATES-th
    earliest finish, and exactly the flows due by that stay (marked, in order)."""
    from mlfabric.flow.network import _fill

    n = _fill.CANDIDATES_MAX + 1
    rng = np.random.default_rng(0)
    record = np.zeros((n + 1, 4))
    record[:n, 3] = rng.permutation(n) + 1.0  # finish times 1 .. n, shuffled
    record[n, 3] = 1e9  # past the horizon
    cand = np.arange(n + 1, dtype=np.int64)[::-1].copy()
    in_candidates = np.ones(n + 1, dtype=bool)
    kept, first, horizon = _fill.earliest(cand, record, in_candidates, 1e6)
    assert (kept, first, horizon) == (_fill.CANDIDATES, 1.0, float(_fill.CANDIDATES))
    expected = [f for f in range(n, -1, -1) if record[f, 3] <= _fill.CANDIDATES]
    assert cand[:kept].tolist() == expected
    assert np.flatnonzero(in_candidates).tolist() == sorted(expected)
    # At the limit (CANDIDATES_MAX due) nothing changes.
    record[n - 1, 3] = 1e9
    cand = np.arange(n, dtype=np.int64)
    in_candidates[:] = True
    kept, _, horizon = _fill.earliest(cand, record[:n].copy(), in_candidates[:n].copy(), 1e6)
    assert (kept, horizon) == (_fill.CANDIDATES_MAX, 1e6)


def test_compiled_rebuild_takes_the_earliest_finish_times() -> None:
    from mlfabric.flow.network import _fill

    k = _fill.CANDIDATES
    finish = np.random.default_rng(2).permutation(k + 10) + 1.0
    record = np.zeros((k + 12, 4))
    record[: k + 10, 3] = finish
    record[k + 10 :, 3] = np.inf  # free slots
    in_candidates = np.zeros(k + 12, dtype=bool)
    out = np.zeros(k + 12, dtype=np.int64)
    n, horizon, first = _fill.rebuild(record, in_candidates, out)
    due = np.flatnonzero(record[:, 3] <= k)
    assert (n, horizon, first) == (k, float(k), 1.0) and out[:n].tolist() == due.tolist()
    assert np.flatnonzero(in_candidates).tolist() == due.tolist()
    # Fewer finite finish times than CANDIDATES: all of them, up to the largest.
    record[5:, 3] = np.inf
    in_candidates[:] = False
    n, horizon, first = _fill.rebuild(record, in_candidates, out)
    assert n == 5 and horizon == record[:5, 3].max() and first == record[:5, 3].min()
    record[:, 3] = np.inf
    assert _fill.rebuild(record, in_candidates, out) == (0, -np.inf, np.inf)
    with pytest.raises(ValueError, match="out"):
        _fill.rebuild(record, in_candidates, out[:3])


@pytest.mark.parametrize("native", [True, False])
def test_flow_class_lowers_a_crowded_horizon(native: bool) -> None:
    """_FlowClass.next_finish, compiled and numpy alike: a candidate set grown past
    _CANDIDATES_MAX (flows that became due by the horizon as rates rose) is cut back to the
    _CANDIDATES earliest, with the horizon at the last of them; a set at the limit is kept."""
    from mlfabric.flow import Incidence
    from mlfabric.sim import engine as sim_engine

    limit, keep = sim_engine._CANDIDATES_MAX, sim_engine._CANDIDATES
    n = limit + 50
    flow_class = sim_engine._FlowClass(0, np.full(4, RATE))
    flow_class.add(np.arange(n), Incidence.from_paths([[i % 4] for i in range(n)], 4), np.full(n, 1e6), 0.0)
    flow_class._native = native
    finish = np.random.default_rng(1).permutation(n) + 1.0
    flow_class.finish[:n] = finish
    flow_class.candidates = np.arange(n, dtype=np.int64)
    flow_class.in_candidates[:n] = True
    flow_class.horizon = 1e9
    assert flow_class.next_finish() == 1.0
    assert flow_class.horizon == float(keep)
    assert sorted(flow_class.candidates.tolist()) == np.flatnonzero(finish <= keep).tolist()
    assert np.flatnonzero(flow_class.in_candidates).tolist() == np.flatnonzero(finish <= keep).tolist()
    flow_class.candidates = np.arange(limit, dtype=np.int64)
    flow_class.in_candidates[:limit] = True
    flow_class.horizon = 1e9
    flow_class.next_finish()
    assert flow_class.horizon == 1e9 and flow_class.candidates.size == limit


def _compiled_loop_scenarios() -> dict[str, object]:
    """Runs that reach every place the compiled loop stops: tasks made ready (per-server
    barrier), FIFO connections, timers due (compute delays), horizon rebuilds."""
    ps_topo = fat_tree(8, RATE, oversub=4)
    ps = PSConfig(workers=40, servers=12, model_bytes=7_000_000)
    compute = ComputeModel(compute_s=2e-3, speed_range=(1.0, 3.0))
    ssp = PSConfig(workers=24, servers=6, model_bytes=3_000_000, iterations=3, staleness=1, compute=compute)
    return {
        "ps-server": lambda **o: run_graph(ps_graph(ps_topo, ps, seed=1), ps_topo, EngineConfig(seed=1, **o)),
        "ps-ssp-compute": lambda **o: simulate_ps(ps_topo, ps=ssp, config=EngineConfig(seed=3, **o)),
        "connections": lambda **o: run_graph(_connection_mix(), ps_topo, EngineConfig(seed=2, **o)),
    }


def _connection_mix() -> object:
    """300 transfers queued on 60 FIFO connections and 300 free ones, random pairs and sizes."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 128, 600)
    dst = (src + rng.integers(1, 128, 600)) % 128
    connection = np.where(np.arange(600) < 300, np.arange(600) % 60, -1)
    src[:300], dst[:300] = src[connection[:300]], dst[connection[:300]]  # a connection is one pair
    b = GraphBuilder()
    b.add_transfers(src, dst, rng.uniform(1e5, 3e6, 600), connection=connection)
    return b.build()


@pytest.mark.parametrize("scenario", ["ps-server", "ps-ssp-compute", "connections"])
def test_compiled_loop_is_bit_identical_to_the_python_loop(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.run with the compiled event loop (_fill.run_events) and without it: the same
    events, task times, link bytes and solver update counts, bit for bit; and the compiled
    loop really ran most events."""
    stops = record_compiled_runs(monkeypatch)
    run = _compiled_loop_scenarios()[scenario]
    # The compiled loop as it hands tasks made ready and connections back to Python (the
    # loop that runs them too, #37, is compared in tests/unit/test_sim_scale.py).
    compiled = run(compiled_tasks=False)
    python = run(compiled_loop=False)
    assert compiled.events == python.events > 20
    assert compiled.time_s == python.time_s
    for field in ("task_start_s", "task_finish_s", "link_bytes"):
        assert np.array_equal(getattr(compiled, field), getattr(python, field), equal_nan=True), field
    assert compiled.solver_updates == python.solver_updates
    events_compiled = sum(run for _, run in stops)
    assert events_compiled >= 0.5 * compiled.events
    kinds = {stop for stop, _ in stops}
    expected = {"ps-server": sim_engine_stop("READY"), "ps-ssp-compute": sim_engine_stop("REFRESHED"),
                "connections": sim_engine_stop("POPPED")}[scenario]
    assert expected in kinds


def record_compiled_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Wrap the compiled event loop (``_fill.run_events``) for the test: the list it returns
    gets (why the call stopped, events it ran) for every call."""
    from mlfabric.flow.network import _fill

    calls: list[tuple[int, int]] = []
    real = _fill.run_events

    def counting(*args: object) -> tuple:
        out = real(*args)
        calls.append((out[0], out[1]))
        return out

    monkeypatch.setattr(_fill, "run_events", counting)
    return calls


def sim_engine_stop(name: str) -> int:
    from mlfabric.sim import engine as sim_engine

    return getattr(sim_engine, f"_STOP_{name}")


def test_compiled_loop_compacts_entries_and_hands_back_watchdog_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlfabric.flow.network import FlowNetwork
    from mlfabric.sim import engine as sim_engine

    runs = record_compiled_runs(monkeypatch)
    compactions = []
    real = FlowNetwork._compact_entries

    def counting(self: FlowNetwork) -> None:
        compactions.append(self._dead_entries)
        real(self)

    monkeypatch.setattr(FlowNetwork, "_compact_entries", counting)
    monkeypatch.setattr(FlowNetwork, "_compact_min_dead", 64)
    run = _compiled_loop_scenarios()["ps-server"]
    compiled = run()
    assert len(compactions) >= 3 and min(compactions) > 64
    assert sim_engine._STOP_PAUSE in [stop for stop, _ in runs]  # the loop pauses for each compaction
    compactions.clear()
    python = run(compiled_loop=False)
    assert len(compactions) >= 3
    # Equal up to the last bits of re-solves whose reach grew (see test_sim_scale's assert_same_times).
    assert np.max(np.abs(compiled.task_finish_s - python.task_finish_s)) <= 1e-12 * python.time_s
    assert compiled.events == python.events
    # Pausing every 5 events (the wall-time check between calls) changes nothing.
    monkeypatch.setattr(sim_engine, "_COMPILED_BUDGET", 5)
    runs.clear()
    paused = run()
    assert [stop for stop, _ in runs].count(sim_engine._STOP_PAUSE) >= paused.events // 10
    assert np.array_equal(paused.task_finish_s, compiled.task_finish_s) and paused.events == python.events
    # The event limit and the wall-time limit hold inside the compiled loop too.
    with pytest.raises(SimulationStalled, match="more than 30 events"):
        run(max_events=30)
    with pytest.raises(SimulationStalled, match="wall-time limit"):
        run(max_wall_s=1e-9)


def test_compiled_loop_checks_its_buffers() -> None:
    from mlfabric.flow.network import _fill
    from mlfabric.sim.engine import Engine

    topo = fat_tree(4, RATE)
    engine = Engine(ps_graph(topo, PSConfig(workers=4, servers=2, model_bytes=1e6), seed=0), topo)
    assert engine._compiled
    flow_class = engine._classes[0]
    tiny = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="output buffer is too small"):
        _fill.run_events(flow_class.network, flow_class, engine, tiny, tiny, tiny, np.inf, 100, 10)
    big = np.zeros(engine.graph.n_tasks + 64, dtype=np.int64)
    with pytest.raises(AttributeError, match="record"):
        _fill.run_events(flow_class.network, engine, engine, big, big, big, np.inf, 100, 10)
    flow_class.record = flow_class.record.astype(np.float32)
    with pytest.raises(ValueError, match="record must hold >= 0 items of 8 bytes"):
        _fill.run_events(flow_class.network, flow_class, engine, big, big, big, np.inf, 100, 10)


# ---------------------------------------------------------------------------- priorities


def _transfer_job(src: int, dst: int, size: float) -> object:
    b = GraphBuilder()
    b.add_transfers(src, dst, size)
    return b.build()


def test_high_priority_job_finishes_as_if_alone() -> None:
    topo = star(3, RATE)
    alone = (100e6 * 8) / RATE
    jobs = [_transfer_job(0, 2, 100e6), _transfer_job(1, 2, 100e6)]  # both into host 2
    prioritized = run_graph(merge_graphs(jobs, names=["hi", "lo"], priorities=[0, 1]), topo)
    assert rel_err(prioritized.job_time_s[0], alone) < 1e-12
    assert rel_err(prioritized.job_time_s[1], 2 * alone) < 1e-12
    fair = run_graph(merge_graphs(jobs), topo)
    assert np.allclose(fair.job_time_s, 2 * alone, rtol=1e-12)
    flipped = run_graph(merge_graphs(jobs, priorities=[1, 0]), topo)
    assert rel_err(flipped.job_time_s[1], alone) < 1e-12


def test_low_priority_uses_what_high_priority_leaves() -> None:
    # High priority: 0->2 limited to half a link by sharing host 0's uplink with 0->1 (same
    # class). Low priority 1->2 gets the other half of host 2's downlink meanwhile.
    topo = star(3, RATE)
    b = GraphBuilder()
    b.add_transfers(np.array([0, 0]), np.array([1, 2]), np.array([100e6, 100e6]))
    high = b.build()
    low = _transfer_job(1, 2, 100e6)
    result = run_graph(merge_graphs([high, low], priorities=[0, 1]), topo)
    t = 100e6 * 8 / RATE
    assert rel_err(result.job_time_s[0], 2 * t) < 1e-12  # as if alone: two flows share one uplink
    assert rel_err(result.job_time_s[1], 2 * t) < 1e-12  # half rate for 2t: done exactly then


def test_concurrent_ps_jobs_with_priorities() -> None:
    topo = fat_tree(4, RATE, oversub=2)
    ps = PSConfig(workers=6, servers=2, model_bytes=4_000_000)
    fair = simulate_ps(topo, ps=ps, jobs=3)
    ranked = simulate_ps(topo, ps=ps, jobs=3, priorities=[2, 0, 1])
    # Job i is placed with placement stream i: the top job (1) runs as if it were alone.
    solo = run_graph(ps_graph(topo, ps, job=1), topo)
    assert rel_err(ranked.job_time_s[1], solo.time_s) < 1e-9
    assert ranked.job_time_s[1] < fair.job_time_s[1]
    assert ranked.job_time_s[0] > ranked.job_time_s[1]  # the lowest class waits for the others
    assert np.allclose(ranked.link_bytes.sum(), fair.link_bytes.sum())


# ---------------------------------------------------------------------------- watchdog and errors


def _deadlocked_pair() -> list:
    schedules = []
    for rank in range(2):
        b = ScheduleBuilder("hand", rank, 2)
        b.buffer("data", 4)
        r = b.recv(1 - rank, Slice("data", 0, 4), tag=0)
        b.send(1 - rank, Slice("data", 0, 4), tag=0, deps=[r])
        schedules.append(b.build(cost_placeholder()))
    return schedules


def cost_placeholder():
    from mlfabric.schedule import Cost

    return Cost(steps=1, elements_sent={"0": 4})


def test_watchdog_reports_a_deadlocked_schedule_set() -> None:
    with pytest.raises(SimulationStalled) as info:
        run_graph(compile_schedules(_deadlocked_pair()), star(2, RATE))
    message = str(info.value)
    assert "rank 0 op 0 Recv from rank 1" in message and "rank 1 op 0 Recv from rank 0" in message
    assert "deadlock" in message
    assert info.value.time_s == 0.0 and len(info.value.stuck) == 2


def test_watchdog_reports_a_flow_over_a_dead_link() -> None:
    topo = star(2, RATE)
    capacity = topo.capacity()
    capacity[topo.host_link(1, 0, "ingress")] = 0.0
    dead = topo.with_capacity(capacity)
    with pytest.raises(SimulationStalled, match=r"stalled at rate 0 over zero-capacity link\(s\) sw->h1"):
        run_graph(_transfer_job(0, 1, 1e6), dead)


def test_watchdog_limits_events() -> None:
    with pytest.raises(SimulationStalled, match="more than 3 events"):
        simulate_collective("ring", "star:n=4", "10Gbps", size_bytes=4_000_000, config=EngineConfig(max_events=3))


def test_unmatched_recv_is_a_schedule_error() -> None:
    b0 = ScheduleBuilder("hand", 0, 2)
    b0.buffer("data", 4)
    b0.recv(1, Slice("data", 0, 4), tag=5)
    b1 = ScheduleBuilder("hand", 1, 2)
    b1.buffer("data", 4)
    with pytest.raises(ScheduleError, match="rank 0 op 0: Recv from rank 1 .*tag 5.* no matching Send"):
        compile_schedules([b0.build(cost_placeholder()), b1.build(cost_placeholder())])


def test_any_of_dependencies_fire_on_the_first() -> None:
    # Rank 0 waits for either message; the Nop fires when the fast one (from host 1) lands.
    topo = star(3, RATE)
    b = GraphBuilder()
    fast = b.add_transfers(1, 0, 1e6)
    slow = b.add_transfers(2, 0, 4e6)
    gate = b.add_delays(0.0, label="nop")
    b.add_edges(np.concatenate([fast, slow]), np.concatenate([gate, gate]), any_of=True)
    result = run_graph(b.build(), topo)
    # Both share host 0's downlink: the small one finishes at 2 x 1 MB / R.
    assert rel_err(result.task_finish_s[gate[0]], 2 * 1e6 * 8 / RATE) < 1e-12


# ---------------------------------------------------------------------------- solver cross-check, determinism


def test_naive_solver_engine_agrees_with_flow_network() -> None:
    topo = fat_tree(4, RATE, oversub=2)
    ps = PSConfig(workers=10, servers=4, model_bytes=4_000_000, strategy="binary")
    fast = simulate_ps(topo, ps=ps, config=EngineConfig(seed=1))
    naive = simulate_ps(topo, ps=ps, config=EngineConfig(seed=1, solver="naive"))
    assert fast.events == naive.events
    np.testing.assert_allclose(fast.task_finish_s, naive.task_finish_s, rtol=1e-9)
    assert np.array_equal(fast.link_bytes, naive.link_bytes)


def test_same_seed_is_bit_identical_and_seeds_differ_under_ecmp() -> None:
    topo = fat_tree(4, RATE)
    ps = PSConfig(workers=10, servers=4, model_bytes=8_000_000, strategy="rack",
                  compute=ComputeModel(compute_s=0.01, straggler=STRAGGLER_PRESETS["C2"]))
    runs = [simulate_ps(topo, ps=ps, config=EngineConfig(seed=seed)) for seed in (7, 7, 8)]
    assert runs[0].time_s == runs[1].time_s
    assert np.array_equal(runs[0].task_finish_s, runs[1].task_finish_s, equal_nan=True)
    assert np.array_equal(runs[0].link_bytes, runs[1].link_bytes)
    assert runs[0].time_s != runs[2].time_s or not np.array_equal(runs[0].link_bytes, runs[2].link_bytes)


# ---------------------------------------------------------------------------- compute model


def test_straggler_presets_and_draws() -> None:
    assert straggler_preset("C1") == StragglerModel(probability=0.10, slowdown=2.0)
    assert straggler_preset("c2").slowdown == 4.0 and straggler_preset("C3").probability == 0.04
    assert straggler_preset("none") is None and straggler_preset("0.2,3") == StragglerModel(probability=0.2, slowdown=3)
    with pytest.raises(ValueError, match="unknown straggler"):
        straggler_preset("C9")
    factors = STRAGGLER_PRESETS["C2"].factors(200, 500, seed=1)
    assert set(np.unique(factors).tolist()) == {1.0, 4.0}
    assert abs((factors == 4.0).mean() - 0.10) < 0.01
    assert np.array_equal(factors[:50], STRAGGLER_PRESETS["C2"].factors(50, 500, seed=1))  # prefix-stable
    speeds = ComputeModel(compute_s=1, speed_range=(1.0, 2.0)).worker_speeds(1000, seed=0)
    assert speeds.min() >= 1.0 and speeds.max() <= 2.0
    with pytest.raises(ValueError):
        ComputeModel(speeds=(1.0,), speed_range=(1.0, 2.0))


def test_reduce_time_from_compute_model() -> None:
    # Ring reduce-scatter: N-1 receive-reduces per rank of count/N elements each, on the path.
    n, count = 4, 4_000_000
    model = ComputeModel(reduce_bytes_per_s=4e9)
    plain = simulate_collective("reduce_scatter", star(n, RATE), size_bytes=count * 4)
    slow = simulate_collective("reduce_scatter", star(n, RATE), size_bytes=count * 4, compute=model)
    per_step = count / n * 4 / 4e9
    assert rel_err(slow.time_s - plain.time_s, (n - 1) * per_step) < 1e-9


# ---------------------------------------------------------------------------- CLI and bench


def test_cli_simulate_collective_json() -> None:
    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["simulate", "collective", "--topology", "bcube:n=4,k=2", "--link", "10Gbps",
                                      "--algorithm", "ring", "--size", "100MB", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the JSON alone: the table went to stderr
    assert "mlfabric simulate collective" in result.stderr
    assert rel_err(data["time_s"], 0.15) < 1e-9 and data["closed_form_s"] == pytest.approx(0.15)
    assert data["ranks"] == 16 and data["algorithm"] == "allreduce:ring"
    assert sum(entry["bytes"] for entry in data["link_bytes"]) == pytest.approx(data["link_summary"]["total_bytes"])
    assert all(entry["name"] and entry["bytes"] > 0 for entry in data["link_bytes"])


def test_cli_simulate_ps_table_json_and_errors(tmp_path: Path) -> None:
    from mlfabric.cli import app

    out = tmp_path / "ps.json"
    args = ["simulate", "ps", "--topology", "fat-tree:k=4,oversub=4", "--workers", "8", "--servers", "2",
            "--strategy", "rack", "--model-size", "10MB", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "time per iteration" in result.output
    data = json.loads(out.read_text())
    assert data["time_s"] > 0 and data["strategy"] == "rack" and data["link_bytes"]
    assert data["iteration_end_s"] == [pytest.approx(data["time_s"])]
    bad = CliRunner().invoke(app, ["simulate", "ps", "--topology", "star:n=4", "--workers", "4", "--servers", "2"])
    assert bad.exit_code == 2 and "do not fit" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, ["simulate", "ps", "--topology", "star:n=8", "--workers", "4", "--servers", "2",
                                   "--strategy", "bogus"])
    assert bad.exit_code == 2 and "unknown PS strategy" in " ".join(bad.output.split())


def test_cli_plot_needs_matplotlib(tmp_path: Path) -> None:
    from mlfabric.cli import app

    png = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["simulate", "collective", "--topology", "star:n=4", "--size", "1MB",
                                      "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.exit_code == 1 and "pip install matplotlib" in result.output and not png.exists()
    else:
        assert result.exit_code == 0, result.output
        assert png.stat().st_size > 0


def test_engine_benchmark_small() -> None:
    figures = benchmark_engine(EngineBenchConfig(topology="fat-tree:k=8,oversub=4", sizes=((40, 8), (60, 40)),
                                                 targets=((40, 8, 60.0), (60, 40, 1e-9)), naive_workers=12,
                                                 naive_servers=4))
    runs = figures["runs"]
    assert [(r["workers"], r["servers"], r["barrier"]) for r in runs] == [
        (40, 8, "server"), (40, 8, "global"), (60, 40, "server"), (60, 40, "global")]
    assert runs[0]["flows"] == 2 * 40 * 8 and runs[0]["time_s"] > 0
    assert runs[2]["flows"] == runs[3]["flows"] == 2 * 60 * 40 and runs[2]["events"] > runs[3]["events"]
    assert [(r["target_wall_s"], r["target_met"]) for r in runs] == [(60.0, True)] * 2 + [(1e-9, False)] * 2
    side = figures["naive_side_by_side"]
    assert side["same_time"] and side["speedup_wall"] > 0
    text = format_engine_benchmark(figures)
    assert "naive solver" in text and "(target <= 60s: met)" in text and "(target <= 1e-09s: MISSED)" in text


# ---------------------------------------------------------------------------- FIFO connections


def test_messages_on_one_connection_move_one_at_a_time() -> None:
    topo = star(2, RATE)
    t = 100e6 * 8 / RATE
    for connection, expected in ((np.array([0, 0]), [t, 2 * t]),   # FIFO: the first at full rate
                                 (np.array([0, 1]), [2 * t, 2 * t]),  # two connections share the link
                                 (-1, [2 * t, 2 * t])):            # no connection: fair sharing
        b = GraphBuilder()
        b.add_transfers(0, 1, np.array([100e6, 100e6]), connection=connection)
        result = run_graph(b.build(), topo)
        np.testing.assert_allclose(result.task_finish_s, expected, rtol=1e-12)
        np.testing.assert_allclose(result.link_bytes.max(), 200e6, rtol=1e-12)


def test_connections_are_per_job_when_jobs_are_merged() -> None:
    topo = star(2, RATE)
    b = GraphBuilder()
    b.add_transfers(0, 1, 100e6, connection=0)
    job = b.build()
    merged = merge_graphs([job, job])
    assert merged.connection.tolist() == [0, 1]
    result = run_graph(merged, topo)
    np.testing.assert_allclose(result.job_time_s, [2 * 100e6 * 8 / RATE] * 2, rtol=1e-12)


def test_compiled_sends_share_one_connection_per_peer_and_channel() -> None:
    graph = compile_schedules([build("allreduce:ring", 4, r, 4000) for r in range(4)])
    sends = graph.kind == TRANSFER
    pairs = {(int(r), int(p)): set() for r, p in zip(graph.rank[sends], graph.peer[sends])}
    for r, p, c in zip(graph.rank[sends], graph.peer[sends], graph.connection[sends]):
        pairs[(int(r), int(p))].add(int(c))
    assert set(pairs) == {(r, (r + 1) % 4) for r in range(4)}
    assert all(len(ids) == 1 for ids in pairs.values())  # one connection per (rank, peer)
    assert len({next(iter(ids)) for ids in pairs.values()}) == 4


def test_a_late_rank_delays_the_ring_by_its_lateness_only() -> None:
    """Regression: with eager sends, the ranks waiting for a late rank queued several steps'
    messages to it; sharing its link fairly (instead of one message at a time, as its TCP
    stream does) delayed the message the ring needed next: one rank 50 ms late made the run
    take 455 ms instead of 220 ms (fat-tree k=4: 1.89 s instead of 250 ms)."""
    compute = ComputeModel(compute_s=0.05, speeds=(1.0, 1.0, 1.0, 0.5))  # rank 3 starts at 100 ms
    result = simulate_collective("ring", "star:n=4", "10Gbps", size_bytes=100e6, compute=compute)
    # 4 ranks, 25 MB segments: 20 ms per message at 10 Gbps; the ring's 6 steps (120 ms) start
    # when rank 3 does. Worked out by hand, message by message: 100 + 120 ms.
    assert result.time_s == pytest.approx(0.220, rel=1e-12)
    sixteen = (1.0, 1.0, 1.0, 0.5) + (1.0,) * 12
    wide = simulate_collective("ring", "fat-tree:k=4", "10Gbps", size_bytes=100e6,
                               compute=ComputeModel(compute_s=0.05, speeds=sixteen), config=EngineConfig(routing="spray"))
    assert wide.time_s == pytest.approx(0.100 + 2 * 15 / 16 * 100e6 * 8 / 10e9, rel=1e-12)


def _ring_with_compute_json(*options: str) -> dict:
    """``simulate collective`` of a 100 MB ring on star:n=4 at 10 Gbps after 50 ms of compute."""
    from mlfabric.cli import app

    out = CliRunner().invoke(app, ["simulate", "collective", "--topology", "star:n=4", "--link", "10Gbps",
                                   "--algorithm", "ring", "--size", "100MB", "--compute", "50ms", *options,
                                   "--json", "-", "--links", "none"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_cli_closed_form_counts_the_slowest_ranks_compute() -> None:
    data = _ring_with_compute_json("--straggler", "1,2")
    assert data["slowest_compute_s"] == pytest.approx(0.1, rel=1e-12)  # every rank 2x slower
    assert data["closed_form_s"] == pytest.approx(0.1 + 2 * 3 / 4 * 100e6 * 8 / 10e9, rel=1e-12)
    assert data["time_vs_closed_form"] == pytest.approx(1.0, rel=1e-9)


def test_per_flow_ecmp_puts_a_connections_messages_on_one_path() -> None:
    topo = fat_tree(4, RATE)  # hosts 0 and 15 are in different pods: 4 shortest paths
    for seed in range(4):
        result = simulate_collective("ring", topo, size_bytes=8_000_000, ranks=2, placement=[0, 15],
                                     chunks=4, config=EngineConfig(seed=seed))
        sends = result.graph.kind == TRANSFER
        assert len(set(result.graph.flow_key[sends].tolist())) == 2  # one key per direction
        # Each direction's 4 x 2 messages crossed one 6-link path: 12 links carry bytes.
        assert np.count_nonzero(result.link_bytes) == 12


def test_cli_collective_takes_worker_speeds() -> None:
    from mlfabric.cli import app

    data = _ring_with_compute_json("--speed-range", "0.5,1")
    assert 0.05 < data["slowest_compute_s"] <= 0.1  # 50 ms at relative speeds in [0.5, 1]
    # With FIFO connections the ring ends exactly when the slowest rank's share has gone round.
    assert data["time_vs_closed_form"] == pytest.approx(1.0, rel=1e-9)
    bad = CliRunner().invoke(app, ["simulate", "collective", "--topology", "star:n=4", "--link", "10Gbps",
                                   "--speed-range", "2"])
    assert bad.exit_code == 2 and "low,high" in bad.output


@pytest.mark.parametrize("compiled", [True, False])
def test_engine_reports_progress_without_changing_the_result(compiled: bool, monkeypatch) -> None:
    from mlfabric.sim import engine

    topo = parse_topology("fat-tree:k=4,oversub=4", 10e9)
    ps = PSConfig(workers=8, servers=4, model_bytes=10e6, iterations=3)
    config = EngineConfig(compiled_loop=compiled)
    plain = simulate_ps(topo, ps=ps, config=config)
    monkeypatch.setattr(engine, "PROGRESS_INTERVAL_S", 0.0)  # report at every turn of the loop
    calls: list[tuple[int, int]] = []
    watched = simulate_ps(topo, ps=ps, config=config, on_progress=lambda done, total: calls.append((done, total)))
    assert watched.time_s == plain.time_s and watched.events == plain.events
    tasks = plain.graph.n_tasks
    assert len(calls) > 2 and calls[-1] == (tasks, tasks)
    assert all(total == tasks for _, total in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[0] < tasks  # counts up from before the end
