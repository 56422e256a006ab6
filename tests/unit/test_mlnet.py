"""MLNET §4 experiments (mlfabric/sim/mlnet.py) at small scale: result structure, bytes at
the servers' NICs, scale invariance, determinism, argument checks and ``mlfabric simulate mlnet``.

    .venv/bin/python -m pytest tests/unit/test_mlnet.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mlfabric.cli import app
from mlfabric.sim import PSConfig, ps_placement, rack_of
from mlfabric.sim import mlnet
from mlfabric.sim.mlnet import (
    PAPER_FIG1,
    JobsConfig,
    SweepConfig,
    job_priorities,
    mlnet_placement,
    paper_expectation,
    run_jobs,
    run_sweep,
    sweep_topology,
)

# k=8: 128 hosts, 4 per ToR. 32 workers and 4 servers: shards of exactly 1 MB.
SMALL = dict(k=8, workers=32, servers=(4,), oversub=(1.0, 4.0), update_bytes=4e6, compute_s=2.0, batch_rtol=1e-9)


def _without_wall(runs: list[dict]) -> list[dict]:
    return [{k: v for k, v in run.items() if k != "wall_s"} for run in runs]


def test_sweep_structure_and_json() -> None:
    result = run_sweep(SweepConfig(**SMALL))
    assert set(result) == {"config", "runs", "summary"}
    assert [(r["oversub"], r["strategy"]) for r in result["runs"]] == [
        (1.0, "baseline"), (1.0, "binary"), (1.0, "rack"), (4.0, "baseline"), (4.0, "binary"), (4.0, "rack")]
    assert len(result["summary"]) == 6
    for row in result["summary"]:
        assert row["seeds"] == [0] and row["servers"] == 4
        if row["strategy"] == "baseline":
            assert row["ratio"] == row["comm_ratio"] == row["server_nic_bytes_ratio"] == 1.0
            assert row["paper"] == "1"
        else:
            assert 0 < row["ratio"] < 1 and 0 < row["comm_ratio"] < row["ratio"]  # compute dilutes the gain
    for run in result["runs"]:
        assert run["comm_s"] == pytest.approx(run["makespan_s"] - 2.0, abs=1e-12)
        assert run["flows"] == 2 * 32 * 4 and run["colocated_servers"] == 0
    assert result["config"]["servers"] == [4] and result["config"]["batch_rtol"] == 1e-9
    assert json.loads(json.dumps(result)) == result  # plain JSON-serialisable data


def test_trees_move_fewer_bytes_through_server_nics() -> None:
    config = SweepConfig(**{**SMALL, "oversub": (1.0,)})
    result = run_sweep(config)
    by = {r["strategy"]: r for r in result["runs"]}
    topo = sweep_topology(8, 1.0, "10Gbps")
    workers, _ = mlnet_placement(topo, 32, 4, 0)
    racks = np.unique(rack_of(topo, workers)).size
    shard = 4e6 / 4
    # Each server receives and sends one shard per child: 32 workers, 2 (binary), one per rack.
    assert by["baseline"]["server_nic_bytes"] == pytest.approx(4 * 2 * 32 * shard, rel=1e-12)
    assert by["binary"]["server_nic_bytes"] == pytest.approx(4 * 2 * 2 * shard, rel=1e-12)
    assert by["rack"]["server_nic_bytes"] == pytest.approx(4 * 2 * racks * shard, rel=1e-12)
    assert 2 < racks < 32
    ratios = {r["strategy"]: r["server_nic_bytes_ratio"] for r in result["summary"]}
    assert ratios == pytest.approx({"baseline": 1.0, "binary": 2 / 32, "rack": racks / 32}, rel=1e-12)
    # The same data in total moves over more hops with trees (forwarding through workers).
    assert by["binary"]["total_link_bytes"] > 0 and by["baseline"]["max_link_bytes"] > by["rack"]["max_link_bytes"]


def test_comm_ratio_is_independent_of_update_size_and_compute_shifts() -> None:
    base = dict(SMALL, oversub=(4.0,), batch_rtol=0.0)
    small = run_sweep(SweepConfig(**{**base, "update_bytes": 4e6, "compute_s": 0.0}))
    large = run_sweep(SweepConfig(**{**base, "update_bytes": 4e9, "compute_s": 0.0}))
    shifted = run_sweep(SweepConfig(**{**base, "update_bytes": 4e6, "compute_s": 3.0}))
    for a, b, c in zip(small["runs"], large["runs"], shifted["runs"]):
        assert b["makespan_s"] == pytest.approx(1000 * a["makespan_s"], rel=1e-9)  # fluid model: linear in bytes
        assert c["makespan_s"] == pytest.approx(3.0 + a["makespan_s"], rel=1e-9)  # uniform compute: a shift
    for a, b in zip(small["summary"], large["summary"]):
        assert a["comm_ratio"] == pytest.approx(b["comm_ratio"], rel=1e-9)
        assert a["ratio"] == pytest.approx(a["comm_ratio"], rel=1e-9)


def test_batching_moves_makespans_by_less_than_half_a_percent() -> None:
    exact = run_sweep(SweepConfig(**{**SMALL, "batch_rtol": 1e-9}))
    batched = run_sweep(SweepConfig(**{**SMALL, "batch_rtol": 1e-3}))
    for a, b in zip(exact["runs"], batched["runs"]):
        assert b["makespan_s"] == pytest.approx(a["makespan_s"], rel=5e-3)
        assert b["server_nic_bytes"] == a["server_nic_bytes"]


def test_placement_is_deterministic_and_shares_hosts_only_when_needed() -> None:
    topo = sweep_topology(4, 1.0, "10Gbps")  # 16 hosts
    workers, servers = mlnet_placement(topo, 8, 6, seed=3)
    same = ps_placement(topo, PSConfig(workers=8, servers=6, model_bytes=0), 3)
    assert workers.tolist() == same[0].tolist() and servers.tolist() == same[1].tolist()
    assert not set(workers.tolist()) & set(servers.tolist())
    workers, servers = mlnet_placement(topo, 12, 6, seed=3)  # 4 free hosts, then 2 worker hosts
    assert len(set(workers.tolist())) == 12 and len(set(servers.tolist())) == 6
    assert np.isin(servers[:4], workers).sum() == 0 and servers[4:].tolist() == workers[:2].tolist()
    workers, servers = mlnet_placement(topo, 16, 3, seed=3)  # every host has a worker
    assert sorted(workers.tolist()) == list(range(16)) and servers.tolist() == workers[:3].tolist()
    with pytest.raises(ValueError, match="at most 16 of each"):
        mlnet_placement(topo, 17, 1, seed=0)


def test_sweep_is_deterministic_for_a_seed() -> None:
    # k=4: 16 hosts, so 12 workers + 6 servers put 2 servers on worker hosts.
    fields = dict(k=4, workers=12, servers=(6,), oversub=(4.0,), update_bytes=6e6)
    first, second = run_sweep(SweepConfig(**fields)), run_sweep(SweepConfig(**fields))
    assert _without_wall(first["runs"]) == _without_wall(second["runs"])
    assert first["summary"] == second["summary"]
    assert [r["colocated_servers"] for r in first["runs"]] == [2, 2, 2]
    other = run_sweep(SweepConfig(**fields, seeds=(1,)))
    assert [r["makespan_s"] for r in other["runs"]] != [r["makespan_s"] for r in first["runs"]]


def test_seeds_are_averaged() -> None:
    result = run_sweep(SweepConfig(**{**SMALL, "oversub": (4.0,), "seeds": (0, 1)}))
    assert len(result["runs"]) == 6
    for row in result["summary"]:
        members = [r for r in result["runs"] if r["strategy"] == row["strategy"]]
        base = {r["seed"]: r["makespan_s"] for r in result["runs"] if r["strategy"] == "baseline"}
        ratios = [m["makespan_s"] / base[m["seed"]] for m in members]
        assert row["seeds"] == [0, 1]
        assert row["ratio"] == pytest.approx(np.mean(ratios), rel=1e-12)
        assert row["ratio_min"] == pytest.approx(min(ratios)) and row["ratio_max"] == pytest.approx(max(ratios))


def test_jobs_experiment() -> None:
    config = JobsConfig(k=8, jobs=6, workers=12, servers=3, update_bytes=3e6, compute_s=1.0, batch_rtol=1e-9)
    result = run_jobs(config)
    assert [(r["strategy"], r["priorities"]) for r in result["runs"]] == [
        ("baseline", False), ("baseline", True), ("rack", False), ("rack", True)]
    prios = job_priorities(6, 0)
    assert sorted(prios) == list(range(6)) and prios == job_priorities(6, 0) and prios != job_priorities(6, 1)
    for run in result["runs"]:
        assert len(run["job_makespan_s"]) == 6 and run["flows"] == 6 * 2 * 12 * 3
        assert run["job_priority"] == (prios if run["priorities"] else [0] * 6)
        assert run["makespan_s"] == pytest.approx(max(run["job_makespan_s"]))
        assert min(run["job_makespan_s"]) > 1.0  # compute, then traffic
    fair, prio = result["runs"][0], result["runs"][1]
    top = prios.index(0)
    assert prio["job_makespan_s"][top] <= fair["job_makespan_s"][top] * (1 + 1e-9)  # class 0 goes first
    stats = result["summary"]["conditions"]
    assert set(stats) == {"baseline", "baseline+priorities", "rack", "rack+priorities"}
    assert stats["baseline"]["median_s"] == pytest.approx(float(np.median(fair["job_makespan_s"])))
    assert stats["baseline"]["max_s"] == pytest.approx(max(fair["job_makespan_s"]))
    assert stats["baseline"]["median_s"] <= stats["baseline"]["p95_s"] <= stats["baseline"]["max_s"]
    changes = {c["name"]: c for c in result["summary"]["changes"]}
    assert changes["priorities_vs_fair_median"]["paper"] == -0.25
    assert changes["priorities_vs_fair_median"]["ours"] == pytest.approx(
        stats["baseline+priorities"]["median_s"] / stats["baseline"]["median_s"] - 1)
    assert changes["rack_priorities_vs_rack_median"]["paper"] == -0.139
    assert changes["rack_priorities_vs_baseline_p95"]["paper"] == -0.54
    assert json.loads(json.dumps(result)) == result


def test_paper_figures() -> None:
    assert PAPER_FIG1[(1.0, 50)] == {"binary": 0.22, "rack": 0.42}
    assert PAPER_FIG1[(4.0, 400)]["rack"] == pytest.approx(0.29)
    assert PAPER_FIG1[(4.0, 50)]["binary"] == pytest.approx(0.34)
    assert paper_expectation(1, 50, "binary") == "0.22" and paper_expectation(4, 400, "binary") == "0.60"
    assert paper_expectation(1, 300, "rack") == "> 1" and paper_expectation(4, 200, "rack") == "< 1"
    assert paper_expectation(1, 100, "rack") == "<1, less" and paper_expectation(4, 100, "baseline") == "1"


@pytest.mark.parametrize(("fields", "message"), [
    ({"servers": (0,)}, "server counts must be in"),
    ({"servers": (2000,)}, "server counts must be in"),
    ({"servers": ()}, "server counts must be in"),
    ({"oversub": (0.5,)}, "oversubscription ratios must be finite and >= 1"),
    ({"strategies": ("binary", "rack")}, "must include 'baseline'"),
    ({"strategies": ("baseline", "ring")}, "unknown strategies"),
    ({"seeds": ()}, "at least one seed"),
    ({"seeds": (-1,)}, "seeds must be >= 0"),
    ({"update_bytes": 0.0}, "update_bytes must be finite and > 0"),
    ({"compute_s": -1.0}, "compute_s must be finite and >= 0"),
    ({"k": 5}, "must be even"),
    ({"workers": 2000}, "do not fit on the 1024 hosts"),
    ({"routing": "random"}, "routing must be one of"),
    ({"barrier": "none"}, "barrier must be"),
    ({"batch_rtol": 0.1}, "batch_rtol must be in"),
])
def test_sweep_config_errors(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SweepConfig(**fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"jobs": 1}, "needs >= 2 jobs"),
    ({"workers": 1000, "servers": 50}, "on distinct hosts"),
    ({"oversub": 0.0}, "oversub must be finite and >= 1"),
    ({"strategies": ()}, "non-empty subset"),
    ({"strategies": ("tree",)}, "non-empty subset"),
])
def test_jobs_config_errors(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobsConfig(**fields)


@pytest.fixture
def tiny_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlnet, "quick_configs", lambda: (
        SweepConfig(k=4, workers=8, servers=(2, 4)), JobsConfig(k=4, jobs=3, workers=4, servers=2)))


def test_cli_simulate_mlnet(tmp_path: Path, tiny_quick: None) -> None:
    out = tmp_path / "mlnet.json"
    result = CliRunner().invoke(app, ["simulate", "mlnet", "--quick", "--oversub", "1,4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Fig. 1a" in result.output and "Fig. 1b" in result.output and "BINARY" in result.output
    assert "rack+priorities" in result.output and "-25.0%" in result.output
    data = json.loads(out.read_text())
    assert data["command"].startswith("mlfabric simulate mlnet --quick --servers 2,4 --oversub 1,4 --seeds 0")
    assert len(data["sweep"]["runs"]) == 2 * 2 * 3 and len(data["jobs"]["runs"]) == 4
    assert data["sweep"]["config"]["update_bytes"] == 260e9 and data["jobs"]["config"]["jobs"] == 3
    only = CliRunner().invoke(app, ["simulate", "mlnet", "--quick", "--no-jobs-experiment", "--servers", "2",
                                    "--oversub", "4", "--strategies", "baseline,rack"])
    assert only.exit_code == 0, only.output
    assert "Fig. 1b" in only.output and "Fig. 1a" not in only.output and "BINARY" not in only.output
    assert "Fig. 3" not in only.output


@pytest.mark.parametrize(("args", "message"), [
    (["--servers", "0"], "server counts must be in"),
    (["--servers", "a,b"], "invalid literal"),
    (["--oversub", "0.5"], "oversubscription ratios"),
    (["--strategies", "binary"], "must include 'baseline'"),
    (["--no-sweep", "--no-jobs-experiment"], "nothing to run"),
    (["--update-size", "lots"], "size"),
    (["--seeds", ""], "comma-separated list of seeds"),
])
def test_cli_simulate_mlnet_errors(args: list[str], message: str, tiny_quick: None) -> None:
    result = CliRunner().invoke(app, ["simulate", "mlnet", "--quick", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
