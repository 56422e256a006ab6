"""`mlfabric train`'s lenet5 and mlp workloads on 2 local workers, the emulation settings'
validation and the non-root error (the emulated runs themselves: tests/emu/test_train_emulated.py).

    .venv/bin/python -m pytest tests/local/test_train_workloads.py -q
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mlfabric.train.harness import (WORKLOADS, EagerTrainConfig, TrainEmulation, run_eager_training)
from mlfabric.train.workloads import LeNet5Spec, LeNet5Task, MlpSpec, MlpTask

pytestmark = pytest.mark.local

# Tiny versions of the two tasks: a few seconds of training on 2 workers.
TINY = {
    # 2 epochs x 16 steps of 32 per worker; a bolder lr than the default's to get there in 32 steps.
    "lenet5": {"lenet5": LeNet5Spec(train_samples=1_024, val_samples=256), "epochs": 2, "lr": 0.05},
    "mlp": {"mlp": MlpSpec(train_samples=2_048, val_samples=1_024, hidden=64, depth=2), "epochs": 3},  # 3 x 16 of 64
}
# What each must gain over the initial model's validation accuracy (10 classes: ~10% at first).
GAIN = {"lenet5": 0.3, "mlp": 0.3}


def _initial_metric(config: EagerTrainConfig) -> float:
    """The validation metric of the model every run starts from (the harness seeds it so)."""
    task = config.task()
    torch.manual_seed(config.seed)
    return task.evaluate(task.model(), *task.val())[1]


@pytest.mark.parametrize("workload", ["lenet5", "mlp"])
def test_workload_trains_and_its_accuracy_rises(workload: str) -> None:
    config = EagerTrainConfig(workload=workload, workers=2, modes=("allreduce",), transport="tcp", timeout_s=120.0,
                              **TINY[workload])
    assert config.metric == "accuracy"
    initial = _initial_metric(config)
    result = run_eager_training(config, argv=["test"])
    (run,) = result.runs
    assert run.metric == "accuracy" and run.steps == config.steps == config.epochs_ * config.steps_per_epoch
    assert [p.epoch for p in run.curve] == list(range(1, config.epochs_ + 1))
    assert all(0.0 <= p.val_metric <= 1.0 for p in run.curve)
    assert run.final_metric >= initial + GAIN[workload], (initial, [p.val_metric for p in run.curve])
    assert run.curve[-1].train_loss < run.curve[0].train_loss
    assert result.metadata["emulation"] is None


def test_tree_allreduce_trains_like_allreduce_and_is_timed_to_the_target() -> None:
    """Tr-Sync (tree-allreduce) averages the same gradients as RR-Sync: the same model, up to
    float summation order; --target times both to one accuracy; the emulated accelerator time
    (compute_time_s) is slept on every step."""
    spec = LeNet5Spec(train_samples=512, val_samples=256, image_size=16, compute_time_s=0.02)
    config = EagerTrainConfig(workload="lenet5", workers=2, modes=("allreduce", "tree-allreduce"), transport="tcp",
                              timeout_s=120.0, lenet5=spec, epochs=2, lr=0.05, target=0.2)
    result = run_eager_training(config, argv=["test"])
    ring, tree = result.runs
    assert tree.mode == "tree-allreduce" and abs(tree.final_metric - ring.final_metric) <= 1 / 256
    assert [p.val_metric for p in tree.curve] == pytest.approx([p.val_metric for p in ring.curve], abs=1 / 256)
    assert ring.loop_s >= config.steps * 0.02  # 8 steps x 2 epochs, each sleeping 20 ms
    # every worker's measured step compute: at least the emulated device time, over all steps
    for run in (ring, tree):
        assert run.compute_s is not None and run.compute_s["steps"] == 2 * config.steps
        assert 0.02 <= run.compute_s["mean"] < ring.loop_s / config.steps and run.compute_s["cv"] >= 0
        assert run.compute_s["mean"] <= run.compute_s["slowest_mean"] < ring.loop_s / config.steps
        assert run.exchange_s is not None and 0 <= run.exchange_s["cpu"] <= run.exchange_s["wall"] * 1.05 + 1e-3
    (comparison,) = result.comparisons()
    assert comparison["mode"] == "tree-allreduce" and comparison["target"] == 0.2 == result.target("none")
    reach, sync_reach = tree.time_to(0.2), ring.time_to(0.2)
    assert reach is not None and sync_reach is not None
    assert comparison["time_speedup"] == pytest.approx(sync_reach / reach)


def test_classification_tasks_shard_and_repeat() -> None:
    lenet = LeNet5Task(LeNet5Spec(train_samples=100, val_samples=20), seed=3)
    x0, y0 = lenet.shard(0, 3)
    x2, y2 = lenet.shard(2, 3)
    assert x0.shape == (34, 1, 28, 28) and x2.shape == (33, 1, 28, 28) and y0.dtype == torch.int64
    again = LeNet5Task(LeNet5Spec(train_samples=100, val_samples=20), seed=3)
    assert torch.equal(again.shard(2, 3)[0], x2) and torch.equal(again.val()[1], lenet.val()[1])
    assert not torch.equal(LeNet5Task(LeNet5Spec(train_samples=100, val_samples=20), seed=4).val()[0], lenet.val()[0])
    mlp = MlpTask(MlpSpec(train_samples=10, val_samples=5, hidden=8, depth=1))
    shards = [mlp.shard(r, 2)[1] for r in range(2)]
    assert sum(s.numel() for s in shards) == 10
    with pytest.raises(ValueError, match="without data"):
        mlp.shard(10, 11)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: EagerTrainConfig(workload="resnet"), "hyperplane, lstm, lenet5, mlp"),
    (lambda: LeNet5Spec(image_size=30), "divisible by 4"),
    (lambda: LeNet5Spec(classes=1), "classes must be >= 2"),
    (lambda: MlpSpec(depth=0), "sizes must be positive"),
    (lambda: EagerTrainConfig(workload="lenet5", workers=2, lenet5=LeNet5Spec(train_samples=32)),
     "less than one batch of 32"),
    (lambda: EagerTrainConfig(workload="mlp", mlp=LeNet5Spec()), "mlp must be a MlpSpec"),
    (lambda: TrainEmulation(rate_bps=100.0), "at least 8 kbit/s"),
    (lambda: TrainEmulation(churn="N9"), "N1, N2, N3"),
    (lambda: TrainEmulation(churn="N1", churn_period_s=0.0), "positive number of seconds"),
    (lambda: EagerTrainConfig(emulation="1gbit"), "TrainEmulation or None"),
    (lambda: LeNet5Spec(compute_time_s=-0.1), "compute_time_s must be"),
    (lambda: MlpSpec(compute_time_s=float("nan")), "compute_time_s must be"),
    (lambda: EagerTrainConfig(target=float("inf")), "target must be a finite"),
    (lambda: EagerTrainConfig(modes=("rr-sync",)), "tree-allreduce"),
])
def test_config_errors_are_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_config_is_frozen_keyword_only_and_resolves_defaults() -> None:
    config = EagerTrainConfig(workload="lenet5", workers=4, emulation=TrainEmulation(rate_bps=1e9, churn="N2"))
    assert set(WORKLOADS) == {"hyperplane", "lstm", "lenet5", "mlp", "lda"}
    assert (config.batch_size_, config.lr_, config.momentum_, config.epochs_) == (32, 0.02, 0.9, 4)
    assert config.task().device_time(None) == 0.0  # no emulated accelerator unless asked
    assert LeNet5Task(LeNet5Spec(compute_time_s=0.06)).device_time(None) == 0.06
    assert config.steps_per_epoch == 4_096 // 4 // 32 and config.spec is config.lenet5
    assert EagerTrainConfig(workload="mlp", workers=4).steps_per_epoch == 32_768 // 4 // 64
    assert TrainEmulation.topology(5) == "star:n=5"
    with pytest.raises(FrozenInstanceError):
        config.workers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        EagerTrainConfig("lenet5")  # type: ignore[misc]


def test_emulate_without_root_says_to_use_root(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlfabric.emu.cmd
    from mlfabric.cli import app

    monkeypatch.setattr(mlfabric.emu.cmd, "have_root", lambda: False)
    config = EagerTrainConfig(workload="mlp", workers=2, modes=("allreduce",), emulation=TrainEmulation())
    with pytest.raises(mlfabric.emu.cmd.EmuUnavailableError, match=r"needs root.*sudo \.venv/bin/mlfabric"):
        run_eager_training(config)
    result = CliRunner().invoke(app, ["train", "--workload", "mlp", "--workers", "2", "--sync", "allreduce",
                                      "--emulate", "--rate", "100mbit"], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "needs root" in result.output and "sudo .venv/bin/mlfabric" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--churn", "N1"], "add --emulate"),
    (["--rate", "1gbit"], "add --emulate"),
    (["--emulate", "--churn", "N7"], "N1, N2, N3"),
    (["--emulate", "--rate", "fast"], "rate"),
    (["--emulate", "--churn-period", "2s"], "needs --churn"),
    (["--image-size", "16"], "--image-size applies to lenet5"),
    (["--compute-time", "soon"], "duration"),
])
def test_train_cli_rejects_bad_emulation_options(args: list[str], message: str) -> None:
    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["train", "--workload", "mlp", "--workers", "2", "--sync", "allreduce", *args],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output


class _FakeCluster:
    """What the shared churn helper needs of a Cluster: its plan and set_rates."""

    def __init__(self) -> None:
        from mlfabric.emu.cluster import plan_cluster
        from mlfabric.topo.spec import TopologySpec

        self.plan = plan_cluster(TopologySpec.parse("star:n=3"), 1e9, prefix="mf0000")
        self.changes: list[list[tuple[int, int, str, float]]] = []

    def set_rates(self, changes: list[tuple[int, int, str, float]]) -> None:
        self.changes.append(list(changes))


def test_shared_churn_helper_applies_the_first_redraw_and_traces(tmp_path: Any) -> None:
    from mlfabric.emu.launcher import churned_rank_envs, start_churn
    from mlfabric.runtime.fair_share import NIC_RATE_ENV

    cluster = _FakeCluster()
    seen: list[float] = []
    runner = start_churn(cluster, "N3", rate_bps=1e9, period_s=60.0, seed=1,  # type: ignore[arg-type]
                         trace_path=str(tmp_path / "trace.csv"), on_apply=lambda t, rows: seen.append(t))
    runner.stop()
    assert seen == [0.0] and len(cluster.changes) == 1 and len(cluster.changes[0]) == 3 * 2
    assert {rate for *_, rate in cluster.changes[0]} <= {1e8, 1e9}
    assert len((tmp_path / "trace.csv").read_text().splitlines()) == 1 + 6
    envs = churned_rank_envs(cluster.plan.rank_envs())
    assert all(NIC_RATE_ENV not in env and "MLFABRIC_CHANNEL_ADDRS" in env for env in envs)
