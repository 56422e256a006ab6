"""MLfabric's update scheduler (mlfabric/ps/scheduler): hand-made cases from the paper and
property tests on random batches and networks (delay bound, capacity, work conservation,
determinism, fast == reference).

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler.py -q
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.ps.scheduler import (Batch, NetState, Scheduler, SchedulerConfig, UpdateRequest, aggregate, distribute,
                                   order_updates, plan_batch)
from mlfabric.ps.scheduler.bench import plan_key, section_7_4_batch
from mlfabric.ps.scheduler.netstate import INF
from mlfabric.ps.scheduler.reference import reference_plan

MB = 1e6
MBPS = 1e6 / 8  # bytes/s in one Mbit/s
PROPS = settings(max_examples=150, deadline=None)


# --------------------------------------------------------------------------- helpers


def random_instance(seed: int, n: int, k: int, n_servers: int, *, deadlines: bool = True):
    rng = np.random.default_rng(seed)
    hosts = n_servers + k + rng.integers(2, 6)
    rates = np.array([1.0, 2.5, 3.3, 5.0, 10.0]) * 1.25e8
    net = NetState(rng.choice(rates, hosts), rng.choice(rates, hosts))
    if rng.random() < 0.3:  # a monitor forecast: the first server's down link drops for a while
        cap = net.peak[1]
        net.set_timeline(1, [0.0, 0.05, 0.2], [cap, cap / 4, cap])
    servers = tuple(range(n_servers))
    src = tuple(int(h) for h in rng.integers(n_servers, hosts, n))  # aggregator hosts send updates too
    sizes = rng.uniform(5 * MB, 60 * MB, (n, n_servers))
    dl = tuple(int(d) for d in rng.integers(-1, n + 2, n)) if deadlines else None
    batch = Batch(src=src, sizes=sizes, servers=servers, deadlines=dl)
    group_hosts = [tuple(n_servers + j for _ in servers) for j in range(k)]
    return batch, net, group_hosts


def all_transfers(plan):
    agg = plan.aggregated
    out = [t for trs in agg.member_transfers.values() for t in trs]
    out += [t for grp in agg.groups for t in grp.transfers]
    return out


def link_load(transfers, link: int, t: float) -> float:
    total = 0.0
    for tr in transfers:
        if tr.src == tr.dst:
            continue
        if link in (2 * tr.src, 2 * tr.dst + 1):
            total += tr.rate_at(t)
    return total


def check_capacity(net: NetState, transfers) -> None:
    """At every breakpoint of every transfer, each link carries no more than its capacity."""
    points = sorted({p for tr in transfers for p in (*tr.times, tr.end)})
    links = {lk for tr in transfers if tr.src != tr.dst for lk in (2 * tr.src, 2 * tr.dst + 1)}
    for link in links:
        for t in points:
            cap = net.residual(link, t)
            assert link_load(transfers, link, t) <= cap * (1 + 1e-9) + 1e-6, (link, t)


# --------------------------------------------------------------------------- netstate


def test_netstate_fig4_t_en_is_7_and_netup_leaves_the_rest():
    # Fig. 4(b): a 30 MB update at t = 0 over a path whose residual varies: 2 MB/s for 2 s,
    # 5 MB/s for 3 s, then 5.5 MB/s: 4 + 15 + 11 = 30 MB at t = 7
    net = NetState([100 * MB, 100 * MB], [100 * MB, 100 * MB])
    net.set_timeline(3, [0.0, 2.0, 5.0], [2 * MB, 5 * MB, 5.5 * MB])  # down link of host 1
    assert net.t_en(0, 1, 30 * MB, 0.0) == pytest.approx(7.0)
    tr = net.reserve(0, 1, 30 * MB, 0.0)
    assert tr.end == pytest.approx(7.0)
    assert tr.times == (0.0, 2.0, 5.0) and tr.rates == (2 * MB, 5 * MB, 5.5 * MB)
    assert tr.bytes_sent() == pytest.approx(30 * MB)
    # Fig. 4(c): the bottleneck is used up over [0, 7), the sender's NIC keeps the rest
    assert net.timeline(3) == ([0.0, 7.0], [0.0, 5.5 * MB])
    assert net.timeline(0) == ([0.0, 2.0, 5.0, 7.0], [98 * MB, 95 * MB, 94.5 * MB, 100 * MB])
    # a second transfer on the same path must wait for the reservation to end
    assert net.t_en(0, 1, 11 * MB, 0.0) == pytest.approx(9.0)
    net.check()


def test_netstate_local_transfer_takes_no_time_and_fork_is_a_snapshot():
    net = NetState.star(3, 10 * MB)
    assert net.t_en(1, 1, 50 * MB, 2.0) == 2.0
    snap = net.fork()
    net.reserve(1, 0, 50 * MB, 0.0)
    assert snap.t_en(2, 0, 10 * MB, 0.0) == pytest.approx(1.0)
    assert net.t_en(2, 0, 10 * MB, 0.0) == pytest.approx(6.0)
    assert net.lower_bound(2, 0, 10 * MB, 0.0) <= net.t_en(2, 0, 10 * MB, 0.0)


def test_netstate_unreachable_path_is_infinite():
    net = NetState([10 * MB, 0.0], [10 * MB, 10 * MB])
    assert net.t_en(1, 0, MB, 0.0) == INF
    with pytest.raises(ValueError, match="never completes"):
        net.reserve(1, 0, MB, 0.0)


# --------------------------------------------------------------------------- ordering


def fig5_batch():
    # §5.1.2: the server's NIC is 100 Mbps; w1 sits behind a 10 Mbps link, w2 has plenty.
    # g1 takes 10 s (12.5 MB at 10 Mbps); g2 at the remaining 90 Mbps takes 1.1 s.
    net = NetState([1000 * MBPS, 10 * MBPS, 1000 * MBPS], [100 * MBPS, 1000 * MBPS, 1000 * MBPS])
    g2_size = 1.1 * 90 * MBPS
    batch = Batch(src=(1, 2), sizes=np.array([12.5 * MB, g2_size]), servers=(0,), deadlines=(1, 5))
    return batch, net


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_ordering_fig5_drops_the_slow_due_update(impl):
    batch, net = fig5_batch()
    plan = (plan_batch if impl == "fast" else reference_plan)(batch, net, [], objective="async")
    decisions = plan.ordered.by_index()
    assert decisions[0].dropped and decisions[0].reason == "look-ahead"
    assert not decisions[1].dropped and decisions[1].position == 1
    # with g1 gone g2 gets the whole 100 Mbps: 1.1 * 90 / 100 s
    assert decisions[1].end == pytest.approx(0.99)
    assert plan.ordered.order == (1,)


def test_ordering_without_deadlines_is_shortest_first():
    batch, net = fig5_batch()
    nodl = Batch(src=batch.src, sizes=batch.sizes, servers=batch.servers)
    res = order_updates(nodl, net)
    assert res.order == (1, 0)
    d = res.by_index()
    # g2 first, using the server's whole 100 Mbps for 0.99 s (time sharing: the link is
    # full, so g1 cannot trickle alongside), then g1 at its 10 Mbps for 10 s
    assert d[1].end == pytest.approx(0.99) and d[0].end == pytest.approx(10.99)
    assert d[0].transfers[0].begin == pytest.approx(0.99)


def test_ordering_doomed_updates_are_dropped_without_reserving():
    net = NetState.star(4, 10 * MB)
    batch = Batch(src=(1, 2, 3), sizes=np.array([10 * MB, 20 * MB, 30 * MB]), servers=(0,), deadlines=(0, 3, 1))
    res = order_updates(batch, net)
    d = res.by_index()
    assert d[0].dropped and d[0].reason == "doomed"
    # g2 (due at 1) goes first though it is the largest; g1 follows
    assert res.order == (2, 1)
    assert d[2].end == pytest.approx(3.0) and d[1].end == pytest.approx(5.0)


def test_ordering_delay_example_from_fig1_meets_the_bound():
    # one old update among fresher ones: it must be applied within its deadline though it is
    # the largest; the fresher ones keep shortest-first order around it
    net = NetState.star(6, 10 * MB)
    sizes = np.array([50 * MB, 10 * MB, 20 * MB, 30 * MB, 40 * MB])
    batch = Batch(src=(1, 2, 3, 4, 5), sizes=sizes, servers=(0,), deadlines=(2, 9, 9, 9, 9))
    res = order_updates(batch, net)
    assert res.order == (1, 0, 2, 3, 4)


# --------------------------------------------------------------------------- aggregation


def test_aggregation_groups_keep_order_and_are_ready_before_the_server_is_free():
    # 8 equal updates, a 10 MB/s server, aggregators with fast NICs: aggregating the tail
    # saves server bytes; every group is complete before the earlier groups are in
    caps = [10 * MB] + [100 * MB] * 2 + [10 * MB] * 8
    net = NetState(caps, caps)
    batch = Batch(src=tuple(range(3, 11)), sizes=np.full(8, 10 * MB), servers=(0,))
    plan = plan_batch(batch, net, [(1,), (2,)], objective="sync")
    agg = plan.aggregated
    assert agg.groups, "the tail should be aggregated"
    flat = list(agg.direct) + [g for grp in agg.groups for g in grp.members]
    assert flat == list(plan.ordered.order)
    t_prev = agg.commit[agg.direct[-1]] if agg.direct else None
    for grp in agg.groups:
        if t_prev is not None:
            assert grp.ready <= t_prev + 1e-12
        t_prev = grp.commit
    # all direct would take 8 s; aggregating must be faster
    assert agg.obj_sync < 8.0 - 1e-9


def test_aggregation_without_aggregators_is_all_direct():
    batch, net = fig5_batch()
    nodl = Batch(src=batch.src, sizes=batch.sizes, servers=batch.servers)
    agg = aggregate(nodl, order_updates(nodl, net), [])
    assert agg.split == 2 and agg.groups == ()


def test_multi_server_components_reserved_together():
    # §10.2: t_en(g) = max over components (eq. 18); the update's NIC carries both
    net = NetState([10 * MB, 10 * MB, 10 * MB], [10 * MB, 10 * MB, 10 * MB])
    batch = Batch(src=(2,), sizes=np.array([[10 * MB, 30 * MB]]), servers=(0, 1))
    res = order_updates(batch, net)
    d = res.by_index()[0]
    assert len(d.transfers) == 2
    assert d.end == pytest.approx(4.0) == max(t.end for t in d.transfers)


def test_distribution_serves_every_worker_through_distributors():
    caps = [10 * MB] + [100 * MB] * 2 + [10 * MB] * 6
    net = NetState(caps, caps)
    res = distribute(net, server=0, workers=list(range(3, 9)), distributors=[1, 2], model_size=10 * MB)
    assert sorted(res.received) == list(range(3, 9))
    direct_only = distribute(net, server=0, workers=list(range(3, 9)), distributors=[], model_size=10 * MB)
    assert direct_only.makespan == pytest.approx(6.0)
    assert res.makespan < direct_only.makespan
    for d, ws in res.groups:
        to_d = [t for t in res.transfers if t.src == 0 and t.dst == d][0]
        for t in res.transfers:
            if t.src == d:
                assert t.begin >= to_d.end - 1e-12
    check_capacity(net, res.transfers)


# --------------------------------------------------------------------------- facade


def make_requests(rng: random.Random, n: int, hosts: int, n_servers: int, version: int) -> list[UpdateRequest]:
    return [UpdateRequest(update_id=100 + i, worker=rng.randrange(n_servers + 2, hosts),
                          sizes=tuple(rng.uniform(5, 50) * MB for _ in range(n_servers)),
                          version=version - rng.randrange(0, 12), norm=rng.random()) for i in range(n)]


@PROPS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 14), tau=st.integers(0, 12), servers=st.integers(1, 2),
       mode=st.sampled_from(["async", "sync"]))
def test_facade_delay_bound_capacity_and_determinism(seed, n, tau, servers, mode):
    rng = random.Random(seed)
    hosts = servers + 2 + rng.randrange(2, 7)
    nrng = np.random.default_rng(seed)
    rates = np.array([1.0, 2.5, 5.0, 10.0]) * 1.25e8
    net = NetState(nrng.choice(rates, hosts), nrng.choice(rates, hosts))
    version = 50
    reqs = make_requests(rng, n, hosts, servers, version)
    sched = Scheduler(SchedulerConfig(tau_max=tau, mode=mode, seed=seed % 7), servers=range(servers),
                      aggregators=[servers, servers + 1])
    out = sched.schedule(reqs, version=version, network=net)
    # every update once, positions 1..kept
    assert sorted(d.update_id for d in out.decisions) == sorted(r.update_id for r in reqs)
    applied = out.applied()
    assert [d.position for d in applied] == list(range(1, len(applied) + 1))
    if mode == "async":
        assert all(d.delay <= tau for d in applied)
        dropped_ids = {d.update_id for d in out.dropped()}
        for r in reqs:  # an update whose deadline had passed is never applied
            if r.version + tau - version < 1:
                assert r.update_id in dropped_ids
    else:
        assert not out.dropped()
    # applied in order: commits never decrease along the application order
    commits = [d.commit for d in applied]
    assert commits == sorted(commits)
    # capacity: all reserved transfers together fit the network
    transfers = [t for d in applied for t in d.transfers] + [t for a in out.aggregates for t in a.transfers]
    check_capacity(net, transfers)
    # determinism: same input (in any order) -> same output
    again = sched.schedule(list(reversed(reqs)), version=version, network=net)
    assert again == out


# --------------------------------------------------------------------------- properties of the pipeline


@PROPS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 16), k=st.integers(0, 2), servers=st.integers(1, 2),
       objective=st.sampled_from(["async", "sync"]), native=st.sampled_from([None, False]))
def test_fast_equals_reference(seed, n, k, servers, objective, native):
    # native=None: the compiled loops where built (one server); False: the Python path
    batch, net, hosts = random_instance(seed, n, k, servers, deadlines=objective == "async")
    fast = plan_batch(batch, net, hosts, objective=objective, native=native)
    ref = reference_plan(batch, net, hosts, objective=objective)
    assert plan_key(fast) == plan_key(ref)
    # deadlines: every kept update's position is within dl(g) (delay <= tau_max)
    if batch.deadlines is not None:
        for d in fast.ordered.kept():
            assert d.position <= batch.deadlines[d.index]


@PROPS
@given(seed=st.integers(0, 2**31), n=st.integers(2, 16), k=st.integers(1, 2))
def test_server_nic_never_idles_while_an_aggregate_is_ready(seed, n, k):
    batch, net, hosts = random_instance(seed, n, k, 1, deadlines=False)
    plan = plan_batch(batch, net, hosts, objective="async")
    agg = plan.aggregated
    transfers = all_transfers(plan)
    check_capacity(net, transfers)
    server_down = 2 * batch.servers[0] + 1
    t_prev = agg.commit[agg.direct[-1]] if agg.direct else None
    for grp in agg.groups:
        # the constraint: the group is complete before the server is done with earlier groups
        if t_prev is not None:
            assert grp.ready <= t_prev
        # from `ready` until it is in, the aggregate uses the whole residual of its path:
        # at every instant one of the two links is full
        tr = grp.transfers[0]
        assert tr.start == grp.ready
        edges = [grp.ready, *[t for t in tr.times if t > grp.ready], tr.end]
        for a, b in zip(edges, edges[1:]):
            if b <= a:
                continue
            mid = (a + b) / 2
            free_up = net.residual(2 * tr.src, mid) - link_load(transfers, 2 * tr.src, mid)
            free_down = net.residual(server_down, mid) - link_load(transfers, server_down, mid)
            assert min(free_up, free_down) <= 1e-6 * net.peak[server_down], (grp.slot, mid)
        t_prev = grp.commit


def test_bench_instances_fast_equals_reference():
    for mode in ("async", "sync"):
        batch, net, hosts = section_7_4_batch(60, aggregators=2, seed=3, mode=mode)
        fast = plan_batch(batch, net, hosts, objective=mode)
        ref = reference_plan(batch, net, hosts, objective=mode)
        assert plan_key(fast) == plan_key(ref)
        assert fast.aggregated.splits_tried <= ref.aggregated.splits_tried


def test_sync_mode_tries_longest_first_and_keeps_the_smaller_makespan():
    # k = 0, a 3.3 Gbit/s server: two fast workers and a slow (1 Gbit/s) one with the largest
    # update. Shortest first sends the fast ones first and leaves the slow one alone at the
    # end; longest first starts the slow one at once and the fast ones share the rest
    gbps = 1.25e8
    net = NetState([10 * gbps, 10 * gbps, 10 * gbps, 1 * gbps], [3.3 * gbps, 10 * gbps, 10 * gbps, 10 * gbps])
    batch = Batch(src=(1, 2, 3), sizes=np.array([30 * MB, 40 * MB, 60 * MB]), servers=(0,))
    sjf = order_updates(batch, net)
    assert sjf.order == (0, 1, 2)
    plan = plan_batch(batch, net, [], objective="sync")
    assert plan.ordered.order == (2, 1, 0)
    assert plan.aggregated.obj_sync < max(d.end for d in sjf.kept()) - 1e-9
    ref = reference_plan(batch, net, [], objective="sync")
    assert plan_key(plan) == plan_key(ref)
    # with deadlines (or for obj_async) the order is Alg. 2's: no second list
    assert plan_batch(batch, net, [], objective="async").ordered.order == (0, 1, 2)


def test_sync_mode_drops_nothing_and_chooses_by_makespan():
    batch, net, hosts = section_7_4_batch(40, aggregators=2, seed=1, mode="sync")
    plan = plan_batch(batch, net, hosts, objective="sync")
    assert len(plan.ordered.order) == 40
    all_direct = plan.aggregated.commit[plan.ordered.order[-1]] if plan.aggregated.split == 40 else None
    ordered = plan.ordered
    direct_sync = max(d.end for d in ordered.kept())
    assert plan.aggregated.obj_sync <= direct_sync
    if all_direct is not None:
        assert plan.aggregated.obj_sync == pytest.approx(direct_sync)
    per_index = defaultdict(int)
    for g in plan.aggregated.commit:
        per_index[g] += 1
    assert set(per_index) == set(range(40))


def test_the_scheduler_sends_direct_what_an_aggregator_would_not_commit_earlier() -> None:
    """Alg. 3 breaks ties towards aggregation: two equal updates would go one direct, one
    through an aggregator, both committed as soon as two direct pushes. The Scheduler the
    runtime runs sends both direct; with four, two groups do commit earlier and are kept."""
    sched = Scheduler(SchedulerConfig(tau_max=4, mode="async", aggregation=True, seed=0), servers=[0],
                      aggregators=[1, 3])

    def plan(n: int):  # noqa: ANN202
        reqs = [UpdateRequest(update_id=i, worker=1 + i, sizes=(1000.0,), version=0, norm=0.0) for i in range(n)]
        return sched.schedule(reqs, version=0, network=NetState([1e8] * 5, [1e8] * 5, origin=0.0), now=0.0)

    pair = plan(2)
    assert pair.split == 2 and pair.aggregates == () and [d.group for d in pair.applied()] == [0, 0]
    assert pair.obj_async == pytest.approx(15e-6)  # commits at 10 and 20 us, as with the detour
    four = plan(4)
    assert four.split == 1 and len(four.aggregates) == 2
    assert four.obj_async == pytest.approx(22.5e-6)  # all direct: 10, 20, 30, 40 us, mean 25
