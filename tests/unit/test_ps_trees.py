"""#36's planning parts: pipelined aggregation trees and multicast (mlfabric.ps.scheduler.trees),
host requests and tree nodes in the scheduled policy's core, a lost node repaired.

    .venv/bin/python -m pytest tests/unit/test_ps_trees.py -q
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.ps.policies.scheduled.core import BatchingCore, GroupOrder, Request, merge_host_requests
from mlfabric.ps.policies.scheduled.cutthrough import ChunkSum
from mlfabric.ps.policies.scheduled.repair import repair_orders, repaired_entry
from mlfabric.ps.scheduler import NetState, Scheduler, SchedulerConfig, UpdateRequest
from mlfabric.ps.scheduler.netstate import Transfer, down_link, up_link
from mlfabric.ps.scheduler.ordering import Batch, order_updates
from mlfabric.ps.scheduler.trees import (TreeNode, plan_multicast, repair_tree, shape_tree, tree_aggregate,
                                         tree_depth)

GB = 1.25e9  # 10 Gbit/s in bytes/s
RATES = (0.125e9, 0.3125e9, 0.625e9, GB)


def _network(draw: Any, hosts: int) -> NetState:
    """A star with drawn NIC rates and a few transfers already reserved (earlier batches)."""
    net = NetState([draw(st.sampled_from(RATES)) for _ in range(hosts)],
                   [draw(st.sampled_from(RATES)) for _ in range(hosts)])
    for _ in range(draw(st.integers(0, 4))):
        src, dst = draw(st.integers(0, hosts - 1)), draw(st.integers(0, hosts - 1))
        net.reserve(src, dst, draw(st.floats(1e6, 50e6)), draw(st.floats(0.0, 0.05)))
    return net


@st.composite
def batches(draw: Any) -> tuple[NetState, Batch]:
    hosts = draw(st.integers(3, 9))
    n = draw(st.integers(1, 14))
    net = _network(draw, hosts)
    src = tuple(draw(st.integers(1, hosts - 1)) for _ in range(n))
    sizes = np.array([draw(st.floats(1e6, 100e6)) for _ in range(n)])
    deadlines = tuple(draw(st.integers(-1, 2 * n)) for _ in range(n))
    return net, Batch(src=src, sizes=sizes, servers=(0,), deadlines=deadlines)


def _within_residual(net: NetState, transfers: list[Transfer]) -> None:
    """Every link carries at most its residual at every instant (the planned profiles summed)."""
    per_link: dict[int, list[Transfer]] = {}
    for t in transfers:
        if t.src != t.dst and t.times:
            per_link.setdefault(up_link(t.src), []).append(t)
            per_link.setdefault(down_link(t.dst), []).append(t)
    for link, trs in per_link.items():
        times = sorted({x for t in trs for x in (*t.times, t.end)} | set(net.times[link]))
        for x in times:
            used = sum(t.rate_at(x) for t in trs)
            assert used <= net.residual(link, x) * (1 + 1e-9) + 1e-6, (link, x, used, net.residual(link, x))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from([0, 1 << 20, 4 << 20]))
def test_trees_never_exceed_a_links_residual_and_hold_every_update_once(case: tuple[NetState, Batch],
                                                                        chunk: int) -> None:
    net, batch = case
    ordered = order_updates(batch, net)
    agg = tree_aggregate(batch, ordered, net=net, chunk_bytes=chunk)
    _within_residual(net, [t for g in agg.groups for t in g.transfers])
    # every kept update in exactly one tree, once, on its own host's node; groups follow the order
    seen = [g for grp in agg.groups for g in grp.members]
    assert seen == list(ordered.order)
    for grp in agg.groups:
        on_nodes = sorted(g for n in grp.nodes for g in n.members)
        assert on_nodes == sorted(grp.members)
        assert all(batch.src[g] == n.host for n in grp.nodes for g in n.members)
        hosts = [n.host for n in grp.nodes]
        assert len(set(hosts)) == len(hosts) and grp.nodes[0].parent is None
        assert sum(n.parent is None for n in grp.nodes) == 1  # one root: one entry at the server
        assert len(grp.transfers) == len(grp.nodes)  # one edge per node
    commits = [agg.commit[g] for g in ordered.order]
    assert commits == sorted(commits)  # applied in order: commits are a running maximum


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_multicast_reaches_every_puller_once_within_the_residual(data: Any) -> None:
    hosts = data.draw(st.integers(2, 12))
    net = _network(data.draw, hosts)
    pullers = data.draw(st.lists(st.integers(1, hosts - 1), unique=True, min_size=1))
    plan = plan_multicast(net, server=0, pullers=pullers, model_size=50e6, chunk_bytes=1 << 20, start=0.0)
    _within_residual(net, list(plan.transfers))
    reached = [h for src, dsts in plan.tree.items() for h in dsts]
    assert sorted(reached) == sorted(pullers)  # each once
    assert set(plan.by_server) == set(plan.tree[0])
    assert plan.forwards(0) == plan.tree


def test_equal_nics_give_a_chain_and_slow_down_links_become_leaves() -> None:
    parent, rate = shape_tree([1, 2, 3, 4], send=[GB] * 4, fan=[GB] * 4, sink=GB)
    assert rate == GB and tree_depth([TreeNode(host=h, parent=p) for h, p in parent.items()]) == 4
    # host 4's down link is slow: it cannot relay a full-rate stream, so it is a leaf
    parent, rate = shape_tree([4, 1, 2], send=[GB] * 3, fan=[GB / 10, GB, GB], sink=GB)
    assert rate == GB and 4 not in parent.values()
    # nobody can relay at the sink's rate: the tree slows down to what the fan-out allows
    parent, rate = shape_tree([1, 2, 3], send=[GB] * 3, fan=[GB / 4, GB / 4, GB / 4], sink=GB)
    assert rate == pytest.approx(GB / 4, rel=1e-6)  # a chain at the quarter each relay can forward
    parent, rate = shape_tree([1, 2, 3], send=[GB] * 3, fan=[GB / 4, GB / 8, GB / 8], sink=GB)
    assert rate == pytest.approx(GB / 8, rel=1e-6) and list(parent.values()).count(1) == 2  # one relay, two leaves


def test_a_chain_costs_one_transfer_plus_a_chunk_per_level() -> None:
    net = NetState.star(9, GB)
    batch = Batch(src=tuple(range(1, 9)), sizes=np.full(8, 100e6), servers=(0,), deadlines=(20,) * 8)
    chunk = 1 << 20
    agg = tree_aggregate(batch, order_updates(batch, net), net=net, chunk_bytes=chunk)
    assert len(agg.groups) == 1
    depth = tree_depth(agg.groups[0].nodes)
    assert depth == 8
    assert agg.groups[0].arrival == pytest.approx((100e6 + (depth - 1) * chunk) / GB)
    store = tree_aggregate(batch, order_updates(batch, net), net=net, chunk_bytes=0)  # store-and-forward
    assert store.groups[0].arrival > 1.5 * agg.groups[0].arrival


def _requests(rng: random.Random, n: int, hosts: int, version: int, count: int = 1) -> list[UpdateRequest]:
    return [UpdateRequest(update_id=i, worker=rng.randrange(1, hosts), sizes=(rng.uniform(10e6, 100e6),),
                          version=version - rng.randrange(0, 40), count=count) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_apply_order_drops_and_delays_are_todays_with_trees(seed: int) -> None:
    rng = random.Random(seed)
    net = NetState([rng.choice(RATES) for _ in range(12)], [rng.choice(RATES) for _ in range(12)])
    reqs = _requests(rng, 40, 12, version=100)
    today = Scheduler(SchedulerConfig(tau_max=30, seed=seed), servers=[0], aggregators=[3, 7])
    trees = Scheduler(SchedulerConfig(tau_max=30, seed=seed, trees=True, chunk_bytes=1 << 20), servers=[0],
                      aggregators=[3, 7])
    a = today.schedule(reqs, version=100, network=net, now=0.0)
    b = trees.schedule(reqs, version=100, network=net, now=0.0)
    key = lambda s: [(d.update_id, d.dropped, d.reason, d.position, d.delay) for d in s.decisions]  # noqa: E731
    assert key(a) == key(b)
    assert all(d.delay <= 30 for d in b.applied())
    assert {m for g in b.aggregates for m in g.members} == {d.update_id for d in b.applied()}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(0, 40))
def test_host_requests_keep_every_member_within_the_delay_bound(seed: int, count: int, tau: int) -> None:
    # a request of m worker updates takes m versions: the positions shrink so that every
    # member's delay (the versions applied before it, itself included) stays <= tau
    rng = random.Random(seed)
    reqs = [UpdateRequest(update_id=i, worker=rng.randrange(1, 8), sizes=(10e6,), version=100 - rng.randrange(0, 40),
                          count=rng.randint(1, count)) for i in range(rng.randint(1, 20))]
    plan = Scheduler(SchedulerConfig(tau_max=tau, trees=True, chunk_bytes=1 << 20), servers=[0]).schedule(
        reqs, version=100, network=NetState.star(8, GB), now=0.0)
    counts = {r.update_id: r.count for r in reqs}
    applied = 0
    for d in plan.applied():
        applied += counts[d.update_id]
        assert d.delay == 100 + applied - next(r.version for r in reqs if r.update_id == d.update_id) <= tau


def test_host_requests_merge_what_is_ready_from_the_same_version() -> None:
    r = lambda rank, rid, v: Request(rank=rank, id=rid, model="m", version=v, sizes=(10.0,), norm=1.0)  # noqa: E731
    host = lambda rank: (rank + 1) // 2  # noqa: E731 - ranks 1,2 on host 1; 3,4 on host 2
    merged = merge_host_requests([r(1, 5, 7), r(3, 2, 7), r(2, 9, 7), r(4, 1, 6)], host)
    assert [(m.rank, m.id, m.members, m.count, m.version, m.norm) for m in merged] == [
        (1, 5, (1, 2), 2, 7, 2.0), (3, 2, (), 1, 7, 1.0), (4, 1, (), 1, 6, 1.0)]  # rank 4 straggles: on its own
    assert merge_host_requests([r(1, 5, 7)], host) == [r(1, 5, 7)]  # one worker per host: unchanged


# --------------------------------------------------------------------------- tree nodes, repair


def _drive(orders: list[GroupOrder], inputs: dict[tuple[int, int], torch.Tensor], chunk: int,
           rng: random.Random) -> tuple[torch.Tensor, int]:
    """Every node of one planned tree -- the runtime's :class:`ChunkSum` -- fed its members'
    chunks in a random order and its children's forwards as they come; returns the root's sum
    and how many updates are in it."""
    elements = next(iter(inputs.values())).numel()
    nodes = {o.host: ChunkSum([("m", *m) for m in o.members] + [("c", c) for c in o.children], elements, chunk)
             for o in orders}
    parent = {o.host: o.parent for o in orders}
    pending = [(o.host, m, i) for o in orders for m in o.members for i in range(nodes[o.host].chunks)]
    rng.shuffle(pending)
    root: dict[int, torch.Tensor] = {}
    members: set[Any] = set()
    queue: list[tuple[int, Any, int, torch.Tensor, Any]] = []
    while pending or queue:
        if queue and (not pending or rng.random() < 0.5):
            host, source, index, data, summed = queue.pop(0)
        else:
            host, member, index = pending.pop()
            start, length = nodes[host].span(index)
            source, data, summed = ("m", *member), inputs[member][start:start + length], [(*member, 0)]
        for f in nodes[host].add(source, index, data, summed):
            if parent[host] is None:
                assert f.index not in root  # each chunk reaches the server once
                root[f.index] = f.tensor
                members |= set(f.members)
            else:
                queue.append((parent[host], ("c", host), f.index, f.tensor, f.members))
    assert all(n.done for n in nodes.values())
    return torch.cat([root[i] for i in range(len(root))]), len(members)


@pytest.mark.parametrize("seed", range(5))
def test_cut_through_sums_are_exact_with_integer_inputs(seed: int) -> None:
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    hosts = list(range(1, 8))
    parent, _ = shape_tree(hosts, send=[GB] * 7, fan=[rng.choice([GB, 2 * GB, GB / 3]) for _ in hosts], sink=GB)
    kids: dict[int, list[int]] = {h: [] for h in hosts}
    for h, p in parent.items():
        if p is not None:
            kids[p].append(h)
    members = {h: [(h * 10 + k, 1) for k in range(rng.randint(1, 2))] for h in hosts}
    orders = [GroupOrder(host=h, slot=1, members=tuple(members[h]), servers=(0,), deadline_in=1.0, rates=(None,),
                         parent=parent[h], children=tuple(kids[h]), chunk_bytes=64) for h in hosts]
    inputs = {m: torch.from_numpy(np_rng.integers(-2**40, 2**40, size=37)) for h in hosts for m in members[h]}
    total, count = _drive(orders, inputs, chunk=8, rng=rng)
    assert total.tolist() == sum(inputs.values()).tolist()  # exact
    assert count == len(inputs)


def test_a_lost_node_in_the_middle_is_repaired_without_losing_or_double_counting() -> None:
    core = BatchingCore(servers=[0], aggregators=[], hosts=9, tau=30, seed=0, interval_s=0.1, slack_s=1.0,
                        rate_bps=80e9, monitor_lag_s=0.0, host_of=lambda rank: (rank + 1) // 2, trees=True,
                        chunk_bytes=1 << 20)
    for rank in range(1, 17):  # 8 hosts, two workers each, same version: 8 host requests
        core.request(Request(rank=rank, id=1, model="m", version=0, sizes=(100e6,)))
    plan = core.plan("m", core.pending.pop("m"), 0, 0.0)
    assert len(plan.requests) == 8 and all(r.count == 2 for r in plan.requests)
    assert plan.entries == [["g", 1, 16, plan.entries[0][3], list(range(1, 17))]]
    orders = [g for g in plan.groups if g.slot == 1]
    assert len(orders) == 8 and sum(g.parent is None for g in orders) == 1
    middle = next(g for g in orders if g.parent is not None and g.children)
    fixed, lost = repair_orders(orders, middle.host)
    assert lost == middle.members and middle.host not in {g.host for g in fixed}
    # every other member on exactly one surviving node, the tree still one root, connected
    kept = [m for g in fixed for m in g.members]
    assert sorted(kept) == sorted(m for g in orders for m in g.members if m not in lost)
    assert len(kept) == len(set(kept))
    by_host = {g.host: g for g in fixed}
    for g in fixed:  # every node reaches the one root through live parents, with no cycle
        seen, cur = set(), g
        while cur.parent is not None:
            assert cur.host not in seen and cur.host in by_host[cur.parent].children
            seen.add(cur.host)
            cur = by_host[cur.parent]
    assert sum(g.parent is None for g in fixed) == 1
    assert all(c in by_host and by_host[c].parent == g.host for g in fixed for c in g.children)
    entry = repaired_entry(plan.entries[0], lost, plan.requests)
    assert entry[2] == 16 - 2 and sorted(entry[4]) == sorted(set(range(1, 17)) - set(middle.members[0][:1]) -
                                                             {middle.members[0][0] + 1})
    # the repaired tree sums exactly the surviving updates (integer inputs), each once
    rng = random.Random(1)
    by_rank = {r.rank: r for r in plan.requests}
    inputs = {m: torch.full((11,), by_rank[m[0]].rank * 1000 + 7, dtype=torch.int64) for g in fixed for m in g.members}
    total, count = _drive(fixed, inputs, chunk=4, rng=rng)
    assert total.tolist() == sum(inputs.values()).tolist() and count == len(inputs) == 7


def test_a_lost_root_hands_the_tree_to_its_first_child() -> None:
    nodes = [TreeNode(host=1, parent=None, children=(2, 3), members=(10,)), TreeNode(host=2, parent=1, members=(20,)),
             TreeNode(host=3, parent=1, children=(4,), members=(30,)), TreeNode(host=4, parent=3, members=(40,))]
    fixed, lost = repair_tree(nodes, 1)
    assert lost == (10,)
    assert {n.host: (n.parent, n.children) for n in fixed} == {2: (None, (3,)), 3: (2, (4,)), 4: (3, ())}
    fixed, lost = repair_tree(nodes, 3)
    assert lost == (30,) and {n.host: n.parent for n in fixed} == {1: None, 2: 1, 4: 1}
    with pytest.raises(ValueError, match="not a node"):
        repair_tree(nodes, 9)


def test_mlfabric_s_on_trees_plans_a_rounds_last_requests_at_once() -> None:
    def core(trees: bool) -> BatchingCore:
        return BatchingCore(servers=[0], aggregators=[], hosts=4, tau=None, seed=0, interval_s=0.1, slack_s=1.0,
                            rate_bps=80e9, monitor_lag_s=0.0, trees=trees, chunk_bytes=1 << 20)

    for trees in (False, True):
        c = core(trees)
        assert not c.due(0.0, {1, 2, 3})  # the first turn sets the tick
        for rank in (1, 2):
            c.request(Request(rank=rank, id=1, model="m", version=0, sizes=(1e6,)))
        assert c.turn(0.1, {1, 2, 3}, lambda m: 0)  # the tick: ranks 1 and 2 planned
        c.request(Request(rank=3, id=1, model="m", version=0, sizes=(1e6,)))
        # rank 3 is the round's last: with trees it goes at once, without it waits for the tick
        assert c.due(0.15, {1, 2, 3}) is trees
        if trees:
            c.turn(0.15, {1, 2, 3}, lambda m: 0)
            c.request(Request(rank=1, id=2, model="m", version=1, sizes=(1e6,)))
            assert not c.due(0.16, {1, 2, 3})  # a new round: everyone counts again


def test_mlfabric_a_on_trees_holds_its_batch_while_the_servers_down_link_is_busy() -> None:
    from mlfabric.ps.policies.scheduled.core import PACE_LEAD_S

    def core(trees: bool) -> BatchingCore:  # 1 GB/s NICs: a 300 MB update takes 0.3 s
        return BatchingCore(servers=[0], aggregators=[], hosts=4, tau=30, seed=0, interval_s=0.1, slack_s=1.0,
                            rate_bps=8e9, monitor_lag_s=0.0, trees=trees, chunk_bytes=1 << 20)

    def ask(c: BatchingCore, rank: int) -> None:
        c.request(Request(rank=rank, id=1, model="m", version=0, sizes=(300e6,)))

    for trees in (False, True):
        c = core(trees)
        assert not c.due(0.0, {1, 2, 3})  # the first turn sets the tick
        ask(c, 1)
        (first,) = c.turn(0.1, {1, 2, 3}, lambda m: 0)
        # the one tree reaches the server 0.3 s after the batch: the down-link is busy until then
        assert c.link_free == (pytest.approx(0.4) if trees else 0.0)
        assert first.commits == [pytest.approx(0.4)]
        ask(c, 2)
        # the tick: without trees the batch goes; with them it waits for the link (less the lead)
        assert c.due(0.2, {1, 2, 3}) is not trees
        if not trees:
            continue
        assert c.wake_at() == pytest.approx(0.4 - PACE_LEAD_S)
        assert not c.due(0.3, {1, 2, 3})
        ask(c, 3)  # arrives while the link is busy: it joins the held batch
        (second,) = c.turn(0.4 - PACE_LEAD_S, {1, 2, 3}, lambda m: 0)
        assert sorted(r.rank for r in second.requests) == [2, 3] and len(second.entries) == 1
        # one tree of both; it cannot reach the server before the first is through
        assert c.link_free >= 0.4 + 0.3 - 1e-9 and c.wake_at() == pytest.approx(c.link_free - PACE_LEAD_S)


def test_a_lost_distributor_in_the_middle_of_a_multicast_is_bypassed() -> None:
    from mlfabric.ps.scheduler.trees import multicast_depths, repair_multicast

    net = NetState.star(9, GB)
    plan = plan_multicast(net, server=0, pullers=list(range(1, 9)), model_size=100e6, chunk_bytes=1 << 20, start=0.0)
    middle = next(h for h, dsts in plan.tree.items() if h != 0 and dsts and any(h in d for d in plan.tree.values()))
    fixed = repair_multicast(plan.tree, middle)
    reached = [h for dsts in fixed.values() for h in dsts]
    assert sorted(reached) == sorted(set(range(1, 9)) - {middle}) and len(reached) == len(set(reached))
    assert set(multicast_depths(fixed, 0)) == set(reached)  # all still connected to the server
    with pytest.raises(ValueError, match="does not receive"):
        repair_multicast(fixed, middle)


def test_a_pull_during_a_multicast_joins_it_as_a_leaf() -> None:
    from mlfabric.ps.policies.scheduled.core import PullBatcher

    batcher = PullBatcher(distributors=0, seed=0, server=0, trees=True, chunk_bytes=1 << 20)
    net = NetState.star(8, GB)
    plan = batcher.plan(net, me=0, pullers=[1, 2, 3, 4], model_size=100e6, now=0.0)
    assert not batcher.ready(0.01, True) and batcher.busy_until == pytest.approx(max(t.end for t in plan.transfers))
    joined = batcher.attach(net, me=0, host=6, model_size=100e6, now=0.01)
    assert joined is not None
    (relay, dsts), = joined.tree.items()
    assert dsts == (6,) and relay in (1, 2, 3, 4) and not plan.tree.get(relay)  # a leaf of the round relays
    assert joined.transfers[0].src == relay and joined.transfers[0].dst == 6
    assert batcher.attach(net, me=0, host=6, model_size=100e6, now=0.02) is None  # already in it
    assert batcher.attach(net, me=0, host=7, model_size=100e6, now=batcher.busy_until) is None  # round over
