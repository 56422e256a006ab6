"""MLNET's trees and the ``mlnet`` routing policy on threads (in-process transport): tree shapes,
exact sums, BSP equal to direct BSP, SSP's bound on every pull, bad input, a lost parent.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet.py -q
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from mlfabric.errors import PeerLostError
from mlfabric.ps import PSConfig, PSLayout, UpdateInfo, local_jobs
from mlfabric.ps.policies.mlnet import MLNetSettings
from mlfabric.topo.trees import parse_tree_kind, rack_of, subtree_of, tree_parents

from tests.unit.test_ps import quadratic_gradient, run_job

# --- trees (pure) -----------------------------------------------------------------------------


def _depths(parents: np.ndarray) -> list[int]:
    out = []
    for w in range(parents.size):
        node, hops = w, 0
        while node >= 0:
            node, hops = parents[node], hops + 1
            assert hops <= parents.size, "a cycle"
        out.append(hops)
    return out


@pytest.mark.parametrize("kind, degree", [("binary", None), ("tree", 3), ("tree", 1)])
def test_trees_have_in_degree_d_and_span_every_worker(kind: str, degree: int | None) -> None:
    d = degree or 2
    parents = tree_parents(kind, 3, range(13), degree=degree)
    assert parents.shape == (3, 13)
    for row in parents:
        assert np.bincount(row[row >= 0], minlength=13).max() <= d
        assert np.count_nonzero(row == -1) == d  # the server's children
        assert max(_depths(row)) <= 13
        roots = np.flatnonzero(row == -1).tolist()
        assert sorted(w for r in roots for w in subtree_of(row, r)) == list(range(13))  # spanning, disjoint
    assert len({tuple(np.flatnonzero(row == -1)) for row in parents}) == 3  # rotated per server
    if degree == 1:  # a chain
        assert max(_depths(parents[0])) == 13


def test_rack_trees_one_aggregator_per_rack() -> None:
    racks = [0, 0, 0, 1, 1, 1, 1, 2]
    parents = tree_parents("rack", 2, range(8), racks=racks)
    for j, row in enumerate(parents):
        aggregators = np.flatnonzero(row == -1).tolist()
        assert sorted(racks[a] for a in aggregators) == [0, 1, 2]
        for w in range(8):
            if row[w] >= 0:
                assert racks[row[w]] == racks[w] and row[row[w]] == -1  # depth 2, inside the rack
    assert parents[0].tolist() == [-1, 0, 0, -1, 3, 3, 3, -1]
    assert parents[1].tolist() == [1, -1, 1, 4, -1, 4, 4, -1]  # the rack's (j mod size)-th worker


def test_tree_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="in-degree d must be >= 1, got 0"):
        tree_parents("tree", 1, range(4), degree=0)
    with pytest.raises(ValueError, match="in-degree d must be >= 1"):
        parse_tree_kind("tree:0")
    with pytest.raises(ValueError, match="tree over zero workers"):
        tree_parents("binary", 2, [])
    with pytest.raises(ValueError, match="needs the rack of every worker"):
        tree_parents("rack", 1, range(4))
    with pytest.raises(ValueError, match="choose binary, rack, tree:D"):
        parse_tree_kind("star")
    with pytest.raises(ValueError, match="racks must give the rack of each of the 4"):
        tree_parents("rack", 1, range(4), racks=[0, 1])
    assert parse_tree_kind("tree:5") == ("tree", 5) and parse_tree_kind("RACK") == ("rack", None)
    with pytest.raises(ValueError, match="mlnet trees are binary, rack or tree:D"):
        MLNetSettings(tree="direct")
    with pytest.raises(ValueError, match="routing 'mlnet' runs on MLNET's clocks"):
        PSConfig(routing="mlnet", consistency="async")


# --- the policy on threads ----------------------------------------------------------------------

SETTINGS = [MLNetSettings(tree="binary"), MLNetSettings(tree="tree:3"),
            MLNetSettings(tree="rack", racks=(0, 0, 0, 1, 1)), MLNetSettings(tree="tree:1")]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.tree)
def test_bsp_through_the_trees_equals_direct_bsp(settings: MLNetSettings) -> None:
    layout = PSLayout(servers=2, workers=5)
    steps, lr, momentum = 5, 0.1, 0.5

    def worker(w: Any) -> tuple[torch.Tensor, Any]:
        w.init_model("m", {"a": torch.zeros(6), "b": torch.zeros(3)}, lr=lr, momentum=momentum)
        for _ in range(steps):
            params = w.pull_flat("m")
            time.sleep(0.005 * w.index)  # arrive in different orders
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        return w.pull_flat("m"), getattr(w.routing, "stats", None)

    results = {}
    for routing in ("direct", "mlnet"):
        config = PSConfig(consistency="bsp", timeout_s=10, routing=routing, mlnet=settings)
        results[routing], _ = run_job(layout, config, worker)
    ref = torch.nn.Parameter(torch.zeros(9))
    opt = torch.optim.SGD([ref], lr=lr, momentum=momentum)
    for _ in range(steps):
        ref.grad = torch.stack([quadratic_gradient(ref.detach(), i) for i in range(5)]).mean(0)
        opt.step()
    parents = settings.parents(5, 2)
    for rank in layout.worker_ranks:
        final, stats = results["mlnet"][rank]
        torch.testing.assert_close(final, results["direct"][rank][0])
        torch.testing.assert_close(final, ref.detach())
    for server in layout.server_ranks:
        stats = results["mlnet"][server]
        assert stats.updates_applied == steps and stats.worker_updates == 5 * steps and stats.dropped == 0
        assert stats.errors == []
        # The server heard from its tree's roots only: fewer bytes in than direct routing's.
        roots = int(np.count_nonzero(parents[server] == -1))
        assert stats.bytes_in < results["direct"][server].bytes_in * (roots + 1) / 5
    node_stats = [results["mlnet"][r][1] for r in layout.worker_ranks]
    # Every worker update went up exactly once per server tree, inside the sums.
    assert sum(s.sums_forwarded for s in node_stats) > 0
    # One upstream request per node per clock and tree at most (the multicast), steps + 1 pulls.
    for w, s in enumerate(node_stats):
        assert s.pulls_upstream <= 2 * (steps + 1), (w, s)
        assert s.max_staleness == 0


def _sum_rule(log: list[tuple[int, ...]]) -> Any:
    def rule(shard: torch.Tensor, gradient: torch.Tensor, info: UpdateInfo) -> None:
        shard.add_(gradient)  # the raw sum: integer-valued pushes stay exact
        log.append(info.workers)
    return rule


def register_sum_rules(jobs: list[Any], logs: dict[int, list[tuple[int, ...]]]) -> None:
    """Every server of ``jobs`` sums raw and logs the workers of each update in ``logs[rank]``."""
    for job in jobs:
        if job.server is not None:
            job.server.register_update_callback(_sum_rule(logs[job.rank]))


@pytest.mark.parametrize("consistency", ["bsp", "ssp:2"])
def test_sums_are_exact_nothing_lost_nothing_twice(consistency: str) -> None:
    layout = PSLayout(servers=2, workers=6)
    steps = 6
    logs: dict[int, list[tuple[int, ...]]] = {0: [], 1: []}

    def setup(jobs: list[Any]) -> None:
        register_sum_rules(jobs, logs)

    def worker(w: Any) -> None:
        w.init_model("m", torch.zeros(10), lr=1.0)
        for c in range(steps):
            w.pull_flat("m")
            time.sleep(0.004 * ((w.index + c) % 3))
            w.push("m", torch.full((10,), float((w.index + 1) * (c + 1))))
            w.clock()

    config = PSConfig(consistency=consistency, timeout_s=10, routing="mlnet", mlnet=MLNetSettings(tree="binary"))
    _, jobs = run_job(layout, config, worker, setup)
    expected = sum((w + 1) * (c + 1) for w in range(6) for c in range(steps))
    for job in jobs:
        if job.server is not None:
            assert job.server.shards["m"].values.tolist() == [float(expected)] * 5
            counts = collections.Counter(w for workers in logs[job.rank] for w in workers)
            assert counts == {w: steps for w in range(6)}  # every update once
            assert job.server.stats.worker_updates == 6 * steps
            # Aggregation happened: fewer applications (sums) than worker updates under SSP,
            # exactly one per round under BSP.
            if consistency == "bsp":
                assert len(logs[job.rank]) == steps
            else:
                assert len(logs[job.rank]) < 6 * steps


@pytest.mark.parametrize("staleness", [1, 2])
def test_ssp_bound_holds_on_every_pull_inside_the_tree(staleness: int) -> None:
    layout = PSLayout(servers=2, workers=5)

    def worker(w: Any) -> Any:
        w.init_model("m", torch.zeros(8), lr=0.01)
        for _ in range(8):
            params = w.pull_flat("m")
            time.sleep(0.03 if w.index == 4 else 0.0)  # worker 4 is the straggler
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        w.pull_flat("m")
        return w.routing.stats

    config = PSConfig(consistency=f"ssp:{staleness}", timeout_s=10, routing="mlnet",
                      mlnet=MLNetSettings(tree="binary"))
    results, _ = run_job(layout, config, worker)
    seen_at_bound = cached = 0
    for rank in layout.worker_ranks:
        stats = results[rank]
        assert len(stats.pull_clocks) == 2 * 9  # every pull, both trees
        for clock, model_clock in stats.pull_clocks:
            assert model_clock is None or model_clock >= clock - staleness, (rank, clock, model_clock)
            seen_at_bound += model_clock is not None and clock - model_clock == staleness
        assert stats.max_staleness is not None and stats.max_staleness <= staleness
        cached += stats.pulls_from_cache
    assert seen_at_bound, "the straggler never held a fast worker at the bound: the test exercised nothing"
    assert cached, "no pull was answered from a node's copy: SSP inside the tree was not exercised"
    for server in layout.server_ranks:
        assert results[server].worker_updates == 5 * 8 and results[server].dropped == 0


def test_a_lost_parent_is_named_within_the_timeout() -> None:
    layout = PSLayout(servers=1, workers=3)
    settings = MLNetSettings(tree="tree:1")  # a chain: server <- w0 <- w1 <- w2
    parents = settings.parents(3, 1)[0].tolist()
    assert parents == [-1, 0, 1]
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=5, routing="mlnet", mlnet=settings))
    errors: dict[int, BaseException] = {}
    killed = threading.Event()

    def body(job: Any) -> None:
        try:
            if job.role != "worker":
                job.serve()
                return
            w = job.worker
            w.init_model("m", torch.zeros(4), lr=0.1)
            for c in range(50):
                w.pull_flat("m")
                if w.index == 1 and c == 2:
                    killed.set()
                    job.comm.transport.close()  # worker 1, the interior node, vanishes
                    return
                w.push("m", torch.ones(4))
                w.clock()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[job.rank] = exc
        if job.worker is not None and not (job.worker.index == 1 and killed.is_set()):
            job.worker.leave()

    threads = [threading.Thread(target=body, args=(j,), daemon=True) for j in jobs]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    elapsed = time.monotonic() - started
    for job in jobs:
        job.comm.close()
    assert killed.is_set() and not any(t.is_alive() for t in threads)
    assert elapsed < 10
    w2 = layout.worker_rank(2)
    assert isinstance(errors.get(w2), PeerLostError) and errors[w2].peer == layout.worker_rank(1), errors
    assert "its mlnet parent node rank 2 (worker 1)" in str(errors[w2]), errors[w2]
    assert set(errors) == {w2}, errors  # the root went on without the lost subtree


def test_rack_trees_read_the_racks_off_the_launch_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank r on host r (the launchers' placement): 2 servers (ranks 0, 1), 8 workers (ranks 2-9)
    # on racks:r=2,h=6: hosts 2-5 in rack 0, hosts 6-9 in rack 1.
    monkeypatch.setenv("MLFABRIC_TOPOLOGY", "racks:r=2,h=6")
    parents = MLNetSettings(tree="rack").parents(8, 2, list(range(2, 10)))
    assert parents.tolist() == [[-1, 0, 0, 0, -1, 4, 4, 4], [1, -1, 1, 1, 5, -1, 5, 5]]
    with pytest.raises(ValueError, match="has 12 hosts"):
        MLNetSettings(tree="rack").parents(8, 2, list(range(10, 18)))
    monkeypatch.delenv("MLFABRIC_TOPOLOGY")  # loopback: one rack, one aggregator per server
    assert MLNetSettings(tree="rack").parents(4, 2).tolist() == [[-1, 0, 0, 0], [1, -1, 1, 1]]


def test_train_emulation_takes_a_topology_for_the_ps_launch() -> None:
    from mlfabric.train.harness import TrainEmulation

    emulation = TrainEmulation(ps_topology="racks:r=2,h=5,oversub=4", rate_bps=50e6)
    assert emulation.launch_topology(10, ps=True) == "racks:r=2,h=5,oversub=4"
    assert emulation.launch_topology(8, ps=False) == "star:n=8"  # the collective launch keeps the star
    with pytest.raises(ValueError, match="has 10 hosts, but the parameter-server launch has 9 ranks"):
        emulation.launch_topology(9, ps=True)
    with pytest.raises(ValueError, match="unknown parameter"):
        TrainEmulation(ps_topology="racks:q=1")


def test_the_simulator_places_a_ps_as_the_launchers_do() -> None:
    """``simulate ps --placement launch``: servers on hosts 0..S-1, workers after them (rank r on
    host r of an emulated ``train`` launch), so emulated and simulated runs share the trees."""
    from mlfabric.sim.workloads import PSConfig as SimPS
    from mlfabric.sim.workloads import ps_placement
    from mlfabric.sim.workloads import tree_parents as sim_tree_parents
    from mlfabric.topo import parse_topology

    topo = parse_topology("racks:r=2,h=5,oversub=4", 50e6)
    config = SimPS(workers=8, servers=2, model_bytes=1e6, strategy="rack", placement="launch")
    workers, servers = ps_placement(topo, config)
    assert workers.tolist() == list(range(2, 10)) and servers.tolist() == [0, 1]
    # The runtime's trees for that launch (rank r on host r, racks from the spec) are the simulator's.
    runtime = MLNetSettings(tree="rack", racks=tuple(rack_of(topo, workers).tolist()))
    assert np.array_equal(runtime.parents(8, 2, workers.tolist()), sim_tree_parents(topo, config, workers, servers))
    with pytest.raises(ValueError, match="do not fit on the 10 hosts"):
        ps_placement(topo, SimPS(workers=9, servers=2, model_bytes=1e6, placement="launch"))


def test_ordered_pulls_bypass_the_tree_under_the_same_clocks() -> None:
    """pull_in_order (TicTac) is answered by the servers directly; under BSP through the trees
    it still sees every round: the model of synchronous SGD."""
    layout = PSLayout(servers=2, workers=3)

    def worker(w: Any) -> torch.Tensor:
        w.init_model("m", {"a": torch.zeros(4), "b": torch.zeros(2)}, lr=1.0)
        out = torch.zeros(6)
        for _ in range(3):
            w.pull_in_order("m", out, order="random").wait()
            w.push("m", torch.full((6,), float(w.index + 1)))
            w.clock()
        w.pull_in_order("m", out, order="random").wait()
        return out

    results, _ = run_job(layout, PSConfig(consistency="bsp", timeout_s=10, routing="mlnet"), worker)
    for rank in layout.worker_ranks:  # 3 rounds of the mean update (1 + 2 + 3) / 3 = 2, lr 1
        assert results[rank].tolist() == [-6.0] * 6


def test_a_tree_whose_server_never_serves_fails_within_the_timeout() -> None:
    """Issue #24 check 5: a proxy whose server never comes -- a bounded wait, and an error
    naming the server and what to do."""
    from mlfabric.errors import CollectiveTimeoutError

    layout = PSLayout(servers=1, workers=3)
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=1.0, routing="mlnet",
                                       mlnet=MLNetSettings(tree="binary")))
    try:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"rank 0 \(server 0\) within 1 s \(it is alive but not "
                                                         r"serving: call serve\(\)"):
            jobs[1].worker.init_model("m", torch.zeros(4))
        assert time.monotonic() - started < 2.0
    finally:
        for job in jobs:
            job.comm.close()
