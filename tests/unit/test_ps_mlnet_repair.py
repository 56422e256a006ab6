"""MLNET's failure handling on threads (MLNET §3, issue #24 checks 2-3): a lost interior node's
children re-attach to its parent, which adopts them, and send again the clocks it had not
passed on; with integer-valued updates the servers' totals are exactly what reached them,
every surviving worker's update once. Two nodes lost at once tear the trees down: every
worker pushes and pulls directly, and the job finishes.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet_repair.py -q
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout
from mlfabric.ps.mlnet import MLNetSettings
from tests.unit.test_ps import run_job
from tests.unit.test_ps_mlnet import register_sum_rules

STEPS = 8


def _value(worker: int, clock: int) -> float:
    return float((worker + 1) * 100 + clock)  # integer-valued: sums stay exact in float32


def _run(tree: str, consistency: str, victims: tuple[int, ...], at_clock: int = 3,
         workers: int = 6) -> tuple[dict[int, Any], list[Any], dict[int, list[tuple[int, ...]]]]:
    """Workers push ``_value`` every clock; the ``victims`` (worker indices) die together at
    ``at_clock`` (their transports vanish without a goodbye). Returns the outcomes, the jobs
    and each server's log of the workers in every update it applied."""
    layout = PSLayout(servers=2, workers=workers)
    logs: dict[int, list[tuple[int, ...]]] = {0: [], 1: []}
    jobs: list[Any] = []
    barrier = threading.Barrier(workers)

    def setup(all_jobs: list[Any]) -> None:
        jobs.extend(all_jobs)
        register_sum_rules(all_jobs, logs)

    def work(w: Any) -> Any:
        w.init_model("m", torch.zeros(10), lr=1.0)
        for clock in range(STEPS):
            if clock == at_clock:
                barrier.wait(10)  # the victims die between two clocks, everybody's last clock out
                if w.index in victims:
                    jobs[layout.worker_rank(w.index)].comm.transport.fabric.kill(layout.worker_rank(w.index))
                    return "killed"
            w.pull_flat("m")
            w.push("m", torch.full((10,), _value(w.index, clock)))
            w.clock()
        w.pull_flat("m")
        return w.routing.stats

    config = PSConfig(consistency=consistency, timeout_s=10, routing="mlnet", mlnet=MLNetSettings(tree=tree),
                      lost_worker_wait_s=0.5)
    killed = {layout.worker_rank(v) for v in victims}
    out, _ = run_job(layout, config, work, setup, killed=killed)
    return out, jobs, logs


def _check_exact(layout_workers: int, victims: tuple[int, ...], jobs: list[Any],
                 logs: dict[int, list[tuple[int, ...]]]) -> None:
    """Every survivor's update applied once at each server; a victim's at most up to its death
    (what its node had not passed on died with its process); the model is exactly the sum of
    what the log says was applied, each clock of a worker at most once."""
    for server in (0, 1):
        counts = collections.Counter(w for workers in logs[server] for w in workers)
        for w in range(layout_workers):
            if w in victims:
                assert counts[w] <= 3, (server, w, counts)
            else:
                assert counts[w] == STEPS, (server, w, counts)
        expected = sum(_value(w, c) for w in range(layout_workers) for c in range(counts[w]))
        assert jobs[server].server.shards["m"].values.tolist() == [expected] * 5


@pytest.mark.parametrize("consistency", ["bsp", "ssp:2"])
def test_a_lost_interior_node_is_repaired_and_nothing_is_lost_or_applied_twice(consistency: str) -> None:
    # tree:1 is a chain per server: server <- w0 <- w1 <- ... <- w5 (server 1's starts elsewhere)
    out, jobs, logs = _run("tree:1", consistency, victims=(2,))
    stats = [out[r] for r in range(2, 8) if r != 4]
    assert all(s != "killed" for s in stats)
    assert sum(s.repairs for s in stats) >= 1 and sum(s.adopted for s in stats) >= 1
    assert sum(s.fallbacks for s in stats) == 0
    _check_exact(6, (2,), jobs, logs)
    for s in stats:  # the SSP bound held on every pull, across the repair too
        assert s.max_staleness is not None and s.max_staleness <= (2 if consistency == "ssp:2" else 0)


def test_a_lost_node_under_a_binary_tree_root_re_attaches_its_children_to_the_server() -> None:
    # binary trees: worker 0 is a root-level node of server 0's tree; its children go to the server
    out, jobs, logs = _run("binary", "bsp", victims=(0,))
    stats = [out[r] for r in range(3, 8)]
    assert sum(s.repairs for s in stats) >= 1
    _check_exact(6, (0,), jobs, logs)


def test_two_nodes_lost_at_once_fall_back_to_direct_push_and_pull() -> None:
    out, jobs, logs = _run("tree:1", "bsp", victims=(1, 3))
    stats = [out[r] for r in (2, 4, 6, 7)]
    assert all(s.fallbacks == 1 for s in stats), [s.fallbacks for s in stats]
    _check_exact(6, (1, 3), jobs, logs)


def test_a_lost_childs_committed_clock_still_counts_after_its_children_are_adopted() -> None:
    """Regression: a child's clock arrived, then the child was lost before its parent could
    pass that clock on; the parent adopted the grandchild (as through that clock) but then
    summed only its members' parts, leaving out the lost child's committed one (and the
    workers it covered): the server waited for their clocks until the timeout."""
    from mlfabric.ps import local_jobs
    from mlfabric.ps.mlnet import TreeNode

    layout = PSLayout(servers=1, workers=4)
    settings = MLNetSettings(tree="tree:1")  # server <- w0 <- w1 <- w2 <- w3
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=5, routing="mlnet", mlnet=settings))
    try:
        node = TreeNode(jobs[2].worker, settings.parents(4, 1))  # worker 1's node
        node._stop.set()  # driven by hand below
        node.transport.mailbox.notify()
        node._thread.join(2)
        sent: list[tuple[str, dict]] = []
        node._up = lambda tree, op, fields, payload=None: sent.append((op, {**fields, "payload": payload}))
        tree = node.trees[0]
        # child 2's sum of clock 0 (covering workers 2 and 3) and its clock arrive ...
        node._add(tree, 0, 2, "m", torch.full((2,), 5.0), [2, 3], [0, 0])
        tree.pending[0].clocked[2] = [2, 3]
        tree.through[2] = 0
        # ... then it is lost: worker 3 is adopted as through clock 0
        node._adopt(tree, 2, "test")
        assert tree.members == [1, 3] and tree.through[3] == 0
        # worker 1's own update and clock 0 complete the clock
        node._event("push", 0, "m", 0, torch.ones(2), {"version": 0})
        node._event("clock", 0)
        node._forward(tree)
        (push, push_fields), (clock, clock_fields) = sent
        assert push == "push" and push_fields["payload"].tolist() == [6.0, 6.0] and push_fields["workers"] == [1, 2, 3]
        assert clock == "clock" and clock_fields["workers"] == [1, 2, 3]
    finally:
        for job in jobs:
            job.comm.close()
