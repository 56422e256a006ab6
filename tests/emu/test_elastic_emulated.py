"""`mlfabric train --elastic --emulate` (root): each worker on its own emulated host; a worker
SIGKILLed and restarted in its host rejoins over the emulated network; the cluster is torn down.

    sudo .venv/bin/python -m pytest tests/emu/test_elastic_emulated.py -q
"""

from __future__ import annotations

from mlfabric.train.elastic import ElasticRunConfig, parse_failures, run_elastic_training
from tests.emu.conftest import needs_root


@needs_root
def test_an_emulated_elastic_run_survives_a_kill_and_the_restart_rejoins(no_leaks, tmp_path):
    config = ElasticRunConfig(workers=3, failures=parse_failures("worker:1@1", 3), rejoin_s=0.5, dim=64,
                              train_samples=3072, batch_size=64, epochs=12, compute_time_s=0.1, timeout_s=240,
                              emulate_rate_bps=1e9)
    result = run_elastic_training(config, log_dir=tmp_path)
    assert result.parameters_equal and result.final_members == [0, 1, 2], result
    assert len(result.recovery_s) == 1 and 0 < result.recovery_s[0] < 10
    assert len(result.rejoin_s) == 1 and result.rejoin_s[0] > 0
    assert [c["members"] for c in result.members][:2] == [[0, 1, 2], [0, 2]]
    cluster = [e for e in result.events if e["event"] == "cluster"]
    assert cluster and cluster[0]["topology"] == "star:n=3" and cluster[0]["rate_bps"] == 1_000_000_000
    # (Each worker's loopback is its own namespace's: the members reached each other, so every
    # epoch transport was bound to its host's emulated address.)
