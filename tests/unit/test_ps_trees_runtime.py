"""The ``scheduled`` policy's multi-level, cut-through aggregation trees running for real on
threads (memory transport): every update applied exactly once, and a tree node lost in the
middle of a tree repaired (its subtree sent to its parent) without losing or double-counting
an update.

    .venv/bin/python -m pytest tests/unit/test_ps_trees_runtime.py -q

The trees are the planner's to choose (``GroupOrder.parent`` / ``children`` / ``chunk_bytes``);
here a stand-in shapes each batch into one chain over its members (depth = members), so that
the runtime's side is tested whatever the planner picks.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs
from mlfabric.ps.policies.scheduled import ScheduledSettings, SchedulerService
from mlfabric.ps.policies.scheduled.aggregator import Aggregator
from mlfabric.ps.policies.scheduled.core import GroupOrder
from tests.unit.ps_relay_loss import lost_and_survivors, two_rounds_losing_a_relay

STEPS, SIZE, CHUNK_BYTES = 4, 2000, 1024  # 8 KB of float32 in 8 chunks


TreeOrder = GroupOrder  # the core's order of one tree node (#36's parent / children / chunk_bytes)


def chain_every_batch(patch: Callable[[Any, str, Any], None]) -> list[int]:
    """Each batch's applied requests become one group (slot 1) summed along a chain of their
    workers in rank order: the first is the root, each node's own update its one member.
    ``patch``: ``monkeypatch.setattr`` (threads), or ``setattr`` in a rank's own process
    (tests/local/test_ps_trees_processes.py)."""
    dispatch = SchedulerService._dispatch
    depths: list[int] = []

    def chained(self: SchedulerService, plan: Any, now: float) -> None:
        kept = [d for d in plan.decisions if not d.drop]
        if kept:
            ranks = sorted(d.rank for d in kept)
            deadline = max(e[3] for e in plan.entries)
            plan.entries = [["g", 1, len(kept), deadline, ranks]]
            plan.decisions = [d if d.drop else dataclasses.replace(d, group=1, hop=(d.rank,), rates=(None,))
                              for d in plan.decisions]
            by_rank = {d.rank: d for d in kept}
            plan.groups = [TreeOrder(host=r, slot=1, members=((r, by_rank[r].id),), servers=(0,), deadline_in=deadline,
                                     rates=(None,), parent=ranks[i - 1] if i else None,
                                     children=(ranks[i + 1],) if i + 1 < len(ranks) else (), chunk_bytes=CHUNK_BYTES)
                           for i, r in enumerate(ranks)]
            depths.append(len(ranks))
        dispatch(self, plan, now)

    patch(SchedulerService, "_dispatch", chained)
    return depths


def _run(layout: PSLayout, config: PSConfig) -> tuple[dict[Any, Any], torch.Tensor, list[Any]]:
    """Every worker pushes one-hot updates (worker w, step s: element w * STEPS + s), so the
    final model shows each update applied once (-lr/W), never (0) or twice (-2 lr/W)."""
    jobs = local_jobs(layout, config)
    out: dict[Any, Any] = {}

    def serve(job: Any) -> None:
        out["server"] = job.serve()
        out["model"] = job.server.shards["m"].values.clone()

    def work(job: Any) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(SIZE), lr=1.0)
        try:
            for step in range(STEPS):
                w.pull_flat("m")
                update = torch.zeros(SIZE)
                update[w.index * STEPS + step] = 1.0
                out.setdefault(("pushed", w.index), []).append(step)
                w.push("m", update)
                w.clock()
            w.leave()
        except Exception as exc:  # noqa: BLE001 - the node the test kills
            out[("error", w.index)] = exc
        out[w.index] = w.routing.stats.as_dict()

    threads = [threading.Thread(target=serve if j.role == "server" else work, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for j in jobs:
        j.comm.close()
    return out, out["model"], jobs


def _config(timeout_s: float = 20) -> PSConfig:
    return PSConfig(consistency="async:100", timeout_s=timeout_s, routing="scheduled",
                    scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9, slack_s=0.5))


def test_updates_summed_along_multi_level_cut_through_trees_are_applied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    depths = chain_every_batch(monkeypatch.setattr)
    layout = PSLayout(servers=1, workers=4)
    out, model, jobs = _run(layout, _config())
    assert not [k for k in out if isinstance(k, tuple) and k[0] == "error"]
    assert max(depths) >= 3  # trees of depth >= 3 ran
    assert torch.equal(model[:4 * STEPS], torch.full((4 * STEPS,), -0.25))  # every update, exactly once
    assert torch.count_nonzero(model[4 * STEPS:]) == 0
    server = out["server"]
    assert server.worker_updates == 4 * STEPS and server.skipped == 0 and server.dropped == 0
    assert server.unscheduled == 0 and server.errors == []
    aggregators = [j.worker.routing._aggregator for j in jobs if j.role == "worker"]
    assert sum(a.chunks_forwarded for a in aggregators) >= 8 * len(depths)  # chunk by chunk
    assert sum(a.rerouted for a in aggregators) == 0 and jobs[0].server.routing.torn == 0


def test_a_node_lost_mid_tree_is_repaired_without_losing_or_double_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second node of the first chain of depth >= 3 dies when its child's first chunk
    reaches it (before it forwarded anything): its child sends its chunks to the root instead.
    Every update but the dead node's own in that batch is applied, each exactly once."""
    chain_every_batch(monkeypatch.setattr)
    victim_rank = 2
    killed: list[tuple[int, int]] = []
    take = Aggregator._tree_chunk

    def dies_mid_tree(self: Aggregator, header: dict[str, Any], payload: Any) -> None:
        me = self.worker.transport.rank
        if me == victim_rank and killed:
            return  # dead: nothing more is summed or sent here
        if (me == victim_rank and not killed and header["source"][0] == "c"
                and self._trees.get((int(header["batch"]), int(header["slot"]))) is not None
                and self._trees[(int(header["batch"]), int(header["slot"]))].tree[me].parent is not None):
            killed.append((int(header["batch"]), int(header["slot"])))
            self.worker.transport.fabric.kill(me)  # a crash: the others see it lost (no goodbye)
            self._stop.set()  # and its aggregator thread ends, as the process would
            return
        take(self, header, payload)

    monkeypatch.setattr(Aggregator, "_tree_chunk", dies_mid_tree)
    layout = PSLayout(servers=1, workers=4)
    # (the killed rank's own pull then waits for its closed transport: 5 s, not 20)
    out, model, jobs = _run(layout, _config(timeout_s=5))
    assert killed, "no chain put rank 2 in the middle"
    victim = layout.worker_index(victim_rank)
    values = model[:4 * STEPS].view(4, STEPS)
    assert set(model.unique().tolist()) <= {0.0, -0.25}  # nothing applied twice
    for w in range(4):
        pushed = len(out.get(("pushed", w), []))
        applied = int((values[w] == -0.25).sum())
        if w == victim:
            assert applied == pushed - 1  # its own update of the batch it died in, and only that
        else:
            assert applied == pushed == STEPS  # its subtree was re-routed: nothing lost
    server = out["server"]
    assert server.worker_updates == int((model == -0.25).sum()) and server.skipped == 0
    aggregators = [j.worker.routing._aggregator for j in jobs if j.role == "worker" and j.rank != victim_rank]
    assert sum(a.rerouted for a in aggregators) >= 1 and jobs[0].server.routing.torn == 0


def test_the_planners_trees_apply_every_update_once() -> None:
    """The scheduler's own trees (``ScheduledSettings(trees=True)``): each member summed on its
    own host, the hosts in pipelined trees, chunk by chunk."""
    layout = PSLayout(servers=1, workers=4)
    config = PSConfig(consistency="async:100", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9, slack_s=0.5,
                                                  trees=True, chunk_bytes=CHUNK_BYTES))
    out, model, jobs = _run(layout, config)
    assert not [k for k in out if isinstance(k, tuple) and k[0] == "error"]
    assert torch.equal(model[:4 * STEPS], torch.full((4 * STEPS,), -0.25))
    server = out["server"]
    assert server.worker_updates == 4 * STEPS and server.skipped == 0 and server.errors == []
    aggregators = [j.worker.routing._aggregator for j in jobs if j.role == "worker"]
    assert server.scheduler["aggregated"] > 0 and sum(a.chunks_forwarded for a in aggregators) > 0


def test_the_model_is_multicast_down_trees_chunk_by_chunk() -> None:
    """With ``trees``, each batch of pulls leaves the server once per tree root; relays pass it
    on chunk by chunk; every worker ends with the server's model."""
    layout = PSLayout(servers=1, workers=4)
    config = PSConfig(consistency="async:100", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9, slack_s=0.5,
                                                  trees=True, chunk_bytes=CHUNK_BYTES))
    jobs = local_jobs(layout, config)
    out: dict[Any, Any] = {}

    def run(job: Any) -> None:
        if job.role == "server":
            out["server"] = job.serve()
            out["model"] = job.server.shards["m"].values.clone()
            return
        w = job.worker
        w.init_model("m", torch.zeros(SIZE), lr=1.0)
        for step in range(STEPS):
            w.pull_flat("m")
            update = torch.zeros(SIZE)
            update[w.index * STEPS + step] = 1.0
            w.push("m", update)
            w.clock()
        time.sleep(1.0)  # the last updates are applied (their batch's deadline is < 1 s)
        out[w.index] = w.pull_flat("m")
        out[("relayed", w.index)] = w.stats.relayed
        w.leave()

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for j in jobs:
        j.comm.close()
    assert torch.equal(out["model"][:4 * STEPS], torch.full((4 * STEPS,), -0.25))
    for w in range(4):  # the last pull (after every update was applied) is the server's model
        assert torch.equal(out[w], out["model"])
    server = out["server"]
    assert server.pulls_relayed > 0 and sum(out[("relayed", w)] for w in range(4)) >= server.pulls_relayed


def test_a_relay_lost_mid_multicast_tree_leaves_no_one_without_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first relay asked to pass a chunk on closes its transport instead: the pullers below
    it ask the server directly and still serve their own subtrees (no hang, no timeout)."""
    from mlfabric.ps.worker import PSWorker

    relay = PSWorker._relay
    died: list[int] = []
    lock = threading.Lock()

    def dies_when_relaying(self: PSWorker, children: Any, msg: Any) -> None:
        with lock:
            first = bool(children) and not died
            if first:
                died.append(self.index)
        if first:
            self.transport.close()
            raise RuntimeError("relay gone")
        relay(self, children, msg)

    monkeypatch.setattr(PSWorker, "_relay", dies_when_relaying)
    config = PSConfig(consistency="bsp", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=0, rate_bps=8e6, trees=True,
                                                  chunk_bytes=CHUNK_BYTES))
    finals = two_rounds_losing_a_relay(config, SIZE)
    gone, alive = lost_and_survivors(finals)
    assert gone == died and len(died) == 1, finals
    assert finals["server"].pulls_relayed >= 1 and finals["server"].errors == []
    for params in alive:  # all answered, with the same model of round 1
        torch.testing.assert_close(params, alive[0])


@pytest.mark.parametrize("trees", [True, False])
def test_co_located_workers_push_one_host_sum(trees: bool) -> None:
    """Two workers per host (#36): the scheduler merges a host's requests into one, the
    co-located member hands its update to the host's leading worker, which pushes the sum
    (down a tree, or Alg. 3's way): every update applied exactly once, in fewer server
    transfers than updates, and the model pulled once per host (the other worker gets it
    from its host's first puller)."""
    layout = PSLayout(servers=1, workers=4)
    config = PSConfig(consistency="async:100", timeout_s=20, routing="scheduled",
                      scheduled=ScheduledSettings(interval_s=0.05, aggregators=2, rate_bps=1e9, slack_s=0.5,
                                                  trees=trees, chunk_bytes=CHUNK_BYTES, workers_per_host=2))
    out, model, jobs = _run(layout, config)
    assert not [k for k in out if isinstance(k, tuple) and k[0] == "error"]
    assert torch.equal(model[:4 * STEPS], torch.full((4 * STEPS,), -0.25))
    server = out["server"]
    assert server.worker_updates == 4 * STEPS and server.skipped == 0 and server.errors == []
    assert server.dropped == 0 and server.unscheduled == 0
    parts = sum(out[w]["host_parts"] for w in range(4))
    sums = sum(out[w]["host_sums"] for w in range(4))
    assert parts >= 1 and sums >= 1 and parts >= sums
    assert server.updates_applied < server.worker_updates  # some transfers carried a host's two updates


@pytest.mark.parametrize("workers_per_host", [1, 2])
def test_mlfabric_s_on_trees_is_synchronous_sgd(workers_per_host: int) -> None:
    """MLfabric-S with trees (and host sums): each round's updates reach the server down
    cut-through trees, the model comes down multicast trees, and the rounds are exactly
    direct BSP's (integer-valued updates: sums exact in any order)."""
    layout = PSLayout(servers=1, workers=4)
    results = {}
    for routing in ("direct", "scheduled"):
        config = PSConfig(consistency="bsp", timeout_s=20, routing=routing,
                          scheduled=ScheduledSettings(interval_s=0.05, rate_bps=1e9, trees=True, chunk_bytes=64,
                                                      workers_per_host=workers_per_host))
        jobs = local_jobs(layout, config)
        finals: dict[int, torch.Tensor] = {}
        stats: dict[int, Any] = {}

        def work(job: Any) -> None:
            if job.role == "server":
                stats[job.rank] = job.serve()
                return
            w = job.worker
            w.init_model("m", torch.zeros(64), lr=1.0)
            for step in range(4):
                w.pull_flat("m")
                w.push("m", torch.arange(64.0) * (w.index + 1) + step)
                w.clock()
            finals[w.index] = w.pull_flat("m")
            w.leave()

        threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        for j in jobs:
            j.comm.close()
        results[routing] = (finals, stats)
    direct, scheduled = results["direct"], results["scheduled"]
    for w in range(4):
        assert torch.equal(scheduled[0][w], direct[0][0])
    s = scheduled[1][0]
    assert s.updates_applied == 4 and s.worker_updates == 16 and s.skipped == 0 and s.dropped == 0
    assert s.scheduler["aggregated"] > 0 and s.unscheduled == 0
