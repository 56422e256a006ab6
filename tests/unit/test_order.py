"""TicTac's pure core (mlfabric/order): the paper's worked examples (Fig. 2, Fig. 4, eq. 5),
Alg. 1 properties, TAO and TIO, the simulator, E and S, traces; property tests on random DAGs.

    .venv/bin/python -m pytest tests/unit/test_order.py -q
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.order import (Dag, TimeOracle, Trace, before, bounds, dag_from_edges, efficiency, evaluate, exhaustive,
                            johnson_before, makespan, priorities_from_order, simulate, speedup, tao, tio, to_chrome,
                            trace_efficiency, update_properties)
from mlfabric.order.heuristics import _pick

PROPS = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------- hand-made DAGs
def fig2(t1: float = 1.0, t2: float = 1.0, c1: float = 1.0, c2: float = 1.0) -> Dag:
    """Fig. 2a: op1 needs recv1; op2 needs op1 and recv2."""
    return dag_from_edges({"recv1": t1, "recv2": t2}, [("op1", ["recv1"], c1), ("op2", ["op1", "recv2"], c2)])


def fig4(ta: float = 1.0, tb: float = 1.0, tc: float = 1.0, td: float = 1.0) -> Dag:
    """Fig. 4 (Case 2), reconstructed from the text: op1 needs A and B, op2 op1 and C, op3 op2 and D,
    so no recv alone unblocks anything (all P = 0) and M+ must break the tie."""
    return dag_from_edges({"A": ta, "B": tb, "C": tc, "D": td},
                          [("op1", ["A", "B"], 1.0), ("op2", ["op1", "C"], 1.0), ("op3", ["op2", "D"], 1.0)])


def fig4a(ma: float, pa: float, mb: float, pb: float) -> Dag:
    """Fig. 4a (Case 1): two independent recvs, each the only input of one op."""
    return dag_from_edges({"A": ma, "B": mb}, [("opA", ["A"], pa), ("opB", ["B"], pb)])


def par(n: int, t: float = 1.0, c: float = 1.0) -> Dag:
    return dag_from_edges({f"w{i}": t for i in range(n)},
                          [*((f"b{i}", [f"w{i}"], c) for i in range(n)), ("join", [f"b{i}" for i in range(n)], c)])


def seq(n: int, t: float = 1.0, c: float = 1.0) -> Dag:
    comps = [(f"l{i}", [f"w{i}"] + ([f"l{i - 1}"] if i else []), c) for i in range(n)]
    return dag_from_edges({f"w{i}": t for i in range(n)}, comps)


@st.composite
def random_dags(draw, max_recvs: int = 5, max_computes: int = 8) -> Dag:
    """Random DAGs: recvs with integer transfer times, computes on 1-3 earlier nodes."""
    nr = draw(st.integers(1, max_recvs))
    nc = draw(st.integers(1, max_computes))
    dag = Dag()
    for i in range(nr):
        dag.add_recv(f"r{i}", cost=draw(st.integers(1, 5)))
    names = list(dag.names)
    for j in range(nc):
        ins = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        dag.add_compute(f"c{j}", ins, cost=draw(st.integers(0, 4)))
        names.append(f"c{j}")
    return dag


# --------------------------------------------------------------------------- Dag structure
def test_dag_rejects_forward_references_and_recv_inputs():
    d = Dag()
    d.add_recv("r")
    with pytest.raises(ValueError, match="not in the DAG yet"):
        d.add_compute("c", ["x"])
    with pytest.raises(ValueError, match="duplicate"):
        d.add_recv("r")
    d.add_compute("c", ["r", "r"])
    assert d.node("c").inputs == ("r",)
    assert d.succs("r") == ("c",)


def test_comm_deps_fig2():
    deps = fig2().comm_deps()
    assert deps["op1"] == {"recv1"}
    assert deps["op2"] == {"recv1", "recv2"}  # §4.1's example
    assert deps["recv2"] == {"recv2"}


# --------------------------------------------------------------------------- Fig. 2
def test_fig2_properties_match_the_text():
    d = fig2(t1=2.0, t2=3.0, c1=5.0, c2=7.0)
    p = update_properties(d, TimeOracle.from_costs(d), d.recvs)
    assert p.M["op1"] == 2.0 and p.M["op2"] == 5.0  # op1.M = Time(recv1), op2.M = Time(recv1) + Time(recv2)
    assert p.P == {"recv1": 5.0, "recv2": 0.0}  # recv1.P = Time(op1), recv2.P = 0
    assert p.M_plus == {"recv1": 5.0, "recv2": 5.0}  # read1.M+ = read2.M+ = Cost(read1) + Cost(read2)
    single = update_properties(d, TimeOracle.from_costs(d), d.recvs, mplus="single")
    assert single.M_plus == {"recv1": 2.0, "recv2": 5.0}


def test_fig2_good_and_bad_orders():
    d = fig2()
    o = TimeOracle.from_costs(d)
    good = simulate(d, o, ["recv1", "recv2"])
    bad = simulate(d, o, ["recv2", "recv1"])
    assert good.makespan == 3.0 and bad.makespan == 4.0  # Fig. 2b vs 2c
    assert dict((n, (s, e)) for n, s, e in good.compute) == {"op1": (1.0, 2.0), "op2": (2.0, 3.0)}
    assert tao(d, o).order() == ("recv1", "recv2")
    assert tao(d, o).priority == {"recv1": 0, "recv2": 1}
    # TIO under the general oracle: the paper's Alg. 1 ties them (equal M+) ...
    assert tio(d).priority == {"recv1": 0, "recv2": 0}
    # ... the "single" M+ rule separates them the right way.
    assert tio(d, mplus="single").priority == {"recv1": 0, "recv2": 1}
    b = bounds(d, o)
    assert (b.lower, b.upper) == (2.0, 4.0)
    assert efficiency(b, good.makespan) == 0.5 and efficiency(b, bad.makespan) == 0.0
    ex = exhaustive(d, o)
    assert ex.best == 3.0 and ex.worst == 4.0 and ex.best_orders == (("recv1", "recv2"),)


# --------------------------------------------------------------------------- Fig. 4 and eq. 5
def test_fig4_case2_mplus_breaks_the_tie():
    d = fig4(ta=1.0, tb=2.0, tc=1.5, td=1.0)
    o = TimeOracle.from_costs(d)
    p = update_properties(d, o, d.recvs)
    assert all(p.P[r] == 0.0 for r in d.recvs)  # "when all recv ops are outstanding, their P is 0"
    assert p.M_plus["A"] == p.M_plus["B"] == 3.0 < p.M_plus["C"] == 4.5 < p.M_plus["D"] == 5.5
    assert tao(d, o).order()[:2] in (("A", "B"), ("B", "A"))
    assert tao(d, o).order()[2:] == ("C", "D")
    assert tio(d).priority == {"A": 0, "B": 0, "C": 2, "D": 3}  # A and B share a priority
    ex = exhaustive(d, o)
    assert makespan(d, o, tao(d, o)) == ex.best
    assert makespan(d, o, tio(d)) == ex.best


def test_fig4a_eq5_printed_instance():
    # M_A=1, P_A=4, M_B=3, P_B=2: A first gives 1 + max(4, 3) + 2 = 7, B first 3 + max(2, 1) + 4 = 9.
    d = fig4a(1.0, 4.0, 3.0, 2.0)
    o = TimeOracle.from_costs(d)
    p = update_properties(d, o, d.recvs)
    assert (p.M["A"], p.P["A"], p.M["B"], p.P["B"]) == (1.0, 4.0, 3.0, 2.0)
    assert before("A", "B", p) and not before("B", "A", p)
    assert makespan(d, o, ["A", "B"]) == 7.0 and makespan(d, o, ["B", "A"]) == 9.0
    # Alg. 2 as printed (min(P_A, M_B) < min(P_B, M_A)) would say B first: eq. 5 is what is implemented.
    assert not (min(p.P["A"], p.M["B"]) < min(p.P["B"], p.M["A"]))


@PROPS
@given(st.integers(1, 9), st.integers(0, 9), st.integers(1, 9), st.integers(0, 9))
def test_eq5_agrees_with_the_simulated_makespans(ma, pa, mb, pb):
    d = fig4a(ma, pa, mb, pb)
    o = TimeOracle.from_costs(d)
    ab, ba = makespan(d, o, ["A", "B"]), makespan(d, o, ["B", "A"])
    assert ab == ma + max(pa, mb) + pb and ba == mb + max(pb, ma) + pa  # Case 1's formula
    j = johnson_before("A", "B", update_properties(d, o, d.recvs))
    assert j is (True if ab < ba else False if ba < ab else None)


# --------------------------------------------------------------------------- comparator properties
@PROPS
@given(random_dags(), st.data())
def test_eq5_strict_order_is_transitive_and_tao_picks_a_minimum(dag, data):
    o = TimeOracle.from_costs(dag)
    R = data.draw(st.lists(st.sampled_from(dag.recvs), min_size=1, unique=True))
    p = update_properties(dag, o, R)
    for a in R:
        assert johnson_before(a, a, p) is None  # irreflexive
    for a, b, c in itertools.permutations(R, 3):
        if johnson_before(a, b, p) and johnson_before(b, c, p):
            assert johnson_before(a, c, p) is True
    for a, b in itertools.permutations(R, 2):
        assert not (johnson_before(a, b, p) and johnson_before(b, a, p))  # antisymmetric
    pick = _pick(list(R), p)
    assert not any(johnson_before(b, pick, p) for b in R if b != pick)  # nothing strictly precedes it
    minimal = [a for a in R if not any(johnson_before(b, a, p) for b in R if b != a)]
    assert p.M_plus[pick] == min(p.M_plus[a] for a in minimal)


def test_paper_comparator_with_mplus_ties_is_not_transitive():
    # Found by a random search; the paper says the Comparator is "easy to prove ... transitive".
    d = dag_from_edges({"r0": 1, "r1": 4, "r2": 3, "r3": 1, "r4": 4},
                       [("c0", ["r1", "r4", "r0"], 1), ("c1", ["r0"], 1), ("c2", ["r2", "r1"], 2),
                        ("c3", ["c0"], 0), ("c4", ["r4"], 1), ("c5", ["c0"], 2), ("c6", ["r3"], 1)])
    p = update_properties(d, TimeOracle.from_costs(d), ["r0", "r2", "r3", "r4"])
    assert (p.M["r0"], p.P["r0"], p.M_plus["r0"]) == (1.0, 1.0, 5.0)
    assert (p.M["r2"], p.P["r2"], p.M_plus["r2"]) == (3.0, 2.0, math.inf)
    assert (p.M["r4"], p.P["r4"], p.M_plus["r4"]) == (4.0, 1.0, 5.0)
    assert before("r0", "r2", p) and before("r2", "r4", p)  # tie -> M+, then strict eq. 5
    assert not before("r0", "r4", p)  # eq. 5 tie and equal M+: transitivity fails


# --------------------------------------------------------------------------- TIO
@PROPS
@given(random_dags(max_recvs=6))
def test_tio_order_is_the_mplus_order(dag):
    for rule in ("paper", "single"):
        mp = update_properties(dag, TimeOracle.general(dag), dag.recvs, mplus=rule).M_plus
        pr = tio(dag, mplus=rule)
        for a, b in itertools.permutations(dag.recvs, 2):
            assert (pr.priority[a] < pr.priority[b]) == (mp[a] < mp[b])
            assert (pr.priority[a] == pr.priority[b]) == (mp[a] == mp[b])
        # §5 normalisation: a priority is the number of recvs strictly before it.
        for r in dag.recvs:
            assert pr.priority[r] == sum(1 for q in dag.recvs if mp[q] < mp[r])


def test_tao_and_tio_are_deterministic_and_complete():
    d = fig4(1.0, 2.0, 3.0, 4.0)
    o = TimeOracle.from_costs(d)
    assert tao(d, o) == tao(d, o) and tio(d) == tio(d)
    assert sorted(tao(d, o).priority.values()) == [0, 1, 2, 3]
    assert set(tio(d).order()) == set(d.recvs)


# --------------------------------------------------------------------------- Par-n / Seq-n
def test_par32_every_order_has_the_same_makespan():
    d = par(32)
    o = TimeOracle.from_costs(d)
    rng = random.Random(0)
    spans = {makespan(d, o, tao(d, o)), makespan(d, o, tio(d)), makespan(d, o, list(reversed(d.recvs)))}
    for _ in range(30):
        order = list(d.recvs)
        rng.shuffle(order)
        spans.add(makespan(d, o, order))
    assert spans == {34.0}  # 32 transfers, the last branch, the join
    ex = exhaustive(par(6), TimeOracle.from_costs(par(6)))
    assert ex.best == ex.worst == 8.0 and len(ex.best_orders) == math.factorial(6)


def test_seq_has_exactly_one_best_order():
    d6 = seq(6)
    ex = exhaustive(d6, TimeOracle.from_costs(d6))
    assert ex.best_orders == (tuple(f"w{i}" for i in range(6)),) and ex.best == 7.0 and ex.worst > ex.best
    d = seq(32)
    o = TimeOracle.from_costs(d)
    best = list(d.recvs)
    assert makespan(d, o, best) == 33.0
    for i in range(31):  # every adjacent swap of the best order is strictly worse
        sw = best[:i] + [best[i + 1], best[i]] + best[i + 2:]
        assert makespan(d, o, sw) > 33.0
    assert tao(d, o).order() == tuple(best)
    assert tio(d, mplus="single").order() == tuple(best)
    assert len(tio(d, mplus="single").classes()) == 32
    # The paper's M+ rule: l0 depends on w0 alone, so w0 and w1 first meet in l1 and tie.
    assert tio(d).classes()[0] == ("w0", "w1") and tio(d).classes()[1:] == [(f"w{i}",) for i in range(2, 32)]


# --------------------------------------------------------------------------- bounds, E, S
def test_efficiency_is_one_at_the_lower_bound_and_zero_at_the_upper():
    # Best case reachable: a compute op with no recv input overlaps the whole transfer.
    d = dag_from_edges({"r": 2.0}, [("a", [], 2.0), ("b", ["r"], 0.0)])
    o = TimeOracle.from_costs(d)
    ev = evaluate(d, o, ["r"])
    assert ev.makespan == ev.bounds.lower == 2.0 and ev.efficiency == 1.0 and ev.speedup == 1.0
    # Worst case forced: every op needs every recv, nothing overlaps.
    w = dag_from_edges({"r1": 1.0, "r2": 2.0}, [("a", ["r1", "r2"], 1.0), ("b", ["a"], 2.0)])
    ow = TimeOracle.from_costs(w)
    for order in (["r1", "r2"], ["r2", "r1"]):
        ev = evaluate(w, ow, order)
        assert ev.makespan == ev.bounds.upper == 6.0 and ev.efficiency == 0.0
    assert speedup(bounds(w, ow)) == (6.0 - 3.0) / 3.0


@PROPS
@given(random_dags(max_recvs=6), st.randoms(use_true_random=False))
def test_makespan_within_bounds_and_simulation_respects_dependencies(dag, rnd):
    o = TimeOracle.from_costs(dag)
    order = list(dag.recvs)
    rnd.shuffle(order)
    tr = simulate(dag, o, order)
    b = bounds(dag, o)
    assert b.lower - 1e-9 <= tr.makespan <= b.upper + 1e-9
    end = {n: e for n, _, e in (*tr.compute, *tr.transfers)}
    start = {n: s for n, s, _ in (*tr.compute, *tr.transfers)}
    for src, dst in dag.edges():
        assert start[dst] >= end[src] - 1e-9
    spans = sorted((s, e) for _, s, e in tr.compute)  # one compute resource: no overlap
    assert all(a[1] <= b_[0] + 1e-9 for a, b_ in zip(spans, spans[1:]))
    assert tr.transfer_order() == tuple(order) or any(o(r) == 0 for r in order)
    if b.upper > b.lower:
        assert -1e-9 <= efficiency(b, tr.makespan) <= 1 + 1e-9


def test_tao_reaches_the_exhaustive_best_on_small_dags():
    # Not a theorem (TAO is a heuristic); these instances are checked against all 5! or 4! orders.
    cases = [fig2(2, 1, 3, 1), fig4(1, 2, 3, 4), seq(5), par(5),
             dag_from_edges({"a": 3, "b": 1, "c": 2, "d": 1},
                            [("x", ["a"], 4), ("y", ["b", "c"], 2), ("z", ["x", "y", "d"], 1)])]
    for d in cases:
        o = TimeOracle.from_costs(d)
        assert makespan(d, o, tao(d, o)) == exhaustive(d, o).best


# --------------------------------------------------------------------------- traces
def test_trace_efficiency_and_chrome_export(tmp_path):
    perfect = Trace.of([("op", 0.0, 2.0)], [("r", 0.0, 2.0)])
    serial = Trace.of([("op", 2.0, 4.0)], [("r", 0.0, 2.0)])
    assert trace_efficiency(perfect) == 1.0 and trace_efficiency(serial) == 0.0
    d = fig2()
    tr = simulate(d, TimeOracle.from_costs(d), priorities_from_order(d, ["recv2", "recv1"]))
    doc = to_chrome(tr)
    json.dumps(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {(e["name"], e["tid"], e["ts"], e["dur"]) for e in xs} == {
        ("recv2", 1, 0.0, 1e6), ("recv1", 1, 1e6, 1e6), ("op1", 0, 2e6, 1e6), ("op2", 0, 3e6, 1e6)}
    assert trace_efficiency(tr) == 0.0
    with pytest.raises(ValueError, match="ends"):
        Trace.of([("x", 1.0, 0.0)], [])
