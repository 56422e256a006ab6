"""`mlfabric train --emulate` (root): the collective launch and the parameter-server launch,
each on its own emulated star under churn, recorded in the run's metadata, and torn down.

    sudo .venv/bin/python -m pytest tests/emu/test_train_emulated.py -q
"""

from __future__ import annotations

import csv
import subprocess
import time

from mlfabric.train.harness import EagerTrainConfig, TrainEmulation, run_eager_training
from mlfabric.train.workloads import HyperplaneSpec
from tests.emu.conftest import needs_root


@needs_root
def test_emulated_allreduce_and_ps_bsp_under_churn(no_leaks, tmp_path):
    config = EagerTrainConfig(
        workload="hyperplane", workers=2, servers=1, modes=("allreduce", "ps-bsp"), epochs=2,
        hyperplane=HyperplaneSpec(dim=64, train_samples=2_048, val_samples=256), batch_size=128, lr=0.05,
        transport="tcp", timeout_s=60.0,
        emulation=TrainEmulation(rate_bps=100e6, churn="N1", churn_period_s=0.5, trace_dir=str(tmp_path)))
    start = time.monotonic()
    result = run_eager_training(config, argv=["test"])
    assert time.monotonic() - start < 45.0

    # The runs: one per mode, every epoch on the curve, the PS run's figures from its server.
    assert [run.mode for run in result.runs] == ["allreduce", "ps-bsp"]
    steps = config.steps_per_epoch * config.epochs_
    for run in result.runs:
        assert run.steps == steps == 16 and len(run.per_rank_loop_s) == 2
        assert [p.epoch for p in run.curve] == [1, 2] and run.metric == "mse"
        assert run.final_metric < run.curve[0].val_metric * 1.5  # trained, not diverged
    # each run says where it started in its launch's churn (simulate mlfabric --emulated replays it)
    assert all(run.churn_offset_s is not None and 0 <= run.churn_offset_s < 45 for run in result.runs)
    ps = result.get("ps-bsp").ps
    assert result.get("allreduce").ps is None and ps is not None
    assert ps["worker_updates_applied"] == 2 * steps and ps["dropped"] == 0 and ps["max_delay"] == 0
    assert len(ps["server_bytes_in"]) == 1 and ps["server_bytes_in"][0] >= 2 * steps * 65 * 4

    # The emulation in the metadata: one star per launch (workers; server + workers), churn traces.
    emu = result.metadata["emulation"]
    assert emu["rate_bps"] == 100e6 and emu["churn"] == "N1" and emu["churn_period_s"] == 0.5
    launches = {entry["launch"]: entry for entry in emu["launches"]}
    assert launches["collective"]["topology"] == "star:n=2" and launches["parameter-server"]["topology"] == "star:n=3"
    for entry in launches.values():
        assert entry["churn_redraws"] >= 1 and 0.0 <= entry["churn_reduced_fraction"] <= 1.0
        with open(entry["churn_trace"], newline="") as handle:
            rows = list(csv.DictReader(handle))
        hosts = entry["hosts"]
        assert len(rows) == entry["churn_redraws"] * hosts * 2  # per redraw: every host, egress + ingress
        assert {int(r["host"]) for r in rows} == set(range(hosts))
        assert {float(r["rate_bps"]) for r in rows} <= {50e6, 100e6}  # N1: 5G / 10G of the top rate
    data = result.to_dict()
    assert data["config"]["emulation"]["rate_bps"] == 100e6 and data["metadata"]["emulation"] == emu

    # Both clusters are gone (no_leaks checks every emulator name as well).
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for entry in launches.values():
        assert entry["cluster"] not in namespaces


@needs_root
def test_sigterm_tears_the_emulated_cluster_down(no_leaks, tmp_path):
    """Regression: `timeout 2400 mlfabric train --emulate ...` that ran out (SIGTERM) left its
    cluster's namespaces behind; the emulated launch now tears down on SIGTERM."""
    import signal
    import sys

    from tests.emu.conftest import our_leftovers

    before = set(our_leftovers())
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlfabric.cli", "train", "--workload", "mlp", "--workers", "2", "--sync", "allreduce",
         "--epochs", "200", "--emulate", "--rate", "100mbit", "--transport", "tcp", "--no-plot",
         "--out", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not set(our_leftovers()) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(our_leftovers()) - before, "the cluster never came up"
        time.sleep(2)  # the ranks are running
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not set(our_leftovers()) - before
