"""The compiled scheduler loops (mlfabric/ps/scheduler/_sched.c) against the Python path:
identical decisions, bit for bit, on random instances (forecasts, local updates, empty
updates, unreachable hosts, deadlines), and bad input raises instead of crashing.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler_native.py -q

Skipped where the kernel is not built (no C compiler): the Python path is then the only one.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.ps.scheduler import Batch, NetState, aggregate, order_updates, plan_batch
from mlfabric.ps.scheduler import native
from mlfabric.ps.scheduler.bench import plan_key, section_7_4_batch
from mlfabric.ps.scheduler.ordering import list_order, longest_first

pytestmark = pytest.mark.skipif(not native.available(), reason="mlfabric.ps.scheduler._sched is not built")

MB = 1e6
PROPS = settings(max_examples=200, deadline=None)


def order_key(res):
    return (tuple((d.index, d.dropped, d.reason, d.position, d.start, d.end,
                   tuple((t.src, t.dst, t.size, t.start, t.end, t.times, t.rates) for t in d.transfers))
                  for d in res.decisions), res.order)


def agg_key(agg):
    return (agg.split, agg.direct, agg.obj_async, agg.obj_sync,
            tuple((g.slot, g.hosts, g.members, g.ready, g.arrival, g.commit, g.transfers) for g in agg.groups),
            sorted(agg.member_transfers.items()), sorted(agg.commit.items()))


def instance(seed: int, n: int, k: int, *, deadlines: bool):
    """A single-server instance with the awkward cases mixed in: forecasts on any link,
    updates from the server's or an aggregator's own host, empty updates, a dead NIC."""
    rng = np.random.default_rng(seed)
    hosts = 1 + k + int(rng.integers(2, 6))
    rates = np.array([1.0, 2.5, 3.3, 5.0, 10.0]) * 1.25e8
    net = NetState(rng.choice(rates, hosts), rng.choice(rates, hosts))
    for link in rng.choice(2 * hosts, size=int(rng.integers(0, 4)), replace=False):
        cap = net.peak[link]
        t1 = float(rng.uniform(0.01, 0.2))
        net.set_timeline(int(link), [0.0, t1, t1 + float(rng.uniform(0.01, 0.3))],
                         [cap, cap * float(rng.choice([0.0, 0.25, 0.5])), cap])
    if rng.random() < 0.1:  # a worker whose NIC is down: its updates can never complete
        dead = int(rng.integers(1 + k, hosts))
        net.set_timeline(2 * dead, [0.0], [0.0])
    src = tuple(int(h) for h in rng.integers(0, hosts, n))  # the server and aggregators push too
    sizes = rng.uniform(5 * MB, 60 * MB, n)
    sizes[rng.random(n) < 0.1] = 0.0
    dl = tuple(int(d) for d in rng.integers(-1, n + 2, n)) if deadlines else None
    return Batch(src=src, sizes=sizes, servers=(0,), deadlines=dl), net, [(1 + j,) for j in range(k)]


@PROPS
@given(seed=st.integers(0, 2**31), n=st.integers(0, 24), k=st.integers(0, 3), deadlines=st.booleans(),
       objective=st.sampled_from(["async", "sync"]))
def test_native_equals_python(seed, n, k, deadlines, objective):
    batch, net, hosts = instance(seed, n, k, deadlines=deadlines)
    py = order_updates(batch, net, native=False)
    c = order_updates(batch, net, native=True)
    assert order_key(c) == order_key(py)
    # the compiled ordering's snapshots, rebuilt on demand, are the Python ones
    for s_c, s_py in zip(c.snapshots, py.snapshots):
        assert s_c.times == s_py.times and s_c.rates == s_py.rates
        assert np.array_equal(s_c.first_free, s_py.first_free) and np.array_equal(s_c.peak, s_py.peak)
    try:
        a_py = aggregate(batch, py, hosts, objective=objective, native=False)
    except ValueError:  # an aggregate that can never reach the server (dead NIC): both raise
        with pytest.raises(ValueError):
            aggregate(batch, c, hosts, objective=objective, native=True)
        return
    assert agg_key(aggregate(batch, c, hosts, objective=objective, native=True)) == agg_key(a_py)
    # a compiled ordering aggregated in Python and the other way round
    assert agg_key(aggregate(batch, c, hosts, objective=objective, native=False)) == agg_key(a_py)
    assert agg_key(aggregate(batch, py, hosts, objective=objective, native=True)) == agg_key(a_py)
    lst = longest_first(batch, net)
    assert order_key(list_order(batch, net, lst, native=True)) == order_key(list_order(batch, net, lst, native=False))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_native_equals_python_on_bench_batches(mode):
    for u in (40, 200):
        batch, net, hosts = section_7_4_batch(u, aggregators=2, seed=7, mode=mode)
        assert plan_key(plan_batch(batch, net, hosts, objective=mode, native=True)) == \
            plan_key(plan_batch(batch, net, hosts, objective=mode, native=False))


def test_native_start_after_origin_and_before_it():
    batch, net, hosts = instance(3, 10, 2, deadlines=True)
    for start in (0.0, 0.05, 0.3):
        assert plan_key(plan_batch(batch, net, hosts, objective="async", start=start, native=True)) == \
            plan_key(plan_batch(batch, net, hosts, objective="async", start=start, native=False))
    with pytest.raises(ValueError):
        order_updates(batch, net, start=-1.0, native=True)


def test_native_true_refuses_several_servers():
    net = NetState.star(4, 10 * MB)
    batch = Batch(src=(2, 3), sizes=np.full((2, 2), MB), servers=(0, 1))
    with pytest.raises(RuntimeError, match="one server"):
        order_updates(batch, net, native=True)
    assert order_updates(batch, net).order  # None: the Python path


# --------------------------------------------------------------------------- bad input


def _args():
    net = NetState([10 * MB] * 4, [10 * MB] * 4)
    ptr, times, rates = net.to_csr()
    src = np.array([1, 2, 3], dtype=np.int64)
    sizes = np.array([MB, 2 * MB, 3 * MB])
    return ptr, times, rates, src, sizes


def test_bad_input_to_order_raises():
    _sched = native._sched
    ptr, times, rates, src, sizes = _args()
    assert len(_sched.order(ptr, times, rates, src, sizes, 0, None, 0.0)) == 3
    with pytest.raises(TypeError):
        _sched.order(ptr.astype(np.int32), times, rates, src, sizes, 0, None, 0.0)
    with pytest.raises(TypeError):
        _sched.order(ptr, times.astype(np.float32), rates, src, sizes, 0, None, 0.0)
    with pytest.raises(TypeError):
        _sched.order(ptr, times, rates, [1, 2, 3], sizes, 0, None, 0.0)
    with pytest.raises(ValueError):  # link_ptr past the end of times
        _sched.order(ptr + 1, times, rates, src, sizes, 0, None, 0.0)
    with pytest.raises(ValueError):  # times and rates of different lengths
        _sched.order(ptr, times, rates[:-1], src, sizes, 0, None, 0.0)
    with pytest.raises(ValueError):  # an empty timeline
        bad = ptr.copy()
        bad[1] = 0
        _sched.order(bad, times, rates, src, sizes, 0, None, 0.0)
    with pytest.raises(ValueError):  # a negative rate
        _sched.order(ptr, times, -rates, src, sizes, 0, None, 0.0)
    with pytest.raises(ValueError):  # a source that is not a host
        _sched.order(ptr, times, rates, np.array([1, 2, 9], dtype=np.int64), sizes, 0, None, 0.0)
    with pytest.raises(ValueError):
        _sched.order(ptr, times, rates, src, sizes, 7, None, 0.0)
    with pytest.raises(ValueError):
        _sched.order(ptr, times, rates, src, sizes[:2], 0, None, 0.0)
    with pytest.raises(ValueError):
        _sched.order(ptr, times, rates, src, np.array([MB, np.nan, MB]), 0, None, 0.0)
    with pytest.raises(ValueError):
        _sched.order(ptr, times, rates, src, sizes, 0, np.array([1, 2], dtype=np.int64), 0.0)
    with pytest.raises(ValueError):  # start before the origin
        _sched.order(ptr, times, rates, src, sizes, 0, None, -1.0)
    with pytest.raises(ValueError):  # repeated index in a list
        _sched.order_list(ptr, times, rates, src, sizes, 0, np.array([0, 0], dtype=np.int64), 0.0)
    with pytest.raises(ValueError):
        _sched.order_list(ptr, times, rates, src, sizes, 0, np.array([3], dtype=np.int64), 0.0)


def test_bad_input_to_aggregate_raises():
    _sched = native._sched
    ptr, times, rates, src, sizes = _args()
    order = np.array([0, 1, 2], dtype=np.int64)
    ends = np.array([0.1, 0.3, 0.6])
    pptr = np.array([0, 1, 2, 3], dtype=np.int64)
    pt = np.array([0.0, 0.1, 0.3])
    pr = np.full(3, 10 * MB)
    hosts = np.array([1], dtype=np.int64)
    out = _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr, pt, pr, hosts, False, 0.0)
    assert out[0] in (0, 1, 2, 3)
    with pytest.raises(ValueError):  # an aggregator on the server
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr, pt, pr, np.array([0], dtype=np.int64),
                         False, 0.0)
    with pytest.raises(ValueError):  # repeated aggregators
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr, pt, pr, np.array([1, 1], dtype=np.int64),
                         False, 0.0)
    with pytest.raises(ValueError):  # profile pointers past the profile
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr + 1, pt, pr, hosts, False, 0.0)
    with pytest.raises(ValueError):  # profile pointers of the wrong length
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr[:-1], pt, pr, hosts, False, 0.0)
    with pytest.raises(ValueError):  # an index out of the batch
        _sched.aggregate(ptr, times, rates, src, sizes, 0, np.array([0, 1, 5], dtype=np.int64), ends, pptr, pt, pr,
                         hosts, False, 0.0)
    with pytest.raises(ValueError):  # an infinite end
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, np.array([0.1, np.inf, 0.6]), pptr, pt, pr, hosts,
                         False, 0.0)
    with pytest.raises(ValueError):
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr, pt, pr[:2], hosts, False, 0.0)
    with pytest.raises(TypeError):
        _sched.aggregate(ptr, times, rates, src, sizes, 0, order, ends, pptr, pt, pr, hosts.astype(float), False, 0.0)
