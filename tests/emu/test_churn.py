"""Bandwidth churn: the pure schedule, its trace file, and a run on a real cluster (root).

    sudo .venv/bin/python -m pytest tests/emu/test_churn.py -q
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from mlfabric.emu.churn import CHURN_MODELS, ChurnRunner, churn_model, churn_schedule
from mlfabric.emu.cluster import Cluster, new_prefix, plan_cluster
from mlfabric.topo.racks import star
from mlfabric.topo.trace import load_capacity_trace
from tests.emu.conftest import needs_root


def test_models_are_the_papers_scaled():
    assert CHURN_MODELS["N1"].rates(10e9) == pytest.approx((5e9, 10e9))
    assert CHURN_MODELS["N2"].rates(100e6) == pytest.approx((25e6, 33e6, 50e6, 100e6))
    assert CHURN_MODELS["N2"].probabilities == (0.1, 0.1, 0.1, 0.7)
    assert CHURN_MODELS["N3"].rates(1e9) == pytest.approx((1e8, 1e9))
    custom = churn_model("1G:0.25, 4G:0.75")
    assert custom.fractions == (0.25, 1.0) and custom.probabilities == (0.25, 0.75)
    with pytest.raises(ValueError, match="sum to 1"):
        churn_model("1G:0.5,2G:0.6")


def take(schedule, n):
    return [next(schedule) for _ in range(n)]


def test_schedule_is_seeded_periodic_and_distributed_as_asked():
    kw = dict(n_hosts=4, nics_per_host=2, base_rate_bps=1e9, period_s=5.0)
    a = take(churn_schedule(CHURN_MODELS["N2"], seed=1, **kw), 400)
    b = take(churn_schedule(CHURN_MODELS["N2"], seed=1, **kw), 10)
    assert a[:10] == b
    assert a != take(churn_schedule(CHURN_MODELS["N2"], seed=2, **kw), 400)
    assert [t for t, _ in a[:3]] == [0.0, 5.0, 10.0]
    rows = a[0][1]
    assert len(rows) == 16 and [(r.host, r.nic, r.direction) for r in rows[:3]] == [
        (0, 0, "egress"), (0, 0, "ingress"), (0, 1, "egress")]
    rates = np.array([r.rate_bps for _, rows in a for r in rows])
    for rate, p in zip(CHURN_MODELS["N2"].rates(1e9), CHURN_MODELS["N2"].probabilities):
        assert np.mean(np.isclose(rates, rate)) == pytest.approx(p, abs=0.02)


class _FakeCluster:
    def __init__(self):
        self.calls = []

    def set_rates(self, changes):
        self.calls.append(list(changes))


def test_runner_writes_a_trace_the_simulator_loads(tmp_path):
    fake = _FakeCluster()
    path = tmp_path / "trace.csv"
    runner = ChurnRunner(cluster=fake, model=CHURN_MODELS["N3"], n_hosts=3, nics_per_host=1,
                         base_rate_bps=100e6, period_s=0.05, seed=4, trace_path=path).start()
    while len(runner.applied) < 4:
        time.sleep(0.01)
    runner.stop()
    trace = load_capacity_trace(path, star(3, 100e6))
    steps = len(runner.applied)
    assert len(trace) == 6 * steps == sum(len(c) for c in fake.calls)
    expected = [row for _, rows in take(churn_schedule(CHURN_MODELS["N3"], n_hosts=3, nics_per_host=1,
                                                       base_rate_bps=100e6, period_s=0.05, seed=4), steps)
                for row in rows]
    assert np.allclose(trace.times, [r.time_s for r in expected])
    assert np.allclose(trace.rates, [r.rate_bps for r in expected])
    # host 1 egress is link 1, host 1 ingress is link n + 1 in star(3)
    assert trace.link_ids[2] == 1 and trace.link_ids[3] == 4


@needs_root
def test_churn_on_a_cluster_matches_its_trace(tmp_path, no_leaks):
    plan = plan_cluster("bcube:n=2,k=2", 100e6, prefix=new_prefix())
    readback: list[tuple[float, dict]] = []
    with Cluster.create(plan) as cluster:

        def check(t, rows):
            readback.append((t, {(r.host, r.nic, r.direction): cluster.read_rate(r.host, r.nic, r.direction)
                                 for r in rows}))

        runner = ChurnRunner(cluster=cluster, model=CHURN_MODELS["N2"], n_hosts=plan.n_hosts, nics_per_host=2,
                             base_rate_bps=100e6, period_s=0.3, seed=9, trace_path=tmp_path / "t.csv",
                             on_apply=check).start()
        while len(runner.applied) < 4:
            time.sleep(0.01)
        runner.stop()
    from mlfabric.topo.trace import _rows_from_csv

    rows = _rows_from_csv(tmp_path / "t.csv")
    assert len(rows) == 16 * len(readback)
    for row in rows:
        applied = dict(readback)[row.time_s][(row.host, row.nic, row.direction)]
        assert applied == pytest.approx(row.rate_bps, rel=1e-3), row
    assert max(lag for _, lag, _ in runner.applied) < 0.25
    assert len({row.rate_bps for row in rows}) > 1
