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
    from mlfabric.train.eager import EagerTrainConfig, run_eager_training
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
    from mlfabric.train.eager import EagerTrainConfig

    with pytest.raises(ValueError, match="in-degree d must be >= 1"):
        EagerTrainConfig(workers=2, servers=1, modes=("mlnet-tree:0",))
    with pytest.raises(ValueError, match=r"the staleness suffix is \+ssp:S"):
        EagerTrainConfig(workers=2, servers=1, modes=("mlnet-binary+async",))


def _chain_with_a_killed_interior_node(steps: int) -> Any:
    """server <- worker 0 <- worker 1 <- worker 2 <- worker 3 (mlnet tree:1); worker 1 is
    SIGKILLed at clock 2. Returns what each worker saw: its steps, or the error and how long
    the failing call waited."""
    import mlfabric.ps
    from mlfabric.ps.mlnet import MLNetSettings

    first = mlfabric.ps.init(consistency="bsp", transport="tcp", timeout=20, lost_worker_wait_s=2.0)
    job = first.session(1, routing="mlnet", mlnet=MLNetSettings(tree="tree:1"))
    try:
        if job.role != "worker":
            return job.serve().as_dict()
        w = job.worker
        w.init_model("m", torch.zeros(1000), lr=0.1)
        done = 0
        for step in range(steps):
            if w.index == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.monotonic()
            try:
                w.pull_flat("m")
                w.push("m", torch.ones(1000))
                w.clock()
            except Exception as exc:  # noqa: BLE001 - what the test checks
                return {"error": f"{type(exc).__name__}: {exc}", "waited_s": time.monotonic() - started}
            done += 1
        return {"steps": done}
    finally:
        first.close()


def test_a_killed_interior_node_is_named_and_the_rest_finishes() -> None:
    from mlfabric.bench.procs import run_ranks

    results = run_ranks(_chain_with_a_killed_interior_node, 5, args=(6,), timeout=90, expect_failures={2})
    assert results[1] == {"steps": 6}  # worker 0 (under the server) went on without the lost subtree
    orphan = results[3]  # worker 2: its parent was worker 1
    assert "PeerLostError" in orphan["error"] and "parent node rank 2 (worker 1)" in orphan["error"], orphan
    assert orphan["waited_s"] < 5.0  # the loss is named within the transport's detection, not the 20 s timeout
    # worker 3: the loss is passed down the subtree, naming the lost node
    assert "PeerLostError" in results[4]["error"] and "rank 2 (worker 1)" in results[4]["error"], results[4]
    server = results[0]
    assert server["lost_workers"] == [1] and server["errors"] == []
