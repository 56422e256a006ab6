"""``mlfabric bench grad-order`` on local processes (2 ranks over TCP, no shaping): the plan's
emulated backward, the orders each ordering ran, the JSON's figures, the checks of the options.

    .venv/bin/python -m pytest tests/local/test_bench_grad_order.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlfabric.bench.grad_order import GradOrderBenchConfig, plan
from mlfabric.cli import app

pytestmark = pytest.mark.local


def test_the_plan_runs_the_backward_last_module_first_and_balances_compute_and_allreduce() -> None:
    config = GradOrderBenchConfig(model="vgg", workers=4)
    p = plan(config)
    forward = sum(p.device_time.values())
    assert p.backward_time == pytest.approx(2 * forward)
    # S = 1: forward + backward = the model's ring allreduce at the rate (2(n-1)/n of it sent).
    assert forward + p.backward_time == pytest.approx(p.allreduce_s, rel=0.02)
    assert p.allreduce_s == pytest.approx(p.model_bytes * 1.5 / (1e9 / 8 * 1448 / 1514))
    # The first layer's gradient is ready last, at the end of the backward; the last layer's first.
    assert p.ready_offset["0.weight"] == pytest.approx(p.backward_time)
    assert p.ready_offset["18.weight"] == min(p.ready_offset.values()) > 0
    assert p.priorities["tio"]["0.weight"] < p.priorities["tio"]["18.weight"]
    # ByteScheduler's priorities: the declaration order (here also the order of first use).
    assert list(p.priorities["bytescheduler"].values()) == list(range(16))
    assert sorted(p.priorities["bytescheduler"], key=p.priorities["bytescheduler"].get) == \
        sorted(p.priorities["tio"], key=p.priorities["tio"].get)


def test_cli_runs_every_ordering_and_they_train_the_same_model(tmp_path: Path) -> None:
    out = tmp_path / "go.json"
    got = CliRunner().invoke(app, ["bench", "grad-order", "--model", "vgg", "--workers", "2", "--iterations", "8",
                                   "--rounds", "2", "--warmup", "2", "--partition", "256KiB", "-q", "--json",
                                   str(out)])
    assert got.exit_code == 0, got.output
    data = json.loads(out.read_text())
    assert [r["ordering"] for r in data["results"]] == ["ddp", "fifo", "bytescheduler", "tio", "tao"]
    assert {k: len(v) for k, v in data["steps_s"].items()} == dict.fromkeys(data["speedup_vs_ddp"], 5)  # 2 + 3
    for r in data["results"]:
        assert r["correct"], r  # every rank and every ordering: the same parameters
        assert r["steps_per_s"] > 0 and 0 < r["p50_step_s"] <= r["p95_step_s"] and r["comm_wait_s"] >= 0
    assert set(data["speedup_vs_ddp"]) == {"ddp", "fifo", "bytescheduler", "tio", "tao"}
    assert data["speedup_vs_ddp"]["ddp"] == 1.0
    orders = data["orders"]
    assert orders["ddp"] == orders["fifo"]  # first come, first served: the last layer first...
    # (16.weight in 1 MiB / 256 KiB pieces; 16.bias + the classifier fused: ready together)
    assert orders["ddp"][:5] == [f"16.weight[{k * 65536}:{(k + 1) * 65536}]" for k in range(4)] + [
        "16.bias+18.weight+18.bias"]
    assert orders["ddp"][-1].startswith("0.weight+0.bias+")
    # The priority order: the same partitions (on unshaped loopback the link keeps up with the
    # backward, so little overtakes; tests/local/test_ordered_allreduce.py has a queue).
    assert sorted(orders["tio"]) == sorted(orders["ddp"]) and orders["tio"][0].startswith("16.")
    assert "--partition 256KiB" in data["command"]


@pytest.mark.parametrize("options, message", [
    (["--ordering", "ddp,bogus"], "unknown ordering 'bogus'"),
    (["--workers", "1"], "workers >= 2"),
    (["--warmup", "1"], "need 2 <= warmup"),
    (["--iterations", "40", "--rounds", "3"], "rounds must be >= 1"),
    (["--iterations", "40", "--rounds", "10", "--warmup", "3"], "got 3, 4"),
    (["--partition", "128kb"], "lower-case 'b'"),
])
def test_cli_refuses_bad_options(options: list[str], message: str) -> None:
    got = CliRunner().invoke(app, ["bench", "grad-order", "-q", *options])
    assert got.exit_code != 0 and message in got.output, got.output


def test_timed_iterations_skip_the_warm_up_and_each_later_rounds_first() -> None:
    config = GradOrderBenchConfig(iterations=100, rounds=5, warmup=5)
    assert config.timed_rounds() == [range(5, 20), range(21, 40), range(41, 60), range(61, 80), range(81, 100)]
    assert len(config.timed()) == 91
    assert GradOrderBenchConfig(iterations=40, warmup=5).timed() == list(range(5, 40))
