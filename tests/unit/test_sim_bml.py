"""BML in the simulator (mlfabric/sim/bml.py): GST against BML's closed forms, Fig. 5's bars,
the emulator's predicted GSTs, ``mlfabric simulate bml``, and the engine's vectorized
NIC routing (which made 1,024-host BCube runs feasible).

    .venv/bin/python -m pytest tests/unit/test_sim_bml.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mlfabric.flow import Incidence
from mlfabric.sim import Engine, EngineConfig, GraphBuilder
from mlfabric.sim import bml
from mlfabric.sim.bml import (
    bar_theory_tf,
    figure5,
    gradient_bytes,
    gst_checks,
    predicted_gst_s,
    ps_bcube_bound_tf,
    simulate_gst,
)
from mlfabric.topo import bcube, ecmp_hash

RTOL = 1e-3  # the "within 0.1%"


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    # Every test simulates what it asserts on, not a result another test left in the cache.
    bml._simulate.cache_clear()
    yield


def closed_form_tf(n: int, k: int) -> float:
    world = n**k
    return 2 * (world - 1) / (k * world)


# ---------------------------------------------------------------------------- GST check (BML §3.2)


# (32, 2) is 1,024 hosts and 254k flows: ~9 s of CPU, most of it building the schedules
# (marked slow: `-m "not slow"` leaves it to `mlfabric simulate bml`).
@pytest.mark.parametrize(("n", "k", "expected"), [(4, 2, 15 / 16), (3, 2, 8 / 9), (8, 3, 511 / 768),
                                                  pytest.param(32, 2, 1023 / 1024, marks=pytest.mark.slow)])
def test_bml_gst_matches_closed_form(n: int, k: int, expected: float) -> None:
    # expected: 2(N-1)/(kN) written out; (3, 2) is the paper's worked example, 16 T_C = 8/9 T_F.
    assert closed_form_tf(n, k) == pytest.approx(expected, rel=1e-15)
    (check,) = gst_checks([(n, k)])
    assert check.n == n and check.k == k and check.closed_form_tf == pytest.approx(expected, rel=1e-15)
    assert check.ok and check.rel_error <= RTOL
    assert abs(check.simulated_tf - expected) <= RTOL * expected


def test_gst_check_fails_when_off() -> None:
    (check,) = gst_checks([(3, 2)])
    tight = bml.GSTCheck(n=3, k=2, simulated_tf=check.simulated_tf * (1 + 2 * RTOL), closed_form_tf=8 / 9,
                         rtol=RTOL, wall_s=0.0)
    assert not tight.ok and tight.to_dict()["ok"] is False


# ---------------------------------------------------------------------------- Fig. 5 bars


def test_ps_on_bcube_is_between_the_link_load_bound_and_twice_bml() -> None:
    # BML §3.3 says PS on BCube "will double the GST". The exact bound is lower: PS's push
    # (and pull) is a uniform all-to-all, each host's k uplinks carry P k (n-1)/n bytes
    # (own flows plus relayed ones), so PS needs >= 2(n-1)/n T_F = 1.5 T_F on BCube(4,2),
    # i.e. 1.6 x BML's 15/16; "2 x" is the large-n limit (1.94 x on BCube(32,2)). Spraying
    # balances the all-to-all over both NICs, so the simulation sits on the bound.
    bml_tf = simulate_gst("bcube", "bcube:n=4,k=2").gst_tf
    ps_tf = simulate_gst("ps", "bcube:n=4,k=2").gst_tf
    assert bml_tf == pytest.approx(15 / 16, rel=RTOL)
    assert ps_bcube_bound_tf(4, 2) == 1.5
    assert ps_tf == pytest.approx(1.5, rel=RTOL)
    assert 1.6 * (1 - RTOL) <= ps_tf / bml_tf <= 2.0
    assert ps_bcube_bound_tf(32, 2) / closed_form_tf(32, 2) == pytest.approx(1.9394, abs=1e-4)


@pytest.mark.parametrize("algorithm", ["hierarchical", "ps"])
def test_fat_tree_baselines_equal_two_n_minus_one_over_n(algorithm: str) -> None:
    # BML §2/§3.3: on a non-blocking Fat-Tree both take 2(N-1)/N T_F = 1.875 T_F for N = 16.
    result = simulate_gst(algorithm, "fat-tree:k=4")
    assert result.servers == 16
    assert result.gst_tf == pytest.approx(2 * 15 / 16, rel=RTOL)


def test_figure5_sixteen_servers() -> None:
    rows = figure5((16,))
    assert [row["name"] for row in rows] == ["BML/BCube(4,2)", "PS/BCube(4,2)", "Hierarchical/Fat-Tree(4)",
                                             "PS/Fat-Tree(4)"]
    by_bar = {row["bar"]: row for row in rows}
    assert {row["size_bytes"] for row in rows} == {100_000_000}
    assert [row["theory_tf"] for row in rows] == pytest.approx([0.9375, 1.875, 1.875, 1.875], rel=1e-15)
    assert by_bar["BML/BCube"]["gst_tf"] == pytest.approx(0.9375, rel=RTOL)
    assert by_bar["PS/BCube"]["gst_tf"] == pytest.approx(by_bar["PS/BCube"]["bound_tf"], rel=RTOL)
    for bar in ("Hierarchical/Fat-Tree", "PS/Fat-Tree"):
        assert by_bar[bar]["sim_vs_theory"] == pytest.approx(1.0, abs=RTOL)
    # Fig. 5's message: BML on BCube needs about half the GST of either Fat-Tree baseline.
    assert by_bar["BML/BCube"]["gst_tf"] / by_bar["PS/Fat-Tree"]["gst_tf"] == pytest.approx(0.5, rel=RTOL)
    with pytest.raises(ValueError, match="Fig. 5 has"):
        figure5((17,))


def test_theory_and_gradient_size() -> None:
    assert bar_theory_tf("PS/BCube", "bcube:n=32,k=2", "fat-tree:k=16") == pytest.approx(2 * 1023 / 1024)
    assert bar_theory_tf("PS/Fat-Tree", "bcube:n=32,k=2", "fat-tree:k=16") == pytest.approx(2 * 1023 / 1024)
    size = gradient_bytes(["bcube:n=32,k=2", "fat-tree:k=16"])
    assert size % (2 * 1024 * 4) == 0 and 100_000_000 - 8192 < size <= 100_000_000
    assert gradient_bytes(["bcube:n=8,k=3"]) % (3 * 512 * 4) == 0
    with pytest.raises(ValueError, match="BCube topology"):
        simulate_gst("bcube", "fat-tree:k=4")


def test_predicted_gst_for_the_emulated_benchmark() -> None:
    # BCube(3,2) at 500 Mbit/s, 64 MB: T_F = 1.024 s. 64e6 B / 4 = 16e6 elements do not cut
    # into 18 equal pieces, so the schedule is a fraction of a piece above the closed form.
    full_transfer_s = 64e6 * 8 / 500e6
    bml_s = predicted_gst_s("bcube", "bcube:n=3,k=2", "500Mbps", 64_000_000)
    ring_s = predicted_gst_s("ring", "star:n=9", 500e6, 64_000_000)
    ps_s = predicted_gst_s("ps", "star:n=9", 500e6, 64_000_000)
    assert bml_s == pytest.approx(8 / 9 * full_transfer_s, rel=RTOL) and bml_s >= 8 / 9 * full_transfer_s
    assert ring_s == pytest.approx(16 / 9 * full_transfer_s, rel=RTOL)
    assert ps_s == pytest.approx(16 / 9 * full_transfer_s, rel=RTOL)


# ---------------------------------------------------------------------------- CLI


def test_cli_simulate_bml(tmp_path: Path) -> None:
    from mlfabric.cli import app

    out = tmp_path / "bml.json"
    result = CliRunner().invoke(app, ["simulate", "bml", "--servers", "16", "--checks", "4x2,3x2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "BML/BCube(4,2)" in result.output and "Hierarchical/Fat-Tree(4)" in result.output
    assert "0.9375" in result.output and "BCube(3,2)" in result.output
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["routing"] == "spray" and data["link_rate_bps"] == 10e9
    assert data["command"].startswith("mlfabric simulate bml --servers 16 --checks 4x2,3x2")
    assert [row["gst_tf"] for row in data["figure5"]] == pytest.approx([0.9375, 1.5, 1.875, 1.875], rel=RTOL)
    assert [(c["n"], c["k"], c["ok"]) for c in data["gst_checks"]] == [(4, 2, True), (3, 2, True)]
    assert data["gst_checks"][1]["simulated_tf"] == pytest.approx(8 / 9, rel=RTOL)
    for bad in (["--servers", "17"], ["--checks", "4by2"], ["--checks", "1x2"], ["--rtol", "0"],
                ["--routing", "magic"]):
        failed = CliRunner().invoke(app, ["simulate", "bml", "--servers", "16", *bad])
        assert failed.exit_code == 2, (bad, failed.output)


# ---------------------------------------------------------------------------- engine NIC routing


def reference_route_by_nic(topo, src, dst, nic, keys, routing: str, seed: int) -> Incidence:
    """The per-pair enumeration the engine used before it was vectorized."""
    paths_out, weights_out = [], []
    hashes = ecmp_hash(src, dst, keys, seed)
    for s, d, l, h in zip(src.tolist(), dst.tolist(), nic.tolist(), hashes.tolist()):
        every = topo.paths(s, d)
        egress = int(topo.nic_links[s, l, 0]) if l < topo.n_nics else -1
        paths = [p for p in every if p and p[0] == egress] or every
        if routing == "ecmp":
            chosen = paths[h % len(paths)]
            paths_out.append(list(chosen))
            weights_out.append([1.0] * len(chosen))
        else:
            flat = [link for p in paths for link in p]
            paths_out.append(flat)
            weights_out.append([1.0 / len(paths)] * len(flat))
    return Incidence.from_paths(paths_out, topo.n_links, weights_out).merge_duplicates()


@pytest.mark.parametrize("routing", ["ecmp", "spray"])
@pytest.mark.parametrize("seed", [0, 7])
def test_vectorized_nic_routing_equals_per_pair_enumeration(routing: str, seed: int) -> None:
    # BCube(3,3): 1 to 6 shortest paths per pair; NIC 3 does not exist (any path is fine).
    topo = bcube(3, 3, 1e9)
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 27, 400)
    dst = (src + rng.integers(1, 27, 400)) % 27
    nic = rng.integers(0, 4, 400)
    b = GraphBuilder()
    b.add_transfers(src, dst, 1e6, nic=nic)
    graph = b.build()
    engine = Engine(graph, topo, EngineConfig(routing=routing, seed=seed))
    tasks = np.arange(graph.n_tasks)
    got = engine._route_by_nic(tasks)
    want = reference_route_by_nic(topo, src, dst, nic, graph.flow_key, routing, seed)
    assert np.array_equal(got.indptr, want.indptr)
    assert np.array_equal(got.links, want.links)
    assert np.array_equal(got.weight_array(), want.weight_array())


# ---------------------------------------------------------------------------- shape options


def test_shape_options_come_from_the_topology() -> None:
    from mlfabric.collectives.bcube import shape_options
    from mlfabric.topo.spec import TopologySpec

    assert shape_options("bcube", TopologySpec.parse("bcube:n=3,k=2")) == {"n": 3, "k": 2}
    assert shape_options("hierarchical", TopologySpec.parse("fat-tree:k=4")) == {"radices": (2, 2, 4)}
    assert shape_options("ring", TopologySpec.parse("bcube:n=3,k=2")) == {}
    with pytest.raises(ValueError, match="BCube topology"):
        shape_options("bcube", TopologySpec.parse("star:n=9"))


def test_simulate_collective_takes_bml_shape_from_the_topology() -> None:
    # Regression: `simulate collective --algorithm bcube` failed with "bcube_allreduce()
    # missing 2 required keyword-only arguments" because n and k were never derived.
    from mlfabric.sim import simulate_collective

    size = 9 * 2 * 4 * 1000  # 2 k N float32 pieces of 1,000 elements
    result = simulate_collective("bcube", "bcube:n=3,k=2", "1Gbps", size_bytes=size)
    assert result.time_s == pytest.approx(2 * 8 / (2 * 9) * size * 8 / 1e9, rel=1e-9)
    # Explicit n, k still run the schedule on a one-NIC star (half BML's speed there).
    star = simulate_collective("bcube", "star:n=9", "1Gbps", size_bytes=size, n=3, k=2)
    assert star.time_s > 1.5 * result.time_s
    with pytest.raises(ValueError, match="BCube topology"):
        simulate_collective("bcube", "star:n=9", "1Gbps", size_bytes=size)


def test_cli_simulates_bml_against_its_closed_form() -> None:
    from mlfabric.cli import app

    ok = CliRunner().invoke(app, ["simulate", "collective", "--topology", "bcube:n=3,k=2", "--link", "1Gbps",
                                  "--algorithm", "bcube", "--size", "72KB", "--json", "-", "--links", "none"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["algorithm"] == "allreduce:bcube"
    assert data["time_vs_closed_form"] == pytest.approx(1.0, rel=1e-9)
    assert data["closed_form_s"] == pytest.approx(2 * 8 / (2 * 9) * 72e3 * 8 / 1e9, rel=1e-12)
    bad = CliRunner().invoke(app, ["simulate", "collective", "--topology", "star:n=4", "--link", "1Gbps",
                                   "--algorithm", "bcube", "--size", "1MB"])
    assert bad.exit_code == 2 and "BCube topology" in bad.output


def test_benchmark_prediction_runs_the_communicators_schedule() -> None:
    from mlfabric.bench.allreduce import simulated_allreduce_s

    size = 9 * 2 * 4 * 1000
    full = size * 8 / 500e6
    assert simulated_allreduce_s("bcube", "bcube:n=3,k=2", 500e6, size) == pytest.approx(16 / 18 * full, rel=1e-9)
    assert simulated_allreduce_s("ring", "star:n=9", 500e6, size) == pytest.approx(16 / 9 * full, rel=1e-9)
    assert simulated_allreduce_s("gloo", "star:n=9", 500e6, size) is None
