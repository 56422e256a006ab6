"""``mlfabric bench tictac`` on local processes (1 server + 2 workers over TCP, no shaping): the
JSON's figures, the enforced order on every worker, the checks of the options.

    .venv/bin/python -m pytest tests/local/test_bench_tictac.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlfabric.bench.tictac import TicTacBenchConfig, r_squared, run_tictac_bench
from mlfabric.cli import app

pytestmark = pytest.mark.local


def test_small_run_enforces_the_order_and_reports_every_figure(tmp_path: Path) -> None:
    config = TicTacBenchConfig(model="inception", workers=2, iterations=6, warmup=1, forward_only=True,
                               rate_bps=100e6, chrome_dir=str(tmp_path), chrome_iterations=2)
    result = run_tictac_bench(config, capture_output=True)
    data = result.to_dict()
    assert [r["ordering"] for r in data["results"]] == ["none", "random", "tio", "tao"]
    for r in data["results"]:
        assert r["correct"] and r["reordered"] == 0
        assert r["steps_per_s"] > 0 and 0 < r["p50_step_s"] <= r["p95_step_s"]
        assert 0 <= r["straggler_effect"] < 1 and r["median_E"] is not None
        assert 1 / r["steps_per_s"] <= r["p95_step_s"] * 1.5  # steps/s and the steps agree
        simulated = (r["simulated_makespan_s"], r["simulated_even_share_s"], r["sim_over_emulated"],
                     r["even_share_sim_over_emulated"])
        if r["ordering"] == "none":  # one flat transfer: nothing to order
            assert simulated == (None, None, None, None)
        else:  # at least the model's compute (the per-op minimum), on loopback little more
            assert all(v is not None and v > 0 for v in simulated), r["ordering"]
            assert r["simulated_makespan_s"] == pytest.approx(r["sim_over_emulated"] * r["makespan_s"])
    assert data["plan"]["S"] == pytest.approx(1.0, abs=0.05)  # the emulated device balances the transfer
    assert set(data["speedup"]["vs_none"]) == {"none", "random", "tio", "tao"}
    assert "r2_E_vs_step" in data and set(data["r2_by_ordering"]) == {"none", "random", "tio", "tao"}
    for name, got in data["samples"].items():  # one (E, makespan, upper) per timed (worker, iteration)
        assert len(got["E"]) == len(got["makespan_s"]) == len(got["upper_s"]) == 2 * 5
        assert all(t > 0 and u > 0 for t, u in zip(got["makespan_s"], got["upper_s"])), name
    # Every worker received TIO's order: its trace's channel lane lists the transfers in it.
    tio_order = [f"recv:{k}" for k in data["plan"]["tio_order"]]
    events = json.loads((tmp_path / "tictac-inception-tio.json").read_text())["traceEvents"]
    for worker in (0, 1):
        lane = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == worker and e["tid"] == 1),
                      key=lambda e: e["ts"])
        assert [e["name"] for e in lane] == tio_order * 2  # two kept iterations
        assert any(e["tid"] == 0 for e in events if e.get("ph") == "X" and e["pid"] == worker)
    random_lanes = json.loads((tmp_path / "tictac-inception-random.json").read_text())["traceEvents"]
    names = [e["name"] for e in random_lanes if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == 1]
    assert sorted(names) == sorted(tio_order * 2) and names != tio_order * 2


def test_r_squared() -> None:
    assert r_squared([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(1.0)
    assert r_squared([0, 1, 2, 3], [1, -1, 1, -1]) == pytest.approx(0.2)
    assert r_squared([1, 1, 1], [1, 2, 3]) is None and r_squared([1, 2], [1, 2]) is None


def test_cli_refuses_bad_options_with_usage_errors() -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "tictac", "--ordering", "none,fifo"])
    assert bad.exit_code == 2 and "fifo" in bad.output
    bad = runner.invoke(app, ["bench", "tictac", "--model", "resnet"])
    assert bad.exit_code == 2 and "unknown model 'resnet'" in bad.output
    bad = runner.invoke(app, ["bench", "tictac", "--dag", "tensorflow"])
    assert bad.exit_code == 2 and "unknown dag 'tensorflow'" in bad.output
    bad = runner.invoke(app, ["bench", "tictac", "--pace", "sometimes"])
    assert bad.exit_code == 2 and "unknown pace 'sometimes'" in bad.output


@pytest.mark.parametrize(("pace", "forward_only", "paced"), [("auto", True, True), ("auto", False, False),
                                                             ("on", False, True), ("off", True, False)])
def test_pacing_follows_the_option_and_auto_paces_forward_passes_only(pace: str, forward_only: bool,
                                                                      paced: bool) -> None:
    assert TicTacBenchConfig(pace=pace, forward_only=forward_only, emulate=True).paced is paced
    assert not TicTacBenchConfig(pace="auto", forward_only=True).paced  # local processes: no NIC rate


def test_the_batch_defaults_per_model_and_an_explicit_one_is_kept() -> None:
    assert TicTacBenchConfig(model="vgg").batch == 8 and TicTacBenchConfig(model="alexnet").batch == 8
    assert TicTacBenchConfig(model="inception").batch == 1 and TicTacBenchConfig(model="seq32").batch == 1
    assert TicTacBenchConfig(model="vgg", batch=2).batch == 2
    with pytest.raises(ValueError, match="batch must be >= 1"):
        TicTacBenchConfig(model="vgg", batch=0)


def test_pacing_on_local_processes_is_refused() -> None:
    with pytest.raises(ValueError, match="pace on needs --emulate"):
        TicTacBenchConfig(pace="on")


def test_the_orders_are_computed_on_the_eager_dag_unless_asked_for_the_papers() -> None:
    """Inception: on the eager DAG TIO sends a block's 3x3 branch before its 1x1 projection
    branch ``bp`` (the forward runs it first); on the dataflow DAG, ``bp`` goes early."""
    from mlfabric.bench.tictac import plan

    def position(order: list[str], name: str) -> int:
        return order.index(name)

    eager = plan(TicTacBenchConfig(model="inception", forward_only=True)).priorities["tio"]
    dataflow = plan(TicTacBenchConfig(model="inception", forward_only=True, dag="dataflow")).priorities["tio"]
    by = {name: sorted(p, key=lambda k: (p[k], list(p).index(k))) for name, p in (("eager", eager),
                                                                                 ("dataflow", dataflow))}
    assert position(by["eager"], "block1.b3.weight") < position(by["eager"], "block1.bp.weight")
    assert position(by["dataflow"], "block1.bp.weight") < position(by["dataflow"], "block1.b3.weight")
