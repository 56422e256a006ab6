"""Topologies: spec strings, structure, capacities, shortest paths, ECMP, spraying, traces.

    .venv/bin/python -m pytest tests/unit/test_topo.py -q
"""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.flow import Incidence
from mlfabric.topo import (
    TopologySpec,
    TraceRow,
    Topology,
    bcube,
    fat_tree,
    load_capacity_trace,
    parse_topology,
    star,
    write_capacity_trace,
)
from mlfabric.topo.bcube import bcube_digits, bcube_switch_node

GBPS = 1e9


# ---------------------------------------------------------------------------- helpers


def assert_valid_path(topology: Topology, src: int, dst: int, path: tuple[int, ...]) -> None:
    """A path is a chain of links from src to dst that visits no node twice."""
    if src == dst:
        assert path == ()
        return
    assert topology.link_src[path[0]] == src
    assert topology.link_dst[path[-1]] == dst
    for a, b in zip(path[:-1], path[1:]):
        assert topology.link_dst[a] == topology.link_src[b]
    nodes = [src] + [int(topology.link_dst[link]) for link in path]
    assert len(set(nodes)) == len(nodes)


def dense(incidence: Incidence) -> np.ndarray:
    matrix = np.zeros((incidence.n_flows, incidence.n_links))
    np.add.at(matrix, (incidence.entry_flows(), incidence.links), incidence.weight_array())
    return matrix


def all_pairs(n_hosts: int) -> np.ndarray:
    return np.array([(a, b) for a in range(n_hosts) for b in range(n_hosts) if a != b])


# ---------------------------------------------------------------------------- spec strings


@pytest.mark.parametrize(
    ("text", "kind", "params", "canonical"),
    [
        ("star:n=16", "star", {"n": 16}, "star:n=16"),
        ("fat-tree:k=16,oversub=4", "fat-tree", {"k": 16, "oversub": 4.0}, "fat-tree:k=16,oversub=4"),
        ("fat-tree:k=16", "fat-tree", {"k": 16, "oversub": 1.0}, "fat-tree:k=16"),
        ("fat-tree:oversub=1,k=4", "fat-tree", {"k": 4, "oversub": 1.0}, "fat-tree:k=4"),
        ("racks:r=4,h=8,oversub=2.5", "racks", {"r": 4, "h": 8, "oversub": 2.5}, "racks:r=4,h=8,oversub=2.5"),
        ("bcube:n=4,k=2", "bcube", {"n": 4, "k": 2}, "bcube:n=4,k=2"),
        ("edges:/tmp/a,b=c.txt", "edges", {"path": "/tmp/a,b=c.txt"}, "edges:/tmp/a,b=c.txt"),
        (" FAT-TREE: k = 8 ", "fat-tree", {"k": 8, "oversub": 1.0}, "fat-tree:k=8"),
    ],
)
def test_spec_parses_and_round_trips(text: str, kind: str, params: dict[str, object], canonical: str) -> None:
    spec = TopologySpec.parse(text)
    assert spec.kind == kind
    assert dict(spec.params) == params
    assert str(spec) == canonical
    assert TopologySpec.parse(str(spec)) == spec
    assert hash(TopologySpec.parse(canonical)) == hash(spec)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("torus:n=4", "unknown topology kind"),
        ("fat-tree:oversub=4", "missing parameter k"),
        ("fat-tree:k=5", "must be even"),
        ("fat-tree:k=4,x=1", "unknown parameter"),
        ("fat-tree:k=4,k=4", "given twice"),
        ("fat-tree:k=1.5", "not an integer"),
        ("fat-tree:k=4,oversub=0", "> 0"),
        ("fat-tree:k=4,oversub=fast", "not a number"),
        ("racks:r=4", "missing parameter h"),
        ("bcube:n=1,k=2", ">= 2"),
        ("star:16", "key=value"),
        ("edges:", "needs a value"),
    ],
)
def test_spec_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopologySpec.parse(text)


def test_parse_topology_accepts_rate_strings_and_specs() -> None:
    topology = parse_topology("star:n=3", "10Gbps")
    assert topology.link_rate_bps == 10e9
    assert parse_topology(TopologySpec.parse("star:n=3"), 1e9).link_capacity.tolist() == [1e9] * 6
    with pytest.raises(ValueError, match="rate"):
        parse_topology("star:n=3", 0)


# ---------------------------------------------------------------------------- fat-tree


@pytest.mark.parametrize(("k", "hosts", "switches"), [(4, 16, 20), (8, 128, 80), (16, 1024, 320)])
def test_fat_tree_counts(k: int, hosts: int, switches: int) -> None:
    topology = parse_topology(f"fat-tree:k={k}", GBPS)
    assert topology.n_hosts == hosts == k**3 // 4
    assert topology.n_switches == switches
    # Host cables + edge-agg cables + agg-core cables, two directed links each.
    assert topology.n_links == 2 * (hosts + 2 * k**3 // 4)
    assert len(topology.cables) == topology.n_links // 2
    assert topology.n_nics == 1
    # Every switch has k ports.
    degree = np.bincount(topology.link_src, minlength=topology.n_nodes)
    assert (degree[topology.n_hosts :] == k).all()
    assert (degree[: topology.n_hosts] == 1).all()


def test_fat_tree_oversubscription_is_at_the_tor_uplinks() -> None:
    topology = parse_topology("fat-tree:k=16,oversub=4", 10 * GBPS)
    capacity = dict(zip(topology.layer_names, [sorted(set(topology.link_capacity[topology.links_in_layer(n)])) for n in topology.layer_names]))
    assert capacity["host-edge"] == capacity["edge-host"] == [10e9]
    assert capacity["edge-agg"] == capacity["agg-edge"] == [2.5e9]
    assert capacity["agg-core"] == capacity["core-agg"] == [10e9]
    # Per ToR: hosts' aggregate capacity is 4x what leaves the rack.
    edge0 = topology.n_hosts
    down = topology.link_capacity[(topology.link_dst == edge0) & (topology.link_src < topology.n_hosts)].sum()
    up = topology.link_capacity[(topology.link_src == edge0) & (topology.link_dst >= topology.n_hosts)].sum()
    assert down == pytest.approx(4 * up)


def test_fat_tree_k4_paths_match_bfs_for_every_pair() -> None:
    topology = fat_tree(4, GBPS)
    generic = topology.generic_router()
    for src, dst in itertools.product(range(16), repeat=2):
        paths = topology.paths(src, dst)
        assert paths == generic.all_paths(src, dst)
        for path in paths:
            assert_valid_path(topology, src, dst, path)


def test_fat_tree_shortest_path_counts() -> None:
    topology = fat_tree(4, GBPS)
    # Hosts 0,1 share edge 0; host 2 is on edge 1 of pod 0; host 4 is in pod 1.
    assert len(topology.paths(0, 1)) == 1 and len(topology.paths(0, 1)[0]) == 2
    assert len(topology.paths(0, 2)) == 2 and {len(p) for p in topology.paths(0, 2)} == {4}
    assert len(topology.paths(0, 4)) == 4 and {len(p) for p in topology.paths(0, 4)} == {6}
    assert topology.paths(3, 3) == [()]
    big = fat_tree(16, GBPS)
    assert big.n_paths([(0, 1023), (0, 8), (0, 1)]).tolist() == [64, 8, 1]


def test_fat_tree_k16_random_paths_are_valid_chains() -> None:
    topology = fat_tree(16, GBPS, oversub=4)
    rng = np.random.default_rng(3)
    for src, dst in rng.integers(0, topology.n_hosts, (40, 2)).tolist():
        paths = topology.paths(src, dst)
        assert len(set(paths)) == len(paths)
        for path in paths:
            assert_valid_path(topology, src, dst, path)


# ---------------------------------------------------------------------------- bcube (BML numbering)


def test_bcube_4_2_counts_and_nics() -> None:
    topology = parse_topology("bcube:n=4,k=2", GBPS)
    assert topology.n_hosts == 16
    assert topology.n_switches == 8  # k * n^(k-1)
    assert topology.n_links == 2 * 16 * 2
    assert topology.n_nics == 2
    assert topology.host_nics(5) == [(10, 42), (11, 43)]  # egress h*k + l, ingress N*k + h*k + l
    # Every switch has n = 4 ports; every host k = 2.
    degree = np.bincount(topology.link_src, minlength=topology.n_nodes)
    assert (degree[16:] == 4).all() and (degree[:16] == 2).all()


def test_bcube_level_switch_connects_hosts_differing_only_in_that_digit() -> None:
    n, k = 3, 2
    topology = bcube(n, k, GBPS)
    for host in range(n**k):
        for level in range(k):
            egress = topology.host_link(host, level, "egress")
            ingress = topology.host_link(host, level, "ingress")
            switch = topology.link_src[ingress]
            assert topology.link_dst[egress] == switch == bcube_switch_node(host, level, n, k)
            members = sorted(topology.link_dst[(topology.link_src == switch)].tolist())
            digits = bcube_digits(np.array(members), n, k)
            others = [d for d in range(k) if d != level]
            # All members agree with `host` on every other digit and cover all n values of `level`.
            assert (digits[:, others] == bcube_digits(host, n, k)[others]).all()
            assert sorted(digits[:, level].tolist()) == list(range(n))
    # BML Fig. 3/4: server [0,1] (digits v1=0, v0=1) is host 1 and is a level-0 neighbour of [0,0].
    assert bcube_digits(1, n, k).tolist() == [1, 0]
    assert topology.paths(0, 1) == [(topology.host_link(0, 0, "egress"), topology.host_link(1, 0, "ingress"))]


def test_bcube_one_digit_transfers_use_that_levels_nic() -> None:
    n, k = 4, 2
    topology = bcube(n, k, GBPS)
    for src, dst in all_pairs(n**k).tolist():
        differing = np.flatnonzero(bcube_digits(src, n, k) != bcube_digits(dst, n, k)).tolist()
        paths = topology.paths(src, dst)
        if len(differing) == 1:
            level = differing[0]
            assert paths == [(topology.host_link(src, level, "egress"), topology.host_link(dst, level, "ingress"))]
        else:
            assert len(paths) == 2 and all(len(p) == 4 for p in paths)
        for path in paths:
            assert_valid_path(topology, src, dst, path)


@pytest.mark.parametrize(("n", "k"), [(3, 2), (2, 3), (4, 2)])
def test_bcube_paths_match_bfs(n: int, k: int) -> None:
    topology = bcube(n, k, GBPS)
    generic = topology.generic_router()
    for src, dst in all_pairs(n**k).tolist():
        assert topology.paths(src, dst) == generic.all_paths(src, dst)
    # 3 differing digits: 3! digit-correction orders.
    if k == 3:
        assert len(topology.paths(0, 7)) == 6


# ---------------------------------------------------------------------------- racks and star


def test_racks_structure_and_uplink_capacity() -> None:
    topology = parse_topology("racks:r=4,h=8,oversub=4", 10 * GBPS)
    assert topology.n_hosts == 32
    assert topology.n_switches == 5
    assert topology.n_links == 2 * 32 + 2 * 4
    uplinks = topology.links_in_layer("tor-core")
    assert topology.link_capacity[uplinks].tolist() == [8 * 10e9 / 4] * 4
    assert topology.link_capacity[topology.links_in_layer("core-tor")].tolist() == [20e9] * 4
    assert [len(p) for p in topology.paths(0, 1)] == [2]
    assert [len(p) for p in topology.paths(0, 8)] == [4]
    generic = topology.generic_router()
    for src, dst in all_pairs(32)[::7].tolist():
        assert topology.paths(src, dst) == generic.all_paths(src, dst)


def test_star_structure() -> None:
    topology = star(16, GBPS)
    assert (topology.n_hosts, topology.n_switches, topology.n_links) == (16, 1, 32)
    assert topology.paths(2, 5) == [(2, 16 + 5)]
    assert topology.link_name(2) == "h2->sw"


# ---------------------------------------------------------------------------- ECMP and spraying


def test_ecmp_is_deterministic_under_a_seed_and_varies_across_seeds() -> None:
    topology = fat_tree(16, GBPS, oversub=4)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 512, 2000)
    dst = rng.integers(512, 1024, 2000)  # always another pod: 64 paths each
    flows = np.stack([src, dst], axis=1)
    first = topology.route_ecmp(flows, seed=7)
    again = topology.route_ecmp(flows, seed=7)
    other = topology.route_ecmp(flows, seed=8)
    assert np.array_equal(first.links, again.links)
    assert np.array_equal(first.indptr, again.indptr)
    index_7 = topology.ecmp_index(flows, seed=7)
    index_8 = topology.ecmp_index(flows, seed=8)
    # Two independent choices among 64 paths agree 1/64 of the time.
    assert 0.9 < np.mean(index_7 != index_8) < 1.0
    assert not np.array_equal(first.links, other.links)
    # The chosen path is paths()[index].
    for f in range(0, 2000, 97):
        chosen = tuple(first.links[first.indptr[f] : first.indptr[f + 1]].tolist())
        assert chosen == topology.paths(int(src[f]), int(dst[f]))[index_7[f]]


def test_ecmp_spreads_flows_over_all_paths_and_keys_pin_paths() -> None:
    topology = fat_tree(8, GBPS)
    flows = np.tile([[0, 127]], (16 * 40, 1))  # one pod pair, 16 paths
    index = topology.ecmp_index(flows, seed=1)
    counts = np.bincount(index, minlength=16)
    assert (counts > 10).all() and counts.sum() == 640
    # Same key, same path, wherever the flow sits in the list.
    keys = np.arange(640)
    shuffled = np.random.default_rng(0).permutation(640)
    assert np.array_equal(
        topology.ecmp_index(flows, seed=1, flow_keys=keys)[shuffled],
        topology.ecmp_index(flows[shuffled], seed=1, flow_keys=keys[shuffled]),
    )


def test_ecmp_structural_and_generic_routers_agree() -> None:
    topology = fat_tree(4, GBPS)
    flows = all_pairs(16)
    index = topology.ecmp_index(flows, seed=3)
    generic = topology.generic_router().select(flows[:, 0], flows[:, 1], index)
    structural = topology.route_ecmp(flows, seed=3)
    assert np.array_equal(generic.links, structural.links)


def spray_conservation_holds(topology: Topology, flows: np.ndarray, spray: Incidence) -> None:
    """Each flow's fractions form a unit flow: 1 leaves src, 1 enters dst, in = out elsewhere."""
    weights = spray.weight_array()
    entry_flow = spray.entry_flows()
    for f, (src, dst) in enumerate(flows.tolist()):
        mine = entry_flow == f
        links, w = spray.links[mine], weights[mine]
        out = np.bincount(topology.link_src[links], weights=w, minlength=topology.n_nodes)
        into = np.bincount(topology.link_dst[links], weights=w, minlength=topology.n_nodes)
        net = out - into
        expected = np.zeros(topology.n_nodes)
        if src != dst:
            expected[src], expected[dst] = 1.0, -1.0
        np.testing.assert_allclose(net, expected, atol=1e-12)
        assert (w > 0).all() and (w <= 1 + 1e-12).all()
        # Total weight = hops of a shortest path (every path has the same length).
        hops = len(topology.paths(src, dst)[0])
        assert w.sum() == pytest.approx(hops)


@pytest.mark.parametrize("spec", ["fat-tree:k=4", "fat-tree:k=8,oversub=2", "bcube:n=3,k=3", "racks:r=3,h=2", "star:n=4"])
def test_spray_fractions_are_unit_flows(spec: str) -> None:
    topology = parse_topology(spec, GBPS)
    rng = np.random.default_rng(1)
    flows = rng.integers(0, topology.n_hosts, (60, 2))
    spray_conservation_holds(topology, flows, topology.route_spray(flows))


def test_fat_tree_spray_matches_generic_average_over_paths() -> None:
    topology = fat_tree(4, GBPS)
    flows = all_pairs(16)
    structural = dense(topology.route_spray(flows))
    generic = dense(topology.generic_router().spray(flows[:, 0], flows[:, 1]))
    np.testing.assert_allclose(structural, generic, atol=1e-12)
    # Inter-pod flow 0 -> 4: host links carry all of it, each of 4 core links a quarter.
    row = structural[np.flatnonzero((flows[:, 0] == 0) & (flows[:, 1] == 4))[0]]
    assert sorted(set(np.round(row[row > 0], 12).tolist())) == [0.25, 0.5, 1.0]


def test_route_fixed_and_errors() -> None:
    topology = fat_tree(4, GBPS)
    fixed = topology.route_fixed([(0, 4), (0, 4)], np.array([0, 3]))
    paths = topology.paths(0, 4)
    assert tuple(fixed.flow(0)[0].tolist()) == paths[0]
    assert tuple(fixed.flow(1)[0].tolist()) == paths[3]
    with pytest.raises(ValueError, match="out of range"):
        topology.route_fixed([(0, 4)], 4)
    with pytest.raises(ValueError, match="outside"):
        topology.route_ecmp([(0, 16)])
    with pytest.raises(ValueError, match="shape"):
        topology.route_ecmp([(0, 1, 2)])


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["fat-tree:k=4", "fat-tree:k=6", "bcube:n=3,k=2", "bcube:n=2,k=3", "racks:r=2,h=3"]), st.integers(0, 2**32), st.data())
def test_ecmp_paths_are_shortest_valid_paths(spec: str, seed: int, data: st.DataObject) -> None:
    topology = parse_topology(spec, GBPS)
    flows = np.array(data.draw(st.lists(st.tuples(st.integers(0, topology.n_hosts - 1), st.integers(0, topology.n_hosts - 1)), min_size=1, max_size=20)))
    routed = topology.route_ecmp(flows, seed=seed)
    for f, (src, dst) in enumerate(flows.tolist()):
        path = tuple(routed.flow(f)[0].tolist())
        assert path in topology.paths(src, dst)
        assert_valid_path(topology, src, dst, path)


# ---------------------------------------------------------------------------- edge lists


def test_edge_list_round_trip_of_a_fat_tree(tmp_path: Path) -> None:
    original = fat_tree(4, 10 * GBPS, oversub=2)
    file = tmp_path / "ft.edgelist"
    original.write_edge_list(file)
    loaded = parse_topology(f"edges:{file}", 1.0)  # every cable carries its own capacity
    assert loaded.spec.kind == "edges"
    assert (loaded.n_hosts, loaded.n_switches, loaded.n_links) == (16, 20, 96)
    # Same capacity on the same named link.
    by_name = {original.link_name(l): original.link_capacity[l] for l in range(original.n_links)}
    assert {loaded.link_name(l): loaded.link_capacity[l] for l in range(loaded.n_links)} == by_name
    for src, dst in [(0, 1), (0, 2), (0, 4), (15, 3)]:
        assert [[loaded.link_name(l) for l in p] for p in loaded.paths(src, dst)] == [
            [original.link_name(l) for l in p] for p in original.paths(src, dst)
        ]


def test_edge_list_formats_hosts_and_nics(tmp_path: Path) -> None:
    file = tmp_path / "small.edgelist"
    file.write_text(
        "# two hosts with two NICs each, two switches\n"
        "h0 s1 {'capacity': '10Gbps'}\n"
        "h1 s1 {'capacity': 1e9, 'capacity_reverse': 2e9}\n"
        "h0 s2 25Gbps\n"
        "h1 s2\n"
        "\n"
    )
    topology = parse_topology(f"edges:{file}", "40Gbps")
    assert topology.n_hosts == 2 and topology.n_switches == 2
    assert topology.n_nics == 2
    assert topology.link_capacity[topology.host_link(0, 0, "egress")] == 10e9
    assert topology.link_capacity[topology.host_link(1, 0, "egress")] == 1e9
    assert topology.link_capacity[topology.host_link(1, 0, "ingress")] == 2e9
    assert topology.link_capacity[topology.host_link(0, 1, "egress")] == 25e9
    assert topology.link_capacity[topology.host_link(1, 1, "egress")] == 40e9
    assert len(topology.paths(0, 1)) == 2  # via s1 or s2
    routed = topology.route_spray([(0, 1)])
    assert sorted(routed.weight_array().tolist()) == [0.5] * 4


def test_edge_list_without_host_names_makes_every_node_a_host(tmp_path: Path) -> None:
    file = tmp_path / "ring.edgelist"
    file.write_text("0 1\n1 2\n2 3\n3 0\n")
    topology = parse_topology(f"edges:{file}", GBPS)
    assert topology.n_hosts == 4 and topology.n_switches == 0
    assert len(topology.paths(0, 2)) == 2 and len(topology.paths(0, 1)) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("h0 s1\nh2 s1\n", "without gaps"),
        ("h0 h0\n", "self-loop"),
        ("h0\n", "expected 'u v"),
        ("h0 s1 {'capacity': 'fast'}\n", "cannot parse rate"),
        ("h0 s1 {oops\n", "dict literal"),
        ("# nothing\n", "no edges"),
    ],
)
def test_edge_list_errors(tmp_path: Path, content: str, message: str) -> None:
    file = tmp_path / "bad.edgelist"
    file.write_text(content)
    with pytest.raises(ValueError, match=message):
        parse_topology(f"edges:{file}", GBPS)


def test_edge_list_missing_file() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        parse_topology("edges:/nonexistent/file.edgelist", GBPS)


# ---------------------------------------------------------------------------- capacity traces


def test_capacity_trace_round_trip_and_piecewise_constant(tmp_path: Path) -> None:
    topology = bcube(3, 2, 10 * GBPS)
    rows = [
        TraceRow(time_s=1.0, host=4, nic=1, direction="egress", rate_bps=5e9),
        TraceRow(time_s=0.5, host=0, nic=0, direction="ingress", rate_bps=1e9),
        TraceRow(time_s=1.0, host=4, nic=1, direction="egress", rate_bps=2e9),  # same time: last wins
        TraceRow(time_s=2.0, host=0, nic=0, direction="ingress", rate_bps=10e9),
    ]
    file = tmp_path / "trace.csv"
    write_capacity_trace(file, rows)
    assert file.read_text().splitlines()[0] == "time_s,host,nic,direction,rate_bps"
    trace = load_capacity_trace(file, topology)
    assert len(trace) == 4
    egress_4_1 = topology.host_link(4, 1, "egress")
    ingress_0_0 = topology.host_link(0, 0, "ingress")
    points = [(t, links.tolist(), rates.tolist()) for t, links, rates in trace.change_points()]
    assert points == [(0.5, [ingress_0_0], [1e9]), (1.0, [egress_4_1], [2e9]), (2.0, [ingress_0_0], [10e9])]
    base = topology.capacity()
    assert trace.capacity_at(0.4, base)[ingress_0_0] == 10e9
    at_1 = trace.capacity_at(1.0, base)
    assert at_1[ingress_0_0] == 1e9 and at_1[egress_4_1] == 2e9
    assert trace.capacity_at(3.0, base)[ingress_0_0] == 10e9
    changed = np.flatnonzero(at_1 != base)
    assert sorted(changed.tolist()) == sorted([ingress_0_0, egress_4_1])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("t,host,nic,direction,rate_bps\n", "header"),
        ("time_s,host,nic,direction,rate_bps\n0,0,0,up,1e9\n", "direction"),
        ("time_s,host,nic,direction,rate_bps\n0,99,0,egress,1e9\n", "host 99"),
        ("time_s,host,nic,direction,rate_bps\n0,0,3,egress,1e9\n", "no NIC 3"),
        ("time_s,host,nic,direction,rate_bps\n0,0,0,egress,fast\n", "cannot parse rate"),
        ("time_s,host,nic,direction,rate_bps\n0,0,0,egress\n", "5 columns"),
    ],
)
def test_capacity_trace_errors(tmp_path: Path, content: str, message: str) -> None:
    file = tmp_path / "bad.csv"
    file.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_capacity_trace(file, star(4, GBPS))


@pytest.mark.parametrize("spec", ["fat-tree:k=4,oversub=2", "bcube:n=3,k=2", "racks:r=2,h=2", "star:n=3"])
def test_topologies_pickle(spec: str) -> None:
    topology = parse_topology(spec, GBPS)
    clone = pickle.loads(pickle.dumps(topology))
    assert clone.spec == topology.spec
    assert np.array_equal(clone.link_capacity, topology.link_capacity)
    flows = [(0, topology.n_hosts - 1), (1, 2)]
    assert np.array_equal(clone.route_ecmp(flows, seed=4).links, topology.route_ecmp(flows, seed=4).links)


def test_topology_arrays_are_read_only() -> None:
    topology = star(4, GBPS)
    with pytest.raises(ValueError):
        topology.link_capacity[0] = 0.0
    copy = topology.capacity()
    copy[0] = 0.0
    assert topology.with_capacity(copy).link_capacity[0] == 0.0
    assert topology.link_capacity[0] == GBPS
