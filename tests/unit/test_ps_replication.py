"""MLfabric's replication step (§5.3): frozen prefix, punting, delaying the server's last
update, the divergence bound at T_last.

    .venv/bin/python -m pytest tests/unit/test_ps_replication.py -q
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.ps.divergence import DivergenceBound
from mlfabric.ps.scheduler import NetState
from mlfabric.ps.scheduler.replication import ReplicaUnit, plan_replication

SERVER, REPLICA = 0, 1  # hosts; workers from 2 on


def _units(n: int, *, first_key: int = 0, norm: float = 1.0) -> list[ReplicaUnit]:
    return [ReplicaUnit(key=first_key + i, members=((2 + i, 100.0),), norm=norm) for i in range(n)]


def _plan(units: list[ReplicaUnit], commits: list[float], bound: DivergenceBound, *, punted=(), rate=100.0,
          aggregators=(6,), momentum=0.0, history=0.0):  # noqa: ANN001, ANN202
    net = NetState.star(8, rate, origin=0.0)
    return plan_replication(net, units=units, punted=list(punted), server_commit=commits, replica=REPLICA,
                            aggregators=list(aggregators), bound=bound, momentum=momentum, history_norm=history,
                            start=0.0)


def test_a_loose_bound_freezes_what_arrives_by_t_last_and_punts_the_rest() -> None:
    # 3 units of 100 B into the replica's 100 B/s down-link: they commit there at 1, 2, 3 s;
    # the server's last commit is at 2 s: two are frozen, the third punted; no delay.
    plan = _plan(_units(3), [1.0, 1.5, 2.0], DivergenceBound(updates=5))
    assert plan.frozen == (0, 1) and [u.key for u in plan.punted] == [2]
    assert plan.replica_commit == {0: pytest.approx(1.0), 1: pytest.approx(2.0)}
    assert plan.delay_last_until is None and plan.lead_norms == (1.0,) and not plan.violated


def test_a_tight_bound_delays_the_servers_last_update_until_the_replica_caught_up() -> None:
    # Div_max = 1 update: at T_last = 1 s the replica has 1 of 3 (lead 2): the server's last
    # update waits for the replica's second commit (2 s); the lead is then 1.
    plan = _plan(_units(3), [0.5, 0.8, 1.0], DivergenceBound(updates=1))
    assert plan.frozen == (0, 1) and plan.delay_last_until == pytest.approx(2.0)
    assert plan.lead_norms == (1.0,) and plan.estimate == 1.0 and not plan.violated


def test_punted_units_go_first_and_the_norm_bound_uses_eq_11() -> None:
    carried = _units(1, first_key=10, norm=2.0)
    # norm bound 2.5, momentum 0: the lead's norms just add up
    plan = _plan(_units(2), [0.5, 1.0], DivergenceBound(norm=2.5), punted=carried)
    assert plan.frozen[0] == 10  # the replica applies the server's order: the punted unit first
    assert plan.estimate <= 2.5 and not plan.violated
    too_big = _plan(_units(2, norm=3.0), [0.5, 1.0], DivergenceBound(norm=2.5))
    assert too_big.violated and too_big.estimate == pytest.approx(3.0)  # one update alone is over Div_max


def test_an_aggregated_unit_goes_through_a_replica_aggregator() -> None:
    unit = ReplicaUnit(key=0, members=((2, 100.0), (3, 100.0)), norm=1.0)
    plan = _plan([unit], [1.0], DivergenceBound(updates=1), aggregators=(6,))
    # 2 s to the aggregator (two members share its down-link), 3 s at the replica > T_last = 1 s
    assert plan.frozen == () and plan.punted[0].key == 0 and plan.delay_last_until is None
    loose = _plan([unit], [5.0], DivergenceBound(updates=1))
    trs = loose.transfers[0]
    assert [t.dst for t in trs] == [6, 6, REPLICA] and trs[-1].start == pytest.approx(2.0)
    assert loose.replica_commit[0] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs aggregators"):
        _plan([unit], [1.0], DivergenceBound(updates=1), aggregators=())


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 8), punt=st.integers(0, 3), lag=st.integers(1, 4), seed=st.integers(0, 1000),
       momentum=st.sampled_from([0.0, 0.5, 0.9]))
def test_properties(n: int, punt: int, lag: int, seed: int, momentum: float) -> None:
    """Frozen is a prefix of punted + batch units; unless violated, the lead at the (possibly
    delayed) last commit is within the bound; the caller's network state is untouched."""
    import random

    rng = random.Random(seed)
    units = [ReplicaUnit(key=i, members=((2 + i % 5, rng.uniform(10, 200)),), norm=rng.uniform(0, 2))
             for i in range(n)]
    carried = [ReplicaUnit(key=100 + i, members=((2, 50.0),), norm=1.0) for i in range(punt)]
    commits = sorted(rng.uniform(0.1, 3.0) for _ in range(n))
    bound = DivergenceBound(updates=lag) if seed % 2 else DivergenceBound(norm=lag * 1.5)
    net = NetState.star(8, 100.0, origin=0.0)
    before = [list(t) for t in net.times]
    plan = plan_replication(net, units=units, punted=carried, server_commit=commits, replica=REPLICA,
                            aggregators=[6], bound=bound, momentum=momentum, history_norm=0.5, start=0.0)
    order = [u.key for u in carried + units]
    assert list(plan.frozen) + [u.key for u in plan.punted] == order
    if not plan.violated:
        limit = bound.updates if bound.updates is not None else bound.norm
        assert plan.estimate <= limit + 1e-9
    assert [list(t) for t in net.times] == before
