"""#36's aggregation trees with real processes (TCP on loopback): a tree node SIGKILLed in the
middle of a tree is repaired (its child sends to its parent) without losing or double-counting
an update; and ``mlfabric train --workers-per-host 2 --trees`` end to end.

    .venv/bin/python -m pytest tests/local/test_ps_trees_processes.py -q
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from mlfabric.bench.procs import RankFailure, run_ranks

pytestmark = pytest.mark.local

STEPS, SIZE, VICTIM = 4, 2000, 2


def _chain_with_a_killed_node() -> Any:
    """Every batch summed along a chain of its workers (tests/unit/test_ps_trees_runtime.py);
    rank 2 SIGKILLs itself when its child's first chunk reaches it as a middle node. Workers
    push one-hot updates (worker w, step s: element w * STEPS + s)."""
    import mlfabric.ps
    from mlfabric.ps.policies.scheduled import ScheduledSettings
    from mlfabric.ps.policies.scheduled.aggregator import Aggregator
    from tests.unit.test_ps_trees_runtime import CHUNK_BYTES, chain_every_batch

    chain_every_batch(setattr)
    take = Aggregator._tree_chunk

    def dies_mid_tree(self: Aggregator, header: dict[str, Any], payload: Any) -> None:
        me = self.worker.transport.rank
        group = self._trees.get((int(header["batch"]), int(header["slot"])))
        if me == VICTIM and header["source"][0] == "c" and group is not None and group.tree[me].parent is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        take(self, header, payload)

    Aggregator._tree_chunk = dies_mid_tree  # type: ignore[method-assign]
    # slack 2 s: a process notices its node died (its link closes) and re-routes well before
    # the deadline, on a loaded machine too
    job = mlfabric.ps.init(consistency="async:100", transport="tcp", timeout=20)
    session = job.session(1, routing="scheduled",
                          scheduled=ScheduledSettings(interval_s=0.05, rate_bps=1e9, slack_s=2.0, trees=True,
                                                      chunk_bytes=CHUNK_BYTES))
    try:
        if session.role != "worker":
            stats = session.serve()
            return {"stats": stats.as_dict(), "model": session.server.shards["m"].values.tolist()}
        w = session.worker
        w.init_model("m", torch.zeros(SIZE), lr=1.0)
        pushed = 0
        for step in range(STEPS):
            w.pull_flat("m")
            update = torch.zeros(SIZE)
            update[w.index * STEPS + step] = 1.0
            w.push("m", update)
            pushed += 1
            w.clock()
        w.leave()
        return pushed
    finally:
        job.close()


def test_a_tree_node_killed_mid_tree_loses_only_its_own_update() -> None:
    results = run_ranks(_chain_with_a_killed_node, 5, timeout=60, expect_failures={VICTIM})
    assert isinstance(results[VICTIM], RankFailure), "rank 2 was never a middle node"
    server = results[0]
    model = torch.tensor(server["model"])
    values = model[:4 * STEPS].view(4, STEPS)
    assert set(model.unique().tolist()) <= {0.0, -0.25}  # nothing applied twice
    victim = VICTIM - 1
    for w in range(4):
        applied = int((values[w] == -0.25).sum())
        if w == victim:
            # its updates before the batch it died in, none after
            assert applied == int((values[w, :applied] == -0.25).sum()) and applied < STEPS
        else:
            assert results[w + 1] == STEPS and applied == STEPS  # re-routed around it: nothing lost
    stats = server["stats"]
    assert stats["worker_updates"] == int((model == -0.25).sum()) and stats["skipped"] == 0


def test_train_with_two_workers_per_host_and_trees(tmp_path: Path) -> None:
    """``mlfabric train --workers-per-host 2 --trees``: RR-Sync host-hierarchical and MLfabric-A
    with host sums; the JSON says how many updates a server transfer carried."""
    from typer.testing import CliRunner

    from mlfabric.cli import app

    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["train", "--workload", "mlp", "--workers", "4", "--workers-per-host", "2",
                                      "--trees", "--sync", "allreduce,mlfabric-a:8", "--epochs", "1",
                                      "--train-samples", "2048", "--json", str(out), "--out", str(tmp_path),
                                      "--no-plot", "--quiet"])
    assert result.exit_code == 0, result.output
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["allreduce"]["final_metric"] > 0
    a = runs["mlfabric-a:8"]
    # two workers per host, their sums down trees: a server transfer carries more than one update
    assert a["updates_per_server_transfer"] > 1.5 and a["server_nic_busy"] is None  # local: no NIC rate
    assert a["worker_updates_applied"] + a["dropped"] > 0 and a["aggregated"] > 0

