"""`mlfabric train --workload lda` on 2 local workers: allreduce and ps-async sweep a tiny
synthetic corpus, the held-out log-likelihood rises, and the JSON reports iterations to target.

    .venv/bin/python -m pytest tests/local/test_train_lda.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlfabric.cli import app
from mlfabric.train.harness import EagerTrainConfig
from mlfabric.train.lda import LdaSpec

pytestmark = pytest.mark.local

TINY = ["--topics", "8", "--vocabulary", "300", "--documents", "256", "--held-out", "64", "--doc-length", "40"]


def test_train_lda_cli_runs_allreduce_and_ps_async(tmp_path: Path) -> None:
    config = EagerTrainConfig(workload="lda", workers=2, modes=("allreduce",), batch_size=64,
                              lda=LdaSpec(topics=8, vocabulary=300, documents=256, held_out=64, doc_length=40))
    task = config.task()
    initial = task.evaluate(task.model(), *task.val())[1]
    goal = round(initial + 0.1, 3)
    out = tmp_path / "lda.json"
    result = CliRunner().invoke(app, ["train", "--workload", "lda", "--workers", "2", "--servers", "1", "--sync",
                                      "allreduce,ps-async", "--transport", "tcp", "--epochs", "6", "--batch-size",
                                      "64", "--timeout", "120", "--no-plot", "--out", str(tmp_path), "--json",
                                      str(out), "--target", str(goal), *TINY])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["config"]["lda"]["topics"] == 8 and data["config"]["lr"] == 1.0 and data["config"]["steps"] == 12
    assert "--topics 8" in data["metadata"]["command"]
    runs = {r["mode"]: r for r in data["runs"]}
    for mode, run in runs.items():
        curve = [p["val_metric"] for p in run["curve"]]
        assert run["metric"] == "log-likelihood" and len(curve) == 6
        assert curve[-1] > initial + 0.15, (mode, initial, curve)  # nats per held-out token
        assert run["final_metric"] > initial + 0.15
    # ps-async: an epoch is 2 steps' worth of updates of 2 workers, all applied (no bound, no drop).
    assert runs["ps-async"]["worker_updates_applied"] >= 6 * 2 * 2 and runs["ps-async"]["dropped"] == 0
    (comparison,) = data["comparisons"]
    assert comparison["target"] == goal
    steps = next(p["step"] for p in runs["ps-async"]["curve"] if p["val_metric"] >= goal)
    sync_steps = next(p["step"] for p in runs["allreduce"]["curve"] if p["val_metric"] >= goal)
    assert comparison["iterations_to_target"] == steps and comparison["sync_iterations_to_target"] == sync_steps
    assert "LL" in result.output and "log-likelihood" in result.output
