"""``mlfabric train --sync mlnet-...``: MLNET's trees in a real training run (processes on loopback, tcp).

    .venv/bin/python -m pytest tests/local/test_ps_mlnet_train.py -q
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch


def test_train_through_mlnet_trees_equals_bsp_and_cuts_server_traffic() -> None:
    from mlfabric.train.harness import EagerTrainConfig, run_eager_training
    from mlfabric.train.workloads import HyperplaneSpec

    config = EagerTrainConfig(workload="hyperplane", workers=4, servers=2, epochs=2, batch_size=64,
                              modes=("ps-bsp", "mlnet-binary", "mlnet-rack+ssp:1"),
                              hyperplane=HyperplaneSpec(dim=256, train_samples=2048), transport="tcp", timeout_s=120.0)
    runs = {run.mode: run for run in run_eager_training(config, argv=["test"]).runs}
    bsp, binary, rack = (runs[m].ps for m in ("ps-bsp", "mlnet-binary", "mlnet-rack+ssp:1"))
    for ps in (bsp, binary, rack):  # every worker's every update, at both servers
        assert ps is not None and ps["worker_updates_applied"] == 2 * 4 * config.steps and ps["dropped"] == 0
    # BSP through the trees is synchronous SGD: the model of direct BSP (up to float32 sums).
    assert runs["mlnet-binary"].final_val_loss == pytest.approx(runs["ps-bsp"].final_val_loss, rel=1e-4)
    assert runs["mlnet-rack+ssp:1"].final_val_loss < runs["mlnet-rack+ssp:1"].curve[0].val_loss
    # Binary trees over 4 workers: 2 roots per server, so half of direct routing's bytes reach
    # each server; rack trees on loopback (one rack): one aggregator, a quarter.
    for j in range(2):
        assert binary["server_bytes_in"][j] < 0.6 * bsp["server_bytes_in"][j]
        assert rack["server_bytes_in"][j] < 0.35 * bsp["server_bytes_in"][j]
    assert binary["max_staleness"] == 0 and 0 <= rack["max_staleness"] <= 1
    assert binary["tree_sums"] == 2 * 4 * config.steps  # one sum per worker node, clock and server
    assert binary["lost_children"] == [] and rack["pulls_from_cache"] > 0


def test_train_rejects_bad_mlnet_modes_at_once() -> None:
    from mlfabric.train.harness import EagerTrainConfig

    with pytest.raises(ValueError, match="in-degree d must be >= 1"):
        EagerTrainConfig(workers=2, servers=1, modes=("mlnet-tree:0",))
    with pytest.raises(ValueError, match=r"the staleness suffix is \+ssp:S"):
        EagerTrainConfig(workers=2, servers=1, modes=("mlnet-binary+async",))


def _chain_with_a_killed_interior_node(steps: int, kill_file: str, victims: tuple[int, ...] = (1,)) -> Any:
    """server <- worker 0 <- worker 1 <- worker 2 <- ... (mlnet tree:1, one server); the
    ``victims`` are SIGKILLed at clock 2. Integer-valued pushes, summed raw by the server. Returns
    the server's statistics, model and per-worker count of applied updates, or a worker's
    steps, node statistics and its longest call."""
    import collections

    import mlfabric.ps
    from mlfabric.ps.policies.mlnet import MLNetSettings

    first = mlfabric.ps.init(consistency="bsp", transport="tcp", timeout=20, lost_worker_wait_s=1.0)
    job = first.session(1, routing="mlnet", mlnet=MLNetSettings(tree="tree:1"))
    try:
        if job.role != "worker":
            applied: collections.Counter = collections.Counter()

            def raw_sum(shard: torch.Tensor, gradient: torch.Tensor, info: Any) -> None:
                shard.add_(gradient)
                applied.update(info.workers)

            job.server.register_update_callback(raw_sum)
            stats = job.serve().as_dict()
            return {"stats": stats, "model": job.server.shards["m"].values.tolist(), "applied": dict(applied)}
        w = job.worker
        w.init_model("m", torch.zeros(1000), lr=0.1)
        longest = 0.0
        for step in range(steps):
            if w.index in victims and step == 2:
                with open(kill_file, "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.monotonic()
            w.pull_flat("m")
            w.push("m", torch.full((1000,), float(100 * (w.index + 1) + step)))
            w.clock()
            longest = max(longest, time.monotonic() - started)
        job.leave()  # the node passes on its last clock and its subtree's before the process ends
        return {"steps": steps, "node": w.routing.stats.as_dict(), "longest_s": longest}
    finally:
        first.close()


def test_a_killed_interior_node_is_repaired_and_the_sums_stay_exact(tmp_path: Any) -> None:
    """Its child (worker 2) re-attaches to worker 0, which adopts it; worker 2's subtree sends
    again what worker 1 had not passed on. Every survivor's update reaches the server once."""
    from mlfabric.bench.procs import run_ranks

    steps = 6
    kill_file = tmp_path / "killed_at"
    results = run_ranks(_chain_with_a_killed_interior_node, 5, args=(steps, str(kill_file)), timeout=90,
                        expect_failures={2})
    for rank in (1, 3, 4):
        assert results[rank]["steps"] == steps, results[rank]
    assert results[1]["node"]["adopted"] == 1 and results[3]["node"]["repairs"] == 1
    # repaired (worker 2 re-attached and answered) within 3 detection periods of the kill: the
    # transport declares a peer that ended without a goodbye lost after 0.5 s (docs/parameter_server.md)
    repaired_s = results[3]["node"]["attached_at"][0] - float(kill_file.read_text())
    assert 0 < repaired_s < 3 * 0.5 + 0.3, repaired_s
    # the repair (detection: the transport's 0.5 s goodbye grace; the server's BSP wait for the
    # lost worker, 1 s) held the survivors' slowest call to a few seconds, not the 20 s timeout
    assert max(results[r]["longest_s"] for r in (1, 3, 4)) < 5.0
    server = results[0]
    assert server["stats"]["lost_workers"] == [1] and server["stats"]["errors"] == []
    applied = {int(w): n for w, n in server["applied"].items()}
    assert applied[0] == applied[2] == applied[3] == steps and applied.get(1, 0) <= 2
    expected = sum(100 * (w + 1) + c for w, n in applied.items() for c in range(n))
    assert server["model"] == [float(expected)] * 1000


def test_two_interior_nodes_killed_at_once_fall_back_and_finish(tmp_path: Any) -> None:
    """Workers 1 and 3 of the chain die together: the trees are torn down, every survivor
    pushes and pulls directly, and each survivor's update still reaches the server once."""
    from mlfabric.bench.procs import run_ranks

    steps = 6
    results = run_ranks(_chain_with_a_killed_interior_node, 7, args=(steps, str(tmp_path / "killed_at"), (1, 3)),
                        timeout=90, expect_failures={2, 4})
    for rank in (1, 3, 5, 6):
        assert results[rank]["steps"] == steps, results[rank]
        assert results[rank]["node"]["fallbacks"] == 1, results[rank]
    server = results[0]
    assert sorted(server["stats"]["lost_workers"]) == [1, 3] and server["stats"]["errors"] == []
    applied = {int(w): n for w, n in server["applied"].items()}
    assert all(applied[w] == steps for w in (0, 2, 4, 5)) and applied.get(1, 0) <= 2 and applied.get(3, 0) <= 2
    expected = sum(100 * (w + 1) + c for w, n in applied.items() for c in range(n))
    assert server["model"] == [float(expected)] * 1000


def test_train_fail_aggregator_repairs_the_tree_and_trains_on() -> None:
    """``mlfabric train --sync mlnet-tree:1+ssp:1 --fail aggregator:AT``: the interior node
    below worker 0 dies; its child re-attaches, the SSP bound holds on every pull, and the
    run ends at the unfailed run's accuracy."""
    from mlfabric.train.harness import EagerTrainConfig, run_eager_training
    from mlfabric.train.workloads import HyperplaneSpec

    # ~0.5-1 s of training (it varies with the load): the kill at 0.2 s falls inside it
    options: dict = dict(workload="hyperplane", workers=5, modes=("mlnet-tree:1+ssp:1",), epochs=12, batch_size=64,
                         hyperplane=HyperplaneSpec(dim=64, train_samples=4096), timeout_s=60.0)
    (baseline,) = run_eager_training(EagerTrainConfig(**options), argv=["test"]).runs
    (failed,) = run_eager_training(EagerTrainConfig(**options, fail="aggregator:0.2"), argv=["test"]).runs
    ps = failed.ps
    assert ps is not None and ps["killed_worker"] == 1 and ps["lost_workers"] == [1]
    assert ps["repairs"] >= 1 and ps["fallbacks"] == 0
    assert 0 < ps["repaired_s"] < 3 * 0.5 + 0.3  # within 3 detection periods of the transport
    assert ps["max_staleness"] <= 1
    assert failed.final_metric <= baseline.final_metric * 1.10, (failed.final_metric, baseline.final_metric)
    assert baseline.loop_s > 0.4  # the failure time was well inside the run


def test_train_fail_server_under_mlnet_the_replica_takes_the_roots_place() -> None:
    """``mlfabric train --sync mlnet-binary+ssp:1 --replicas 1 --fail server:AT`` (MLNET §3's
    failed root, waited for and reconnected): server 0 is SIGKILLed mid-run, its replica takes
    over, the root-level nodes re-attach to it; nothing the server had counted is lost, the SSP
    bound holds, and the run ends at the unfailed run's accuracy."""
    from mlfabric.train.harness import EagerTrainConfig, run_eager_training
    from mlfabric.train.workloads import HyperplaneSpec

    # ~1.5-2 s of training: the kill at 0.3 s falls inside it
    options: dict = dict(workload="hyperplane", workers=4, modes=("mlnet-binary+ssp:1",), epochs=30, batch_size=64,
                         replicas=1, replication="chain", hyperplane=HyperplaneSpec(dim=64, train_samples=4096),
                         timeout_s=60.0)
    (baseline,) = run_eager_training(EagerTrainConfig(**options), argv=["test"]).runs
    (failed,) = run_eager_training(EagerTrainConfig(**options, fail="server:0.3"), argv=["test"]).runs
    ps = failed.ps
    assert ps is not None and 0 < ps["failover_s"] < 2.0
    assert ps["worker_failovers"] == [1, 1, 1, 1] and ps["repairs"] >= 1  # the root-level nodes re-attached
    assert ps["takeover_version"] == ps["killed_version"]  # the chain held every counted sum
    assert ps["max_staleness"] <= 1
    assert failed.final_metric <= baseline.final_metric * 1.10, (failed.final_metric, baseline.final_metric)
    assert baseline.loop_s > 0.6
