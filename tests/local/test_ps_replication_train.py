"""``mlfabric train --replicas 1 --replication network --div-max X`` on local processes: the
replica's true divergence at every batch end within Div_max and under the eq. (11) estimate
(issue #23, check 1), the same fields for chain replication, and bad settings refused.

    .venv/bin/python -m pytest tests/local/test_ps_replication_train.py -q
"""

from __future__ import annotations

import pytest

from mlfabric.train.harness import EagerTrainConfig, run_eager_training
from mlfabric.train.workloads import HyperplaneSpec

REL = 1e-5  # float32 models: the estimate (from norms, in double) may sit a rounding below


def _config(**changes: object) -> EagerTrainConfig:
    options: dict = dict(workload="hyperplane", workers=3, modes=("mlfabric-a:6",), servers=1, replicas=1, epochs=2,
                         batch_size=64, hyperplane=HyperplaneSpec(dim=64, train_samples=1024), transport="tcp",
                         timeout_s=60.0)
    return EagerTrainConfig(**{**options, **changes})


def test_train_with_network_replication_keeps_the_replica_within_div_max() -> None:
    div_max = 1.5  # the first updates' norm bounds are ~0.8: the replica may lag one, rarely two
    (run,) = run_eager_training(_config(replication="network", div_max=str(div_max)), argv=["test"]).runs
    ps = run.ps
    assert ps is not None and ps["worker_updates_applied"] > 0
    assert ps["divergence_probes"] == ps["scheduler_batches"] > 0  # one measurement per batch end
    assert ps["bound_overruns"] == 0
    assert 0 <= ps["max_divergence"] <= div_max * (1 + REL)
    assert ps["max_divergence_estimate"] * (1 + REL) >= ps["max_divergence"]
    model_bytes = (64 + 1) * 4
    # the model once from the server, then every unit's update from the workers
    assert ps["replica_bytes"] >= model_bytes * (1 + ps["updates_applied"]) - 1
    assert run.curve[-1].val_metric < run.curve[0].val_metric


def test_train_with_chain_replication_reports_the_same_fields() -> None:
    (run,) = run_eager_training(_config(), argv=["test"]).runs
    ps = run.ps
    assert ps is not None and ps["divergence_probes"] == ps["scheduler_batches"] > 0
    assert ps["max_divergence_estimate"] * (1 + REL) >= ps["max_divergence"] >= 0
    assert ps["replica_bytes"] == (64 + 1) * 4 * (1 + ps["updates_applied"])
    assert len(ps["server_nic_bytes"]) == 1 and ps["server_nic_bytes"][0] > ps["replica_bytes"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"replication": "network", "div_max": "0"}, "Div_max must be a positive norm"),
    ({"replication": "network", "div_max": "-2u"}, "Div_max must be at least 1 update"),
    ({"replication": "network", "div_max": "nan"}, "Div_max must be a positive norm"),
    ({"replication": "network", "div_max": "soon"}, "expected a norm"),
    ({"replication": "network"}, "needs --div-max"),
    ({"replication": "network", "div_max": "1", "replicas": 0}, "needs --replicas 1"),
    ({"div_max": "1"}, "add --replication network"),
    ({"replication": "network", "div_max": "1", "modes": ("ps-async",)}, "run a mlfabric-a:TAU mode"),
    ({"replication": "raft"}, "replication must be one of"),
])
def test_train_refuses_bad_replication_settings(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)
