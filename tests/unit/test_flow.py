"""Max-min fair sharing: textbook answers, fast == naive, certificates, incremental updates.

    .venv/bin/python -m pytest tests/unit/test_flow.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.flow import (
    BenchmarkConfig,
    CertificateError,
    FlowNetwork,
    Incidence,
    benchmark_solver,
    check_certificate,
    format_benchmark,
    naive_max_min,
    solve_max_min,
    solve_max_min_with_stats,
)
from mlfabric.flow import network as flow_network_module
from mlfabric.topo import fat_tree

METHODS = ("auto", "rounds", "events")
INF = math.inf


def solve_all(incidence: Incidence, capacity: list[float] | np.ndarray, caps: list[float] | None = None) -> np.ndarray:
    """Solve with every method and the naive solver; they must agree; return the fast result."""
    results = [solve_max_min(incidence, capacity, caps, method=method) for method in METHODS]
    naive = np.asarray(naive_max_min(incidence, capacity, caps))
    for rates in results:
        np.testing.assert_allclose(rates, naive, rtol=1e-9, atol=0)
    return results[0]


# ---------------------------------------------------------------------------- incidence


def test_incidence_constructors_agree() -> None:
    lists = Incidence.from_paths([[0, 2], [], [1]], 3)
    padded = Incidence.from_padded(np.array([[0, 2], [-1, -1], [1, -1]]), 3)
    assert np.array_equal(lists.indptr, padded.indptr) and np.array_equal(lists.links, padded.links)
    assert lists.lengths().tolist() == [2, 0, 1]
    assert lists.link_load(np.array([1.0, 5.0, 2.0])).tolist() == [1.0, 2.0, 1.0]
    sub = lists.subset([2, 0])
    assert sub.to_lists() == [[(1, 1.0)], [(0, 1.0), (2, 1.0)]]
    both = Incidence.concat([lists, sub])
    assert both.n_flows == 5 and both.to_lists()[3:] == sub.to_lists()
    weighted = Incidence.from_paths([[1, 1, 0]], 2, [[0.25, 0.25, 0.5]]).merge_duplicates()
    assert weighted.to_lists() == [[(0, 0.5), (1, 0.5)]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"indptr": [0, 2], "links": [0, 5], "weights": None, "n_links": 3}, "out of range"),
        ({"indptr": [0, 3], "links": [0, 1], "weights": None, "n_links": 3}, "ends at"),
        ({"indptr": [1, 2], "links": [0], "weights": None, "n_links": 3}, "starting at 0"),
        ({"indptr": [0, 1], "links": [0], "weights": [-1.0], "n_links": 3}, "non-negative"),
        ({"indptr": [0, 1], "links": [0.5], "weights": None, "n_links": 3}, "integers"),
    ],
)
def test_incidence_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Incidence(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- textbook instances


def test_three_flows_on_a_two_link_line() -> None:
    # Flow 0 crosses both links, flow 1 only link 0, flow 2 only link 1.
    line = Incidence.from_paths([[0, 1], [0], [1]], 2)
    assert solve_all(line, [1.0, 1.0]).tolist() == [0.5, 0.5, 0.5]
    # Link 1 twice as fast: flow 0 is held to 1/2 by link 0, flow 2 takes the rest of link 1.
    assert solve_all(line, [1.0, 2.0]).tolist() == [0.5, 0.5, 1.5]


def test_parking_lot() -> None:
    # One long flow over 3 links, one short flow per link; link 2 is slow.
    parking = Incidence.from_paths([[0, 1, 2], [0], [1], [2]], 3)
    rates = solve_all(parking, [10.0, 10.0, 2.0])
    assert rates.tolist() == [1.0, 9.0, 9.0, 1.0]


def test_bertsekas_gallager_example() -> None:
    # Capacities 1 on all links; flows: A over links 0-1-2, B over 0, C over 1, D over 1-2 (scaled).
    incidence = Incidence.from_paths([[0, 1, 2], [0], [1], [1, 2], [2]], 3)
    rates = solve_all(incidence, [1.0, 1.0, 1.0])
    # Link 1 has 3 flows -> 1/3 each for A, C, D; B gets 2/3 of link 0; E gets 1/3 of link 2.
    np.testing.assert_allclose(rates, [1 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3], rtol=1e-12)


def test_caps_zero_capacity_and_unconstrained_flows() -> None:
    incidence = Incidence.from_paths([[0], [0], [], [1], [], [2]], 3)
    caps = [0.2, INF, 3.0, INF, INF, INF]
    rates = solve_all(incidence, [1.0, 0.0, INF], caps)
    assert rates.tolist() == [0.2, 0.8, 3.0, 0.0, INF, INF]
    assert check_certificate(incidence, [1.0, 0.0, INF], rates, caps).ok


def test_spraying_weights_share_links_fractionally() -> None:
    # Flow 0 split in half over links 0 and 1; flow 1 alone on link 1.
    incidence = Incidence.from_paths([[0, 1], [1]], 2, [[0.5, 0.5], [1.0]])
    rates = solve_all(incidence, [1.0, 1.0])
    # Level t: link 0 saturates at 0.5 t = 1 -> t = 2; link 1 at 0.5 t + t = 1 -> t = 2/3 first.
    np.testing.assert_allclose(rates, [2 / 3, 2 / 3], rtol=1e-12)
    # Zero weights neither load nor constrain.
    zero = Incidence.from_paths([[0, 1]], 2, [[0.0, 1.0]])
    assert solve_all(zero, [0.0, 5.0]).tolist() == [5.0]


def test_ties_freeze_as_one_batch() -> None:
    # 20 links saturating at the same level: one round, one event.
    paths = [[link] for link in range(20) for _ in range(3)]
    incidence = Incidence.from_paths(paths, 20)
    for method in ("rounds", "events"):
        rates, stats = solve_max_min_with_stats(incidence, np.full(20, 3.0), method=method)
        assert (rates == 1.0).all()
        assert stats.rounds + stats.events == 1


def test_empty_and_degenerate_inputs() -> None:
    assert solve_max_min(Incidence.empty(3), [1.0, 1.0, 1.0]).size == 0
    with pytest.raises(ValueError, match="shape"):
        solve_max_min(Incidence.from_paths([[0]], 2), [1.0])
    with pytest.raises(ValueError, match="negative"):
        solve_max_min(Incidence.from_paths([[0]], 1), [-1.0])
    with pytest.raises(ValueError, match="cap of flow 0"):
        solve_max_min(Incidence.from_paths([[0]], 1), [1.0], [-1.0])
    with pytest.raises(ValueError, match="method"):
        solve_max_min(Incidence.from_paths([[0]], 1), [1.0], method="magic")


# ---------------------------------------------------------------------------- random instances


@st.composite
def instances(draw: st.DrawFn, max_links: int = 8, max_flows: int = 14) -> tuple[Incidence, list[float], list[float] | None]:
    n_links = draw(st.integers(1, max_links))
    n_flows = draw(st.integers(0, max_flows))
    weighted = draw(st.booleans())
    paths, weights = [], []
    for _ in range(n_flows):
        path = draw(st.lists(st.integers(0, n_links - 1), min_size=0, max_size=4, unique=True))
        paths.append(path)
        weights.append([draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) for _ in path])
    capacity = [draw(st.sampled_from([0.0, 1.0, 2.0, 3.0, 7.5, INF])) if draw(st.booleans()) else draw(st.floats(0.1, 100.0)) for _ in range(n_links)]
    caps = None
    if draw(st.booleans()):
        caps = [draw(st.sampled_from([INF, 0.5, 1.0, 2.5])) for _ in range(n_flows)]
    return Incidence.from_paths(paths, n_links, weights if weighted else None), capacity, caps


@settings(max_examples=300, deadline=None)
@given(instances())
def test_fast_solvers_equal_naive_and_certificate_holds(instance: tuple[Incidence, list[float], list[float] | None]) -> None:
    incidence, capacity, caps = instance
    rates = solve_all(incidence, capacity, caps)
    report = check_certificate(incidence, capacity, rates, caps)
    assert report.ok, report.summary()


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from(["ecmp", "spray"]), st.integers(1, 400), st.sampled_from([1.0, 2.0, 4.0]))
def test_certificate_holds_on_random_fat_tree_traffic(seed: int, routing: str, n_flows: int, oversub: float) -> None:
    topology = fat_tree(4, 10e9, oversub=oversub)
    rng = np.random.default_rng(seed)
    flows = rng.integers(0, topology.n_hosts, (n_flows, 2))
    incidence = topology.route_ecmp(flows, seed=seed) if routing == "ecmp" else topology.route_spray(flows)
    capacity = topology.capacity() * rng.choice([0.5, 1.0, 1.0, 2.0], topology.n_links)
    caps = np.where(rng.random(n_flows) < 0.2, rng.uniform(1e8, 5e9, n_flows), INF)
    rates = solve_max_min(incidence, capacity, caps)
    assert check_certificate(incidence, capacity, rates, caps).ok
    np.testing.assert_allclose(rates, naive_max_min(incidence, capacity, caps), rtol=1e-9)


def test_certificate_holds_on_a_250k_flow_six_hop_instance() -> None:
    topology = fat_tree(16, 10e9, oversub=4)
    rng = np.random.default_rng(42)
    src = rng.integers(0, 1024, 250_000)
    dst = (src + rng.integers(64, 1024 - 63, 250_000)) % 1024  # always another pod (64 hosts per pod)
    dst = np.where(dst // 64 == src // 64, (dst + 64) % 1024, dst)
    incidence = topology.route_ecmp(np.stack([src, dst], axis=1), seed=1)
    assert (incidence.lengths() == 6).all()
    rates, stats = solve_max_min_with_stats(incidence, topology.capacity())
    report = check_certificate(incidence, topology.capacity(), rates)
    assert report.ok, report.summary()
    assert stats.n_flows == 250_000 and rates.min() > 0
    # The oversubscribed ToR uplinks are the bottlenecks of (almost) everyone.
    layers = topology.link_layer[report.bottleneck_link[report.bottleneck_link >= 0]]
    tor = [topology.layer_names.index("edge-agg"), topology.layer_names.index("agg-edge")]
    assert np.isin(layers, tor).mean() > 0.9


# ---------------------------------------------------------------------------- certificate rejects wrong answers


def test_certificate_rejects_infeasible_allocation() -> None:
    incidence = Incidence.from_paths([[0, 1], [0], [1]], 2)
    rates = solve_max_min(incidence, [1.0, 1.0])
    report = check_certificate(incidence, [1.0, 1.0], rates * (1 + 1e-6))
    assert not report.ok
    assert report.overloaded_links.tolist() == [0, 1]
    assert report.max_relative_overload == pytest.approx(1e-6, rel=1e-3)
    with pytest.raises(CertificateError, match="overloaded"):
        report.raise_if_failed()
    # Within 1e-9 relative is accepted.
    assert check_certificate(incidence, [1.0, 1.0], rates * (1 + 1e-10)).ok


def test_certificate_rejects_feasible_but_unfair_allocations() -> None:
    one_link = Incidence.from_paths([[0], [0]], 1)
    # Saturated, but flow 1 is not the largest on its only link.
    report = check_certificate(one_link, [1.0], [0.7, 0.3])
    assert not report.ok and report.flows_without_bottleneck.tolist() == [1]
    assert report.overloaded_links.size == 0
    # Feasible but wasteful: nobody has a saturated link.
    report = check_certificate(one_link, [1.0], [0.4, 0.4])
    assert report.flows_without_bottleneck.tolist() == [0, 1]
    # Line network: give flow 2 less than its max-min rate 1.5.
    line = Incidence.from_paths([[0, 1], [0], [1]], 2)
    assert not check_certificate(line, [1.0, 2.0], [0.5, 0.5, 1.4]).ok
    # Shift rate from flow 0 to flow 1: still feasible, no longer max-min.
    report = check_certificate(line, [1.0, 2.0], [0.4, 0.6, 1.6])
    assert report.flows_without_bottleneck.tolist() == [0]


def test_certificate_rejects_invalid_rates_and_caps() -> None:
    incidence = Incidence.from_paths([[0], [], []], 1)
    assert not check_certificate(incidence, [1.0], [1.0, -1.0, INF]).ok
    assert check_certificate(incidence, [1.0], [1.0, -1.0, INF]).invalid_rate_flows.tolist() == [1]
    assert not check_certificate(incidence, [1.0], [math.nan, INF, INF]).ok
    # An unconstrained flow must be at inf; a capped one at its cap.
    assert not check_certificate(incidence, [1.0], [1.0, 5.0, INF]).ok
    assert check_certificate(incidence, [1.0], [1.0, 5.0, INF], [INF, 5.0, INF]).ok
    assert not check_certificate(incidence, [1.0], [1.0, 6.0, INF], [INF, 5.0, INF]).ok
    # An infinite rate on a finite link overloads it.
    assert not check_certificate(incidence, [1.0], [INF, INF, INF]).ok


def test_certificate_rejects_perturbed_large_solution() -> None:
    topology = fat_tree(8, 10e9, oversub=2)
    rng = np.random.default_rng(0)
    flows = rng.integers(0, topology.n_hosts, (5000, 2))
    flows = flows[flows[:, 0] != flows[:, 1]]
    incidence = topology.route_ecmp(flows, seed=0)
    capacity = topology.capacity()
    rates = solve_max_min(incidence, capacity)
    assert check_certificate(incidence, capacity, rates).ok
    for victim in (int(np.argmax(rates)), int(np.argmin(rates)), 17):
        lowered = rates.copy()
        lowered[victim] *= 0.99
        report = check_certificate(incidence, capacity, lowered)
        # The victim's bottleneck is no longer full; flows sharing it lose their proof too.
        assert victim in report.flows_without_bottleneck.tolist()
        assert report.overloaded_links.size == 0


# ---------------------------------------------------------------------------- FlowNetwork (incremental)


operations = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "capacity", "cap"]), st.integers(0, 2**31)),
    min_size=1,
    max_size=25,
)


# Both re-solve paths: the compiled kernel (mlfabric/flow/_fill.c) and numpy.
RESOLVE_PATHS = [False, True]


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 9), st.booleans(), operations, st.sampled_from(RESOLVE_PATHS))
def test_flow_network_matches_full_solve_after_any_change_sequence(
    n_links: int, weighted: bool, ops: list[tuple[str, int]], native: bool
) -> None:
    rng = np.random.default_rng(n_links)
    network = FlowNetwork(rng.choice([0.0, 1.0, 2.0, 3.0, INF], n_links, p=[0.05, 0.35, 0.3, 0.25, 0.05]), native=native)
    for op, seed in ops:
        r = np.random.default_rng(seed)
        if op == "add" or network.n_flows == 0:
            k = int(r.integers(1, 6))
            paths = [list(r.choice(n_links, size=int(r.integers(0, min(n_links, 4) + 1)), replace=False)) for _ in range(k)]
            weights = [list(r.choice([0.25, 0.5, 1.0], size=len(p))) for p in paths] if weighted else None
            caps = r.choice([INF, 0.5, 1.0], size=k) if r.random() < 0.3 else None
            network.add_flows(Incidence.from_paths(paths, n_links, weights), caps)
        elif op == "remove":
            ids = network.flow_ids()
            network.remove_flows(r.choice(ids, size=int(r.integers(1, ids.size + 1)), replace=False))
        elif op == "capacity":
            network.set_capacity(int(r.integers(0, n_links)), float(r.choice([0.0, 0.5, 1.0, 2.0, 4.0, INF])))
        else:
            network.set_caps(int(r.choice(network.flow_ids())), float(r.choice([INF, 0.3, 1.0, 2.0])))
        before = network.rates() if network.n_flows else np.zeros(0)
        ids = network.flow_ids()
        reference = solve_max_min(network.incidence(), network.capacity(), network.caps())
        np.testing.assert_allclose(before, reference, rtol=1e-9, atol=0)
        assert network.check().ok
        np.testing.assert_allclose(network.link_load(), network.incidence().link_load(np.where(np.isfinite(reference), reference, 0.0)), rtol=1e-9, atol=1e-12)
        assert ids.size == network.n_flows


def test_flow_network_resolves_only_flows_at_or_above_the_change() -> None:
    # Flows 0-9 each alone on a slow private link (rate 1); flows 10-13 share a fast link.
    paths = [[i] for i in range(10)] + [[10]] * 4
    capacity = [1.0] * 10 + [100.0]
    network = FlowNetwork(capacity)
    ids = network.add_flows(Incidence.from_paths(paths, 11))
    assert network.rates().tolist() == [1.0] * 10 + [25.0] * 4
    assert network.last_update.kind == "full"
    network.remove_flows(ids[10:11])
    rates = network.rates()
    assert network.last_update.kind == "partial"
    assert sorted(network.last_resolved.tolist()) == ids[11:].tolist()
    np.testing.assert_allclose(rates, [1.0] * 10 + [100 / 3] * 3)
    # Changing capacity of an unsaturated... no: link 10 is saturated; raising it re-solves its flows only.
    network.set_capacity(10, 150.0)
    np.testing.assert_allclose(network.rates(), [1.0] * 10 + [50.0] * 3)
    assert network.last_update.kind == "partial" and network.last_update.flows_resolved == 3
    # Lowering a link below its load re-solves from that level up.
    network.set_capacity(0, 0.5)
    np.testing.assert_allclose(network.rates()[:2], [0.5, 1.0])
    # Nothing changed: nothing re-solved.
    network.update()
    assert network.last_update.kind == "none" and network.last_resolved.size == 0


def test_native_kernel_is_built() -> None:
    # `make install` builds mlfabric/flow/_fill.c; without it the simulator's benchmarks
    # fall back to numpy (same results, several times slower).
    assert flow_network_module._fill is not None
    assert FlowNetwork([1.0]).native


@pytest.mark.parametrize("weighted", [False, True])
def test_native_and_numpy_resolves_agree_on_a_fat_tree_event_sequence(weighted: bool) -> None:
    """Three paths through the same 60 add/remove/capacity events of a k=8 fat-tree: numpy, the
    compiled kernel re-solving the whole suffix, and the kernel re-solving only what the change
    reaches. Same rates (1e-9), valid certificates, the same suffixes, a sorted rate order."""
    topology = fat_tree(8, 10.0, oversub=4)
    networks = [FlowNetwork(topology.capacity(), native=native, reach=reach)
                for native, reach in ((False, False), (True, False), (True, True))]
    rng = np.random.default_rng(3)
    reached = suffixes = reach_only = 0
    for step in range(60):
        seed = int(rng.integers(0, 2**31))
        pairs = np.random.default_rng(seed).integers(0, topology.n_hosts, (300, 2))
        incidence = topology.route_spray(pairs) if weighted else topology.route_ecmp(pairs, seed=seed)
        caps = np.where(np.random.default_rng(seed).random(300) < 0.1, 0.7, INF)
        for network in networks:
            if step % 4 == 0:
                network.add_flows(incidence, caps)
            elif step % 4 == 3:
                network.set_capacity(int(seed % topology.n_links), float(seed % 3) * 5.0)
            else:
                ids = network.flow_ids()
                network.remove_flows(np.random.default_rng(seed).choice(ids, size=ids.size // 5, replace=False))
        numpy_rates, suffix_rates, reach_rates = (network.rates() for network in networks)
        numpy_update, suffix_update, reach_update = (network.last_update for network in networks)
        assert (suffix_update.kind, suffix_update.flows_resolved) == (numpy_update.kind, numpy_update.flows_resolved)
        if reach_update.kind != numpy_update.kind:
            # With the reach, an update without new flows or a capacity change stays partial.
            assert (numpy_update.kind, reach_update.kind) == ("full", "partial") and step % 4 in (1, 2)
            reach_only += 1
        assert reach_update.flows_resolved <= numpy_update.flows_resolved
        if reach_update.kind == numpy_update.kind == "partial":
            reached += reach_update.flows_resolved
            suffixes += numpy_update.flows_resolved
        np.testing.assert_allclose(suffix_rates, numpy_rates, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(reach_rates, numpy_rates, rtol=1e-9, atol=1e-12)
        for network in networks[1:]:
            assert network.check().ok
            order = network._order_rates[: network._order_n]
            assert np.all(order[1:] >= order[:-1])
            np.testing.assert_allclose(network.link_load(), networks[0].link_load(), rtol=1e-9, atol=1e-9)
    assert reach_only > 0
    if not weighted:  # (sprayed flows fill the tree evenly: without the reach every update is full)
        # The reach re-solves markedly fewer flows than the suffix on this traffic.
        assert 0 < reached < 0.7 * suffixes, (reached, suffixes)


def test_native_resolve_puts_back_a_slack_link_that_would_overflow() -> None:
    # Link 1 (capacity 0.9) carries b (0.5, bottlenecked on link 0) and c (capped at 0.3): at
    # 0.8 it is below the slack threshold, so the re-solve after a's removal leaves it out;
    # b would then get all of link 0 (1.0) and overflow link 1, so the filling is redone with it.
    network = FlowNetwork([1.0, 0.9], native=True)
    a, b, c = network.add_flows(Incidence.from_paths([[0], [0, 1], [1]], 2), [INF, INF, 0.3])
    np.testing.assert_allclose(network.rates(), [0.5, 0.5, 0.3])
    network.remove_flows([a])
    np.testing.assert_allclose(network.rates([b, c]), [0.6, 0.3])
    assert network.last_update.kind == "partial" and network.last_update.slack_retries == 1
    assert network.check().ok
    # When the left-out link stays within capacity, no retry (ten slow flows on link 2 keep
    # the re-solve partial).
    network = FlowNetwork([1.0, 10.0, 1.0], native=True)
    a, b = network.add_flows(Incidence.from_paths([[0], [0, 1]], 3))
    network.add_flows(Incidence.from_paths([[2]] * 10, 3))
    network.rates()
    network.remove_flows([a])
    np.testing.assert_allclose(network.rates([b]), [1.0])
    assert network.last_update.kind == "partial" and network.last_update.slack_retries == 0
    assert network.last_update.flows_resolved == 1 and network.check().ok


def test_native_reach_matches_from_scratch_solves_on_random_fat_tree_sequences() -> None:
    """Random adds (ECMP and sprayed, some capped), removals, capacity and cap changes on k=4
    and k=8 fat-trees: after every update the reach's rates equal a from-scratch solve, the
    certificate holds and the rate order is sorted; the reach both holds and fails its check
    (and then grows: a fallback to the whole suffix is left to the deterministic tests)."""
    partial = grows = 0
    for seed in range(6):
        rng = np.random.default_rng(100 + seed)
        topology = fat_tree(4 if seed % 2 else 8, 10.0, oversub=float(rng.choice([1, 2, 4])))
        network = FlowNetwork(topology.capacity(), native=True)
        spray = seed == 5
        for _ in range(40):
            op = rng.choice(["add", "remove", "capacity", "cap"], p=[0.25, 0.6, 0.1, 0.05])
            if op == "add" or network.n_flows < 10:
                pairs = rng.integers(0, topology.n_hosts, (int(rng.integers(1, 150)), 2))
                pairs = pairs[pairs[:, 0] != pairs[:, 1]]
                if not pairs.size:
                    continue
                incidence = topology.route_spray(pairs) if spray else topology.route_ecmp(pairs, seed=int(rng.integers(1 << 30)))
                network.add_flows(incidence, np.where(rng.random(len(pairs)) < 0.05, 1.0, INF))
            elif op == "remove":
                ids = network.flow_ids()
                network.remove_flows(rng.choice(ids, size=min(ids.size, int(rng.integers(1, 20))), replace=False))
            elif op == "capacity":
                network.set_capacity(int(rng.integers(0, topology.n_links)), float(rng.choice([0.0, 5.0, 10.0, 20.0])))
            else:
                network.set_caps(int(rng.choice(network.flow_ids())), float(rng.choice([INF, 0.3, 1.0])))
            rates = network.rates()
            partial += network.last_update.kind == "partial"
            grows += network.last_update.reach_grows
            reference = solve_max_min(network.incidence(), network.capacity(), network.caps())
            np.testing.assert_allclose(rates, reference, rtol=1e-9, atol=1e-12)
            assert network.check().ok
            order = network._order_rates[: network._order_n]
            assert np.all(order[1:] >= order[:-1])
    assert partial > 40 and grows > 0, (partial, grows)


@pytest.mark.parametrize("layout", ["apart", "ahead", "behind"])
def test_native_resolve_output_in_place_apart_or_overlapping_alike(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writes the new rate-order suffix over its input (FlowNetwork's case), to
    other memory, or to memory overlapping the input (a few entries ahead or behind): the same
    rates and order."""

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        # Mostly removals of a few flows from hundreds: partial updates whose changed region
        # leaves unchanged candidates on both sides (what the overlap cases need).
        rng = np.random.default_rng(7)
        topology = fat_tree(8, 10.0, oversub=2.0)
        network = FlowNetwork(topology.capacity(), native=True)
        states = []
        for step in range(300):
            if step % 20 == 0 or network.n_flows < 10:
                pairs = rng.integers(0, topology.n_hosts, (int(rng.integers(50, 300)), 2))
                pairs = pairs[pairs[:, 0] != pairs[:, 1]]
                network.add_flows(topology.route_ecmp(pairs, seed=step))
            else:
                ids = network.flow_ids()
                network.remove_flows(rng.choice(ids, size=min(ids.size, int(rng.integers(1, 4))), replace=False))
            rates = network.rates()
            states.append((rates, network._order[: network._order_n].copy()))
        return states

    reference = run()
    real = flow_network_module._fill.resolve

    def relocated(*args: object) -> tuple:
        args = list(args)
        ids, id_rates, out_ids, out_rates = args[0], args[1], args[16], args[17]
        n = ids.size
        if layout == "apart":
            new_ids, new_rates = np.zeros(n, dtype=np.int64), np.zeros(n)
            args[16], args[17] = new_ids, new_rates
        else:  # the output a few entries after (ahead of) or before the input, in one buffer
            shift = max(3, n // 2)
            id_buffer, rate_buffer = np.zeros(n + shift, dtype=np.int64), np.zeros(n + shift)
            at_in, at_out = (0, shift) if layout == "ahead" else (shift, 0)
            id_buffer[at_in : at_in + n], rate_buffer[at_in : at_in + id_rates.size] = ids, id_rates
            args[0], args[1] = id_buffer[at_in : at_in + n], rate_buffer[at_in : at_in + id_rates.size]
            new_ids, new_rates = id_buffer[at_out : at_out + n], rate_buffer[at_out : at_out + n]
            args[16], args[17] = new_ids, new_rates
        out = real(*args)
        out_ids[:], out_rates[:] = new_ids, new_rates
        return out

    monkeypatch.setattr(flow_network_module._fill, "resolve", relocated)
    moved = run()
    assert len(moved) == len(reference)
    for (rates, order), (rates_ref, order_ref) in zip(moved, reference):
        assert np.array_equal(rates, rates_ref) and np.array_equal(order, order_ref)


def test_native_reach_falls_back_when_a_kept_flow_would_outrun_a_bottleneck() -> None:
    # g (rate 1, bottlenecked on A) and h (rate 2) share X. Three new flows on X reach h (tight
    # on X) but not g (1 < X's share 2): re-solved alone, h and the new flows would get 0.5
    # each on what g leaves, below g's 1, so g must slow down too: the check sees it and every
    # flow at or above the divergence level is re-solved. All five end at 3 / 5. (Twenty slow
    # flows on link 2 keep the re-solves partial.)
    network = FlowNetwork([1.0, 3.0, 0.1], native=True)
    g, h = network.add_flows(Incidence.from_paths([[0, 1], [1]], 3))
    network.add_flows(Incidence.from_paths([[2]] * 20, 3))
    np.testing.assert_allclose(network.rates([g, h]), [1.0, 2.0])
    new = network.add_flows(Incidence.from_paths([[1]] * 3, 3))
    np.testing.assert_allclose(network.rates([g, h, *new]), [0.6] * 5)
    assert network.last_update.kind == "partial" and network.last_update.reach_fallbacks == 1
    assert network.last_update.flows_resolved == 5 and network.check().ok
    # The same change without g on X: no fallback, and g is left alone.
    network = FlowNetwork([1.0, 3.0, 0.1], native=True)
    g, h = network.add_flows(Incidence.from_paths([[0], [1]], 3))
    network.add_flows(Incidence.from_paths([[2]] * 20, 3))
    network.rates()
    new = network.add_flows(Incidence.from_paths([[1]] * 3, 3))
    np.testing.assert_allclose(network.rates([g, h, *new]), [1.0] + [0.75] * 4)
    assert network.last_update.kind == "partial"
    assert network.last_update.reach_fallbacks == 0 and network.last_update.flows_resolved == 4


def test_native_reach_grows_by_the_kept_flow_that_would_outrun_a_bottleneck() -> None:
    # The case above with five fast flows on a fourth link (rate 10, at or above the divergence
    # level, out of every change's way): when the check finds g faster than X's new level, g
    # (and what is tight on its links: nothing else) joins the re-solve and the filling runs
    # again; the five stay as they are instead of the whole suffix being re-solved (#37: on
    # halving-doubling over fat-tree:k=32 those fallbacks were most of the run's time).
    network = FlowNetwork([1.0, 3.0, 0.1, 50.0], native=True)
    g, h = network.add_flows(Incidence.from_paths([[0, 1], [1]], 4))
    network.add_flows(Incidence.from_paths([[2]] * 20, 4))
    fast = network.add_flows(Incidence.from_paths([[3]] * 5, 4))
    np.testing.assert_allclose(network.rates([g, h, *fast]), [1.0, 2.0] + [10.0] * 5)
    new = network.add_flows(Incidence.from_paths([[1]] * 3, 4))
    np.testing.assert_allclose(network.rates([g, h, *new, *fast]), [0.6] * 5 + [10.0] * 5)
    update = network.last_update
    assert (update.kind, update.reach_grows, update.reach_fallbacks, update.flows_resolved) == ("partial", 1, 0, 5)
    assert network.check().ok


def test_native_reach_goes_back_for_an_earlier_flow_at_the_same_rate() -> None:
    # p [M] and q [P, M] both run at 1 (M: capacity 2; P: capacity 1, q alone). Lowering P to
    # 0.5 reaches q (on P); q makes M hot, on which p is tight at q's own rate. When p comes
    # first in the rate order, the pass has to go back for it, or p would keep 1 instead of 1.5
    # (a wrong result the kernel's check cannot see: M would just end below capacity).
    went_back = False
    for flows in ([[1], [0, 1]], [[0, 1], [1]]):
        network = FlowNetwork([1.0, 2.0, 0.1], native=True)
        ids = network.add_flows(Incidence.from_paths(flows, 3))
        network.add_flows(Incidence.from_paths([[2]] * 20, 3))  # slow: keep the re-solve partial
        p, q = ids if flows[0] == [1] else ids[::-1]
        np.testing.assert_allclose(network.rates([p, q]), [1.0, 1.0])
        went_back |= network._order[: network._order_n].tolist().index(p) < network._order[: network._order_n].tolist().index(q)
        network.set_capacity(0, 0.5)
        np.testing.assert_allclose(network.rates([p, q]), [1.5, 0.5])
        assert network.last_update.kind == "partial" and network.last_update.reach_fallbacks == 0
        assert network.check().ok
    assert went_back  # one of the two insertion orders put p first


def _kernel_resolve(
    network: FlowNetwork, ids: np.ndarray, n_filter: int = 0, id_rates: np.ndarray | None = None,
    **replace: np.ndarray
) -> tuple[int, ...]:
    """One direct call of the compiled re-solve on ``network``'s arrays (some replaced); with
    ``id_rates`` (the rates the candidates are sorted by) it uses the reach."""
    arrays = {name: getattr(network, f"_{name}") for name in (
        "start", "length", "links", "weights", "packed", "cap", "rate", "solved", "alive", "capacity", "load",
        "perturbed", "share", "link_map")}
    arrays.update(replace)
    n = ids.size
    return flow_network_module._fill.resolve(
        ids, np.zeros(n_filter) if id_rates is None else id_rates, *arrays.values(),
        np.zeros(n, dtype=np.int64), np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n),
        False, True, False, False, id_rates is not None, 1.0, n_filter)


def test_native_path_stays_partial_where_numpy_solves_in_full() -> None:
    # Removing a (rate 0.5) leaves 9 of the 12 flows at or above its rate: above the numpy path's
    # full-solve fraction (0.6), below the compiled kernel's (0.95). The reach re-solves only b,
    # the flow tight on a's link: the 8 flows on link 1 are tight there, and it did not change.
    paths = [[0], [0]] + [[1]] * 8 + [[2]] * 3
    results = {}
    for native, reach in ((False, False), (True, False), (True, True)):
        network = FlowNetwork([1.0, 10.0, 0.3], native=native, reach=reach)
        ids = network.add_flows(Incidence.from_paths(paths, 3))
        network.update()
        network.remove_flows(ids[:1])
        results[native, reach] = (network.rates(), network.last_update)
        if reach:
            assert network.last_resolved.tolist() == [ids[1]]
        assert network.check().ok
    assert results[False, False][1].kind == "full"
    assert results[True, False][1].kind == results[True, True][1].kind == "partial"
    assert results[True, False][1].flows_resolved == 9 and results[True, True][1].flows_resolved == 1
    # The reach reads only the entries in the rate band of a's link (share 0.5): b, and a's own
    # stale entry (dropped); the 8 flows at 1.25 are not read.
    assert results[True, True][1].candidates_read == 2
    for key in ((True, False), (True, True)):
        np.testing.assert_allclose(results[key][0], results[False, False][0], rtol=1e-12)
    np.testing.assert_allclose(results[True, True][0], [1.0] + [1.25] * 8 + [0.1] * 3)


def test_native_kernel_rejects_bad_slots_and_rows() -> None:
    network = FlowNetwork([1.0, 2.0], native=True)
    network.add_flows(Incidence.from_paths([[0], [0, 1]], 2))
    network.update()
    with pytest.raises(ValueError, match="out of range"):
        _kernel_resolve(network, np.array([network._start.size], dtype=np.int64))  # past every slot array
    with pytest.raises(ValueError, match="link_map"):
        _kernel_resolve(network, np.array([0], dtype=np.int64), link_map=np.full(1, -1, dtype=np.int32))
    packed = network._packed.copy()
    packed[1, 0] = 99  # a count longer than the row
    with pytest.raises(ValueError, match="packed row of slot 1 is corrupt"):
        _kernel_resolve(network, np.array([0, 1], dtype=np.int64), packed=packed)
    packed = network._packed.copy()
    packed[1, 2] = 7  # a link id past the network's links
    with pytest.raises(ValueError, match="link id 7 out of range"):
        _kernel_resolve(network, np.array([0, 1], dtype=np.int64), packed=packed)
    # A refused call with candidates taken before the bad id leaves them marked solved (1).
    with pytest.raises(ValueError, match="out of range"):
        _kernel_resolve(network, np.array([0, 1, network._start.size], dtype=np.int64), n_filter=3)
    assert network._solved[:2].tolist() == [True, True] and network._solved.view(np.uint8)[:2].tolist() == [1, 1]
    # Nothing was changed by the refused calls: the scratch map is clean, rates as solved.
    assert (network._link_map == -1).all()
    np.testing.assert_allclose(network.rates(), [0.5, 0.5])


def test_native_reach_refused_midway_leaves_the_taken_candidates_marked_solved() -> None:
    # Regression: the reach takes a and b (tight on the changed link 0), then meets a bad slot;
    # the refused call must give a and b back their solved mark (1) and their rates (the
    # reach marks a taken flow by setting its rate to NaN), not leave them "taken".
    network = FlowNetwork([1.0, 2.0], native=True)
    a, b = network.add_flows(Incidence.from_paths([[0], [0]], 2))
    network.update()
    network._perturbed[0] = 1
    bad = np.array([a, b, network._start.size], dtype=np.int64)  # all three are candidates at 0.5
    with pytest.raises(ValueError, match="flow slot .* is out of range"):
        _kernel_resolve(network, bad, n_filter=3, id_rates=np.full(3, 0.5))
    assert network._solved.view(np.uint8)[[a, b]].tolist() == [1, 1]
    assert network._rate[[a, b]].tolist() == [0.5, 0.5]
    assert (network._link_map == -1).all()
    network._perturbed[0] = 0
    np.testing.assert_allclose(network.rates(), [0.5, 0.5])


def test_native_kernel_filters_stale_and_repeated_candidates() -> None:
    network = FlowNetwork([1.0, 2.0], native=True)
    a, b, c = network.add_flows(Incidence.from_paths([[0], [0, 1], [1]], 2))
    network.update()
    network.remove_flows([c])  # c is dead now: a stale candidate
    candidates = np.array([a, c, b, a, b], dtype=np.int64)
    _, n_resolved, *_ = _kernel_resolve(network, candidates, n_filter=candidates.size)
    assert n_resolved == 2
    np.testing.assert_allclose(network._rate[[a, b]], [0.5, 0.5])
    assert network._solved.view(np.uint8)[[a, b]].tolist() == [1, 1]
    # Ids after the first n_filter are taken as given (new flows, unsolved).
    (d,) = network.add_flows(Incidence.from_paths([[1]], 2))
    _, n_resolved, *_ = _kernel_resolve(network, np.array([c, d], dtype=np.int64), n_filter=1)
    assert n_resolved == 1 and network._rate[d] == 2.0 - 0.5


def test_flow_network_packs_short_link_lists_only() -> None:
    network = FlowNetwork(np.ones(12))
    ids = network.add_flows(Incidence.from_paths([[3, 4], list(range(12)), []], 12))
    assert network._packed[ids[0], :3].tolist() == [2, 3, 4]
    assert network._packed[ids[1], 0] == -1 and network._packed[ids[2], 0] == 0
    network.remove_flows(ids[:1])
    (reused,) = network.add_flows(Incidence.from_paths([[7]], 12))
    assert reused == ids[0] and network._packed[reused, :2].tolist() == [1, 7]
    np.testing.assert_allclose(network.rates(network.flow_ids()), [0.5, 0.5, np.inf])  # both on link 7


def test_flow_network_last_resolved_covers_every_changed_rate() -> None:
    topology = fat_tree(4, 1.0, oversub=2)
    rng = np.random.default_rng(7)
    network = FlowNetwork(topology.capacity())
    network.add_flows(topology.route_ecmp(rng.integers(0, 16, (200, 2)), seed=1))
    previous = dict(zip(network.flow_ids().tolist(), network.rates().tolist()))
    for step in range(30):
        ids = network.flow_ids()
        if step % 3 == 0:
            network.add_flows(topology.route_ecmp(rng.integers(0, 16, (5, 2)), seed=step))
        network.remove_flows(rng.choice(ids, size=5, replace=False))
        current = dict(zip(network.flow_ids().tolist(), network.rates().tolist()))
        resolved = set(network.last_resolved.tolist())
        changed = {f for f, rate in current.items() if f not in previous or not math.isclose(previous[f], rate, rel_tol=1e-12)}
        assert changed <= resolved
        previous = current


def test_flow_network_rate_order_and_resolved_rates_stay_consistent_over_many_events() -> None:
    # Many small partial updates (the event engine's pattern) exercise the in-place rate-order
    # buffer: its live part must stay sorted, hold every live flow once, and the rates must
    # equal a from-scratch solve after every step.
    topology = fat_tree(4, 1.0, oversub=2)
    rng = np.random.default_rng(11)
    network = FlowNetwork(topology.capacity())
    network.add_flows(topology.route_ecmp(rng.integers(0, 16, (400, 2)), seed=3))
    kinds = set()
    for step in range(120):
        ids = network.flow_ids()
        if step % 4 == 0:
            network.add_flows(topology.route_ecmp(rng.integers(0, 16, (int(rng.integers(1, 30)), 2)), seed=step))
        if ids.size > 50:
            network.remove_flows(rng.choice(ids, size=int(rng.integers(1, 8)), replace=False))
        stats = network.update()
        kinds.add(stats.kind)
        np.testing.assert_array_equal(network.last_resolved_rates(), network.rates(network.last_resolved))
        live = network.flow_ids()
        reference = solve_max_min(network.incidence(live), network.capacity())
        np.testing.assert_allclose(network.rates(live), reference, rtol=1e-9, atol=0)
        order = network._order[: network._order_n]
        order_rates = network._order_rates[: network._order_n]
        assert np.all(order_rates[1:] >= order_rates[:-1])  # sorted (inf: flows with no links)
        current = order[network._alive[order]]
        current = current[network._rate[current] == order_rates[network._alive[order]]]
        assert sorted(set(current.tolist())) == live.tolist()  # every live flow, at its current rate
    assert {"full", "partial"} <= kinds


def test_incidence_trusted_matches_the_validated_constructor() -> None:
    paths, weights = [[0, 2], [], [1]], [[0.5, 1.0], [], [0.25]]
    checked = Incidence.from_paths(paths, 3, weights)
    trusted = Incidence.trusted(checked.indptr, checked.links, checked.weights, 3)
    assert trusted.to_lists() == checked.to_lists()
    np.testing.assert_array_equal(trusted.link_load(np.array([2.0, 1.0, 4.0])), [1.0, 1.0, 2.0])
    np.testing.assert_array_equal(solve_max_min(trusted, [1.0, 1.0, 1.0]), solve_max_min(checked, [1.0, 1.0, 1.0]))


@pytest.mark.parametrize("native", RESOLVE_PATHS)
def test_flow_network_id_reuse_and_errors(native: bool) -> None:
    network = FlowNetwork([1.0, 1.0], native=native)
    first = network.add_flows(Incidence.from_paths([[0], [0, 1]], 2))
    network.remove_flows(first[:1])
    second = network.add_flows(Incidence.from_paths([[1]], 2))
    assert second.tolist() == first[:1].tolist()  # a removed id is reused
    np.testing.assert_allclose(network.rates(), [0.5, 0.5])
    with pytest.raises(ValueError, match="not a live flow"):
        network.remove_flows([5])
    with pytest.raises(ValueError, match="must not repeat"):
        network.remove_flows([first[1], first[1]])
    # A refused call changes nothing.
    np.testing.assert_allclose(network.rates(), [0.5, 0.5])
    assert network.n_flows == 2 and network.flow_ids().tolist() == sorted([int(first[1]), int(second[0])])
    with pytest.raises(ValueError, match="links"):
        network.add_flows(Incidence.from_paths([[0]], 3))
    with pytest.raises(ValueError, match="capacities"):
        network.set_capacity(0, -1.0)


def test_flow_network_full_mode_gives_the_same_rates() -> None:
    topology = fat_tree(4, 1.0)
    rng = np.random.default_rng(3)
    flows = topology.route_ecmp(rng.integers(0, 16, (300, 2)), seed=2)
    networks = [FlowNetwork(topology.capacity(), incremental=flag) for flag in (True, False)]
    for network in networks:
        network.add_flows(flows)
    for step in range(20):
        victims = rng.choice(networks[0].flow_ids(), size=10, replace=False)
        link = int(rng.integers(0, topology.n_links))
        value = float(rng.choice([0.5, 1.0, 2.0]))
        for network in networks:
            network.remove_flows(victims)
            network.set_capacity(link, value)
        np.testing.assert_allclose(networks[0].rates(), networks[1].rates(), rtol=1e-9)
    assert networks[1].last_update.kind == "full"


# ---------------------------------------------------------------------------- naive solver and benchmark


def test_naive_solver_textbook() -> None:
    assert naive_max_min([[(0, 1.0), (1, 1.0)], [(0, 1.0)], [(1, 1.0)]], [1.0, 2.0]) == [0.5, 0.5, 1.5]
    assert naive_max_min([[]], [1.0]) == [INF]
    assert naive_max_min([[], [(0, 1.0)]], [1.0], [2.0, INF]) == [2.0, 1.0]


def test_benchmark_runs_on_a_small_configuration() -> None:
    config = BenchmarkConfig(
        topology="fat-tree:k=4,oversub=2",
        workers=8,
        servers=4,
        large_workers=6,
        large_servers=6,
        random_flows=2000,
        repeats=1,
    )
    figures = benchmark_solver(config)
    push = figures["push_40k"]
    assert push["flows"] == 32 and push["certificate_ok"]
    assert push["max_relative_difference"] < 1e-9 and push["speedup_wall"] > 0
    assert figures["random_6hop_250k"]["hops_min"] == 6 and figures["random_6hop_250k"]["certificate_ok"]
    assert figures["push_pull_500k"]["flows"] == 72
    assert figures["drain_80k"]["updates"] >= 2 and figures["drain_80k"]["simulated_seconds"] > 0
    assert "speed-up" in format_benchmark(figures)
