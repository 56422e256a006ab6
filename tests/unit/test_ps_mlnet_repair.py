"""MLNET's failure handling on threads (MLNET §3, issue #24 checks 2-3): a lost interior node's
children re-attach to its parent, which adopts them, and send again the clocks it had not
passed on; with integer-valued updates the servers' totals are exactly what reached them,
every surviving worker's update once. Two nodes lost at once tear the trees down: every
worker pushes and pulls directly, and the job finishes.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet_repair.py -q
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, protocol
from mlfabric.ps.policies.mlnet import MLNetSettings
from mlfabric.transport.base import CONTROL_CHANNEL, GOODBYE_TAG, Message, SendHandle
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


@contextlib.contextmanager
def _hand_driven_node(worker: int = 1) -> Iterator[tuple[Any, Any, list[tuple[str, dict]]]]:
    """Worker ``worker``'s node of a chain (server <- w0 <- w1 <- w2 <- w3), its thread stopped so
    the test drives it; yields the node, its tree and what it sent up (op, fields + payload)."""
    from mlfabric.ps import local_jobs
    from mlfabric.ps.policies.mlnet import TreeNode

    layout = PSLayout(servers=1, workers=4)
    settings = MLNetSettings(tree="tree:1")
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=5, routing="mlnet", mlnet=settings))
    try:
        node = TreeNode(jobs[layout.worker_rank(worker)].worker, settings.parents(4, 1))
        node._stop.set()
        node.transport.mailbox.notify()
        node._thread.join(2)
        sent: list[tuple[str, dict]] = []
        node.core._up = lambda tree, header, payload=None: sent.append((header.OP, {**header.body(),
                                                                                  "payload": payload}))
        yield node, node.trees[0], sent
    finally:
        for job in jobs:
            job.comm.close()


def _from(node: Any, worker: int, op: str, **fields: Any) -> Message:
    """An mlnet message to ``node`` from worker ``worker``'s node."""
    return Message(node.layout.worker_rank(worker), node.tag, node.channel, protocol.encode(op=op, tree=0, **fields),
                   memoryview(b""))


def test_a_lost_childs_committed_clock_still_counts_after_its_children_are_adopted() -> None:
    """Regression: a child's clock arrived, then the child was lost before its parent could
    pass that clock on; the parent adopted the grandchild (as through that clock) but then
    summed only its members' parts, leaving out the lost child's committed one (and the
    workers it covered): the server waited for their clocks until the timeout."""
    with _hand_driven_node() as (node, tree, sent):
        # child 2's sum of clock 0 (covering workers 2 and 3) and its clock arrive ...
        node.core._add(tree, 0, 2, "m", torch.full((2,), 5.0), [2, 3], [0, 0])
        tree.pending[0].clocked[2] = [2, 3]
        tree.through[2] = 0
        # ... then it is lost: worker 3 is adopted as through clock 0
        node.core._adopt(tree, 2, "test")
        assert tree.members == [1, 3] and tree.through[3] == 0
        # worker 1's own update and clock 0 complete the clock
        node.core._event("push", 0, "m", 0, torch.ones(2), {"version": 0})
        node.core._event("clock", 0)
        node.core._forward(tree)
        (push, push_fields), (clock, clock_fields) = sent
        assert push == "push" and push_fields["payload"].tolist() == [6.0, 6.0] and push_fields["workers"] == [1, 2, 3]
        assert clock == "clock" and clock_fields["workers"] == [1, 2, 3]


def test_a_child_that_leaves_and_closes_during_a_pass_is_not_taken_for_gone() -> None:
    """Regression (a CI hang, 1 run in ~15): a leaf child's leave and its transport's goodbye
    arrived after the node had drained its mailbox but before it looked at the peers gone; the
    node took the child for gone without leaving ("its subtree's later updates are lost") and
    never passed its workers' leave up. The peers gone are now read before the drain."""
    with _hand_driven_node() as (node, tree, sent):
        mailbox = node.transport.mailbox
        take = mailbox.take
        arrived: list[bool] = []

        def take_then_arrive(channel: str, tag: int, *args: Any) -> Message | None:
            msg = take(channel, tag, *args)
            if msg is None and tag == node.tag and not arrived:  # the drain just ended: now they come
                arrived.append(True)
                node.transport._deliver(_from(node, 2, protocol.LEAVE, workers=[2, 3], final=False))
                node.transport._deliver(_from(node, 2, protocol.LEAVE, workers=[], final=True))
                child = node.layout.worker_rank(2)
                node.transport._deliver(Message(child, GOODBYE_TAG, CONTROL_CHANNEL, b"", memoryview(b"")))
            return msg

        mailbox.take = take_then_arrive
        node._pass()
        assert arrived and node.stats.lost_children == [] and 2 not in tree.final
        node._pass()  # the child's leave is read before its going is looked at
        assert node.stats.lost_children == [] and 2 in tree.final
        assert [(op, fields["workers"]) for op, fields in sent] == [("leave", [2, 3])]


def test_a_send_to_a_lost_peer_does_not_hold_the_node_forever() -> None:
    """Regression (a CI hang): a send to a peer that died never completes (the transports'
    contract); the node waited for it and its worker's leave hung until the job's timeout."""
    with _hand_driven_node(worker=3) as (node, tree, sent):  # a leaf: server <- ... <- w2 <- w3
        node.core._event("leave")
        node.core._forward(tree)
        assert tree.done and [op for op, _ in sent] == ["leave", "leave"]  # its worker, then final
        parent = node.layout.worker_rank(2)
        node._sending.append((parent, SendHandle(done=False), None))  # queued when the parent died
        assert node._pass() is False
        node.transport._peer_lost(parent, "test: killed")
        assert node._pass() is True and node._sending == []


def test_a_clock_already_sent_up_is_dropped_not_kept_pending(caplog: pytest.LogCaptureFixture) -> None:
    """A member's part for a clock the node already passed on (never in the protocol) is
    dropped with an error naming it; kept in ``pending`` it held the node's leave to the timeout."""
    with _hand_driven_node() as (node, tree, sent):
        node.core._event("push", 0, "m", 0, torch.ones(2), {"version": 0})
        node.core._event("clock", 0)
        node._from_child(_from(node, 2, protocol.CLOCK, clock=0, workers=[2, 3]))
        node.core._forward(tree)
        assert tree.next_clock == 1 and [op for op, _ in sent] == ["push", "clock"]
        with caplog.at_level(logging.ERROR, logger="mlfabric.ps"):
            node._from_child(_from(node, 2, protocol.CLOCK, clock=0, workers=[2, 3]))
        assert tree.pending == {} and "dropped mlnet clock of clock 0 from rank 3 (worker 2)" in caplog.text
        node.core._event("leave")
        node._from_child(_from(node, 2, protocol.LEAVE, workers=[2, 3], final=True))
        node.core._forward(tree)
        assert tree.done


@pytest.mark.parametrize("tree", ["tree:1", "binary"])
def test_a_lost_server_is_replaced_by_its_replica_and_nothing_is_lost_or_applied_twice(tree: str) -> None:
    """MLNET §3's failed root, waited for and reconnected: the server dies mid-training; its
    replica (chain replication, which now carries the clocks too) takes over, the root-level
    nodes attach to it and send again the clocks it lacks. With integer-valued updates the
    replica's model is exactly every update of every worker, once; the SSP bound holds."""
    from tests.unit.test_ps_failover import _kill
    from tests.unit.test_ps_mlnet import _sum_rule

    layout = PSLayout(servers=1, replicas=1, workers=4)
    logs: dict[int, list[tuple[int, ...]]] = {0: [], 1: []}
    jobs: list[Any] = []
    barrier = threading.Barrier(4)

    def setup(all_jobs: list[Any]) -> None:
        jobs.extend(all_jobs)
        all_jobs[0].server.register_update_callback(_sum_rule(logs[0]))
        all_jobs[1].replica.register_update_callback(_sum_rule(logs[1]))  # the promoted server's rule too

    def work(w: Any) -> Any:
        w.init_model("m", torch.zeros(10), lr=1.0)
        for clock in range(STEPS):
            if clock == 3:
                barrier.wait(10)  # the server dies with the sums of clocks 0-2 anywhere on their way
                if w.index == 0:
                    _kill(jobs, 0)
            w.pull_flat("m")
            w.push("m", torch.full((10,), _value(w.index, clock)))
            w.clock()
        w.pull_flat("m")
        return w.failovers, w.routing.stats

    config = PSConfig(consistency="ssp:1", timeout_s=10, routing="mlnet", mlnet=MLNetSettings(tree=tree))
    out, _ = run_job(layout, config, work, setup, killed={0})
    promoted = jobs[1].replica.promoted
    assert promoted is not None and promoted.stats.errors == []
    results = [out[layout.worker_rank(w)] for w in range(4)]
    assert all(failovers == 1 for failovers, _ in results)
    assert sum(stats.repairs for _, stats in results) >= 1  # the root-level nodes re-attached
    for _, stats in results:
        assert stats.max_staleness is not None and stats.max_staleness <= 1
    counts = collections.Counter(w for workers in logs[1] for w in workers)
    assert counts == {w: STEPS for w in range(4)}, counts
    expected = sum(_value(w, c) for w in range(4) for c in range(STEPS))
    assert promoted.shards["m"].values.tolist() == [expected] * 10
