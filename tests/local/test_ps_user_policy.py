"""A user-written PS policy (examples/ps_policy_drop.py) through ``mlfabric train`` on real processes (issue 35, check 5).

    .venv/bin/python -m pytest tests/local/test_ps_user_policy.py -q

The example registers ``drop-alternate`` with ``mlfabric.ps.register_policy``; every rank of
the launch imports it through ``MLFABRIC_PS_PLUGINS``; ``--sync ps-bsp,ps-bsp@drop-alternate``
runs plain BSP and BSP routed by that policy side by side. Its effect must be in the run's
JSON: half the last worker's updates dropped at the server, the rest applied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlfabric.cli import app
from mlfabric.ps.policy import PLUGINS_ENV

pytestmark = pytest.mark.usefixtures("isolated_policy_registry")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ps_policy_drop.py"


def test_a_user_policy_runs_through_train_and_its_effect_is_in_the_json(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV, str(EXAMPLE))
    report = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["train", "--workload", "hyperplane", "--workers", "2", "--servers", "1",
                                      "--sync", "ps-bsp,ps-bsp@drop-alternate", "--dim", "32", "--train-samples",
                                      "1024", "--batch-size", "64", "--epochs", "2", "--out", str(tmp_path / "out"),
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    steps = data["config"]["steps"]
    assert steps >= 4 and steps % 2 == 0
    runs = {r["mode"]: r for r in data["runs"]}
    assert runs["ps-bsp"]["worker_updates_applied"] == 2 * steps and runs["ps-bsp"]["dropped"] == 0
    dropping = runs["ps-bsp@drop-alternate"]
    # the last worker's pushes at odd clocks never counted; the rounds went on with the other one
    assert dropping["dropped"] == steps // 2
    assert dropping["worker_updates_applied"] == 2 * steps - steps // 2
    assert dropping["updates_applied"] == steps  # one version per round still


def test_an_unknown_policy_in_a_mode_is_refused_naming_the_registered_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    result = CliRunner().invoke(app, ["train", "--workload", "hyperplane", "--workers", "2", "--servers", "1",
                                      "--sync", "ps-bsp@nope", "--epochs", "1"])
    assert result.exit_code != 0
    assert "unknown routing policy 'nope'" in result.output and "direct" in result.output
