"""``mlfabric train --fail server:AT`` on local processes (issue #23, check 3's harness): server
0's process is SIGKILLed mid-run, its replica takes over, the workers go on without
restarting, and the run reports failover_s, the model lost and its accuracy; bad failure
settings are refused before anything starts.

    .venv/bin/python -m pytest tests/local/test_ps_failover_train.py -q
"""

from __future__ import annotations

import time

import pytest

from mlfabric.train.harness import EagerTrainConfig, run_eager_training
from mlfabric.train.failover import Failure
from mlfabric.train.workloads import HyperplaneSpec


def _config(**changes: object) -> EagerTrainConfig:
    options: dict = dict(workload="hyperplane", workers=3, modes=("mlfabric-a:6",), servers=1, replicas=1, epochs=6,
                         batch_size=64, hyperplane=HyperplaneSpec(dim=64, train_samples=2048), transport="tcp",
                         timeout_s=60.0, replication="network", div_max="2.0")
    return EagerTrainConfig(**{**options, **changes})


def test_a_killed_server_is_replaced_by_its_replica_and_the_run_ends_as_unfailed() -> None:
    """MLfabric-A with network replication and two replicas: the first takes over the shard
    and the scheduler within 2 s, the second follows it; the model lost is within Div_max;
    the run ends at the accuracy of the same run without the failure."""
    (baseline,) = run_eager_training(_config(replicas=2), argv=["test"]).runs
    started = time.monotonic()
    (failed,) = run_eager_training(_config(replicas=2, fail="server:0.25"), argv=["test"]).runs
    assert time.monotonic() - started < 60  # nothing hung
    ps = failed.ps
    assert ps is not None
    assert 0 < ps["failover_s"] < 2.0 and 0 < ps["takeover_s"] <= ps["failover_s"] + 0.2
    assert ps["lost_divergence"] is not None and ps["lost_divergence"] <= 2.0
    assert ps["takeover_version"] <= ps["killed_version"]
    assert ps["killed_version"] - ps["takeover_version"] <= ps["lost_updates"] + 6  # what the notes did not name
    assert ps["worker_updates_applied"] > 0  # by the replica, after the takeover
    assert ps["worker_failovers"] == [1, 1, 1] and baseline.ps["worker_failovers"] == [0, 0, 0]
    # the same accuracy (MSE) as the unfailed run, to 10 %
    assert failed.final_metric <= baseline.final_metric * 1.10, (failed.final_metric, baseline.final_metric)
    assert failed.curve[-1].val_metric < failed.curve[0].val_metric


def test_chain_replication_under_ssp_fails_over_too() -> None:
    # ~0.6 s of training (ps-ssp is quicker than mlfabric-a here): killed a third of the way
    config = _config(modes=("ps-ssp:2",), replication="chain", div_max=None, epochs=30, fail="server:0.2")
    (run,) = run_eager_training(config, argv=["test"]).runs
    ps = run.ps
    assert ps is not None and 0 < ps["failover_s"] < 2.0
    # chain replication forwards each update as it is applied: at most what was in flight is lost
    assert ps["killed_version"] - ps["takeover_version"] <= 3
    assert run.curve[-1].val_metric < run.curve[0].val_metric


def test_a_failure_after_the_run_is_reported_not_ignored() -> None:
    from mlfabric.train.failover import FailoverError

    with pytest.raises(FailoverError, match="still alive at the end of the run"):
        run_eager_training(_config(epochs=1, fail="server:60"), argv=["test"])


@pytest.mark.parametrize(("changes", "message"), [
    ({"fail": "server"}, "expected server:AT"),
    ({"fail": "worker:3"}, "expected server:AT"),
    ({"fail": "aggregator:1", "replicas": 0, "replication": "chain", "div_max": None}, "run an mlnet mode"),
    ({"fail": "server:-1"}, "expected server:AT"),
    ({"fail": "server:0"}, "must be positive"),
    ({"fail": "server:2", "replicas": 0, "replication": "chain", "div_max": None}, "needs --replicas 1"),
    ({"fail": "server:2", "modes": ("ps-bsp",), "replication": "chain", "div_max": None}, "a round in flight"),
    ({"fail": "server:2", "servers": 2, "replicas": 2}, "follow server 0's scheduler"),
    ({"fail": "server:2", "modes": ("mlfabric-a:6", "ps-async")}, "exactly one parameter-server mode"),
])
def test_bad_failure_settings_are_refused_at_once(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_failure_times_parse_in_seconds() -> None:
    assert Failure.parse("server:6") == Failure(role="server", at_s=6.0)
    assert Failure.parse("server:2.5s").at_s == 2.5
    assert Failure.parse("aggregator:300ms") == Failure(role="aggregator", at_s=pytest.approx(0.3))
