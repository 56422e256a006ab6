"""``mlfabric bench ps`` on a small emulated star (root): 4 workers push and pull a 4 MB model
through one server at 200 Mbit/s, two iterations (the first a warm-up), through the CLI.

    sudo .venv/bin/python -m pytest tests/emu/test_bench_ps.py -q

Checks the JSON's structure, that every pulled model was the exact BSP result, that the
server saw what the job sent (rounds, pulls, bytes), that the server NIC's goodput in both
phases is near the shaped rate (loose bounds: a shaper that lets through too much, or a phase
timed wrong, fails them) and that the emulated iteration agrees with the simulator's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.emu.conftest import needs_root

ROOT = Path(__file__).resolve().parents[2]
WORKERS, MODEL_BYTES, RATE, ITERATIONS = 4, 4_000_000, 200e6, 2


@pytest.fixture
def no_dead_runs_left():
    """Fails the test if a cluster whose owner has exited is left behind (and removes it).
    Unlike ``no_leaks`` it ignores clusters of live owners: other jobs on the machine may
    build their own while this test runs, and those are not ours to judge or remove."""
    from mlfabric.emu.cluster import cleanup, list_runs

    before = set(list_runs())
    yield
    left = sorted(prefix for prefix, run in list_runs().items() if prefix not in before and not run["alive"])
    for prefix in left:
        cleanup(prefix=prefix)
    if left:
        pytest.fail(f"the benchmark left these clusters behind (now removed): {left}")


@needs_root
def test_bench_ps_small_star(tmp_path, no_dead_runs_left):
    out = tmp_path / "ps.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mlfabric.cli", "bench", "ps", "--workers", str(WORKERS),
                           "--model-size", "4MB", "--rate", "200mbit", "--iterations", str(ITERATIONS),
                           "--timeout", "120", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
    assert "ingress goodput" in proc.stdout and "emu/sim" in proc.stdout
    data = json.loads(out.read_text())

    assert data["benchmark"] == "ps-incast"
    assert data["command"].startswith("mlfabric bench ps --workers 4 --servers 1 --model-size 4MB")
    assert data["date"] and "emulated star:n=5" in data["machine"]
    config = data["config"]
    assert (config["workers"], config["servers"], config["topology"]) == (WORKERS, 1, "star:n=5")
    assert config["worker_hosts"] == [1, 2, 3, 4] and config["server_hosts"] == [0]
    assert config["shard_bytes"] == [MODEL_BYTES]

    iterations = data["iterations"]
    assert [it["index"] for it in iterations] == [0, 1]
    assert [it["warmup"] for it in iterations] == [True, False]
    assert all(it["correct"] for it in iterations)
    for it in iterations:
        [server] = it["servers"]
        # The phases and the gap make up the iteration (t0 -> close -> answer -> pulled).
        assert server["push_s"] + server["gap_s"] + server["pull_s"] == pytest.approx(it["iteration_s"], abs=1e-6)
        assert 0 <= server["gap_s"] < 0.1 * it["iteration_s"]

    stats = data["server_stats"][0]
    assert stats["updates_applied"] == ITERATIONS and stats["pulls"] == WORKERS * ITERATIONS
    assert stats["dropped"] == 0 and stats["errors"] == [] and stats["lost_workers"] == []
    assert sorted(stats["departed_workers"]) == list(range(WORKERS))
    # init_model and every push carry the whole model to the server; every pull carries it back.
    assert stats["bytes_in"] >= WORKERS * MODEL_BYTES * (ITERATIONS + 1)
    assert stats["bytes_out"] >= WORKERS * MODEL_BYTES * ITERATIONS

    summary = data["summary"]
    assert summary["correct"] is True
    # Payload over a 1500-byte-MTU link is at most 1448/1514 = 0.956 of the rate: above 0.97
    # the shaper or the timing is wrong; below 0.75 the incast (or the reply path) is broken.
    for key in ("ingress_goodput", "egress_goodput"):
        assert 0.75 <= summary[key] <= 0.97, (key, summary)
    # The server's byte counters tell the same story as the ranks' timestamps.
    for key in ("ingress", "egress"):
        assert summary[f"{key}_nic"] == pytest.approx(summary[f"{key}_goodput"], rel=0.05)
    reference = data["two_host_goodput_bps"] / RATE
    assert 0.85 <= reference <= 0.97
    simulated = data["simulated"]
    # The simulator: push and pull each move W models through one 200 Mbit/s NIC.
    assert simulated["push_s"] == pytest.approx(WORKERS * MODEL_BYTES * 8 / RATE, rel=1e-6)
    assert simulated["iteration_s"] == pytest.approx(2 * WORKERS * MODEL_BYTES * 8 / RATE, rel=1e-6)
    assert 0.95 <= summary["emulated_vs_simulated"] <= 1.25, summary
    assert 0.85 <= summary["emulated_vs_simulated_at_goodput"] <= 1.15, summary
    assert summary["iteration_s"] == pytest.approx(iterations[1]["iteration_s"])
