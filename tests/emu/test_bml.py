"""BML on emulated clusters (root): zmq correctness on BCube(3,2) with both NICs carrying
their level, the ``--compare-star`` benchmark, and the LeNet-5 job command.

    sudo .venv/bin/python -m pytest tests/emu/test_bml.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.emu.conftest import needs_root, our_leftovers

COUNT = 100_003  # odd, and not a multiple of k*N = 18: uneven pieces
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "mlfabric.cli"]


def _nic_tx_bytes() -> dict[str, int]:
    """Kernel transmit counters of this host's NICs (``ip netns exec`` mounts its own /sys)."""
    base = Path("/sys/class/net")
    return {dev.name: int((dev / "statistics" / "tx_bytes").read_text()) for dev in base.iterdir()
            if dev.name.startswith("eth")}


def _bml_rank(count: int) -> dict:
    import os

    import torch

    import mlfabric

    comm = mlfabric.init(transport="zmq", timeout=60)  # the topology comes from MLFABRIC_TOPOLOGY
    out: dict = {"topology_env": os.environ.get("MLFABRIC_TOPOLOGY"), "topology": str(comm.topology),
                 "channels": list(comm.transport.channels)}
    try:
        for dtype in (torch.float32, torch.int64):
            def make(rank: int) -> torch.Tensor:
                gen = torch.Generator().manual_seed(1000 + rank)
                values = torch.randint(-4000, 4000, (count,), generator=gen)
                # Quarters are exact in float32, so any order of additions gives the same sum.
                return values.to(dtype) / 4 if dtype.is_floating_point else values.to(dtype)

            reference = make(0)
            for rank in range(1, comm.world_size):
                reference = reference + make(rank)
            tensor = make(comm.rank)
            comm.barrier()
            comm.transport.reset_counters()
            nic_before = _nic_tx_bytes()
            comm.allreduce(tensor, algorithm="bcube")
            sent = {ch: comm.transport.bytes_sent(ch) for ch in comm.transport.channels}
            # A rank may finish while its last sends are still on the wire; after the barrier
            # every rank has received everything, so every byte has left its NIC.
            comm.barrier()
            nic_after = _nic_tx_bytes()
            name = str(dtype).removeprefix("torch.")
            out[name] = {
                "mismatches": int((tensor != reference).sum().item()),
                "dtype": str(tensor.dtype),
                "sent": sent,
                "nic_tx": {dev: nic_after[dev] - nic_before[dev] for dev in nic_after},
            }
    finally:
        comm.close()
    return out


@needs_root
def test_bml_over_zmq_on_emulated_bcube_is_exact_and_uses_both_nics(no_leaks):
    from mlfabric.bench.procs import run_ranks
    from mlfabric.collectives.bcube import closed_form_elements_per_level
    from mlfabric.emu.launcher import emulated_launch

    with emulated_launch("bcube:n=3,k=2", 1e9, timeout_s=120, capture_output=True) as launch:
        results = run_ranks(_bml_rank, config=launch, args=(COUNT,))
    assert len(results) == 9
    per_level = closed_form_elements_per_level(COUNT, 3, 2)  # 2 (N-1) pieces of count/(kN) per level
    for rank, out in enumerate(results):
        assert out["topology_env"] == "bcube:n=3,k=2" and out["topology"] == "bcube:n=3,k=2"
        assert out["channels"] == ["0", "1"]
        for name, itemsize in (("float32", 4), ("int64", 8)):
            cell = out[name]
            assert cell["dtype"] == f"torch.{name}"
            assert cell["mismatches"] == 0, f"rank {rank} {name}: {cell['mismatches']} elements differ"
            for level in ("0", "1"):
                # Each level carries its share (pieces differ by one element: 1% slack).
                assert cell["sent"][level] == pytest.approx(per_level * itemsize, rel=0.01), (rank, name, level)
                # ... and it really leaves on NIC `level` (TCP/IP headers on top, no relaying).
                tx = cell["nic_tx"][f"eth{level}"]
                assert cell["sent"][level] <= tx <= 1.15 * cell["sent"][level] + 64_000, (rank, name, level, tx)


def _run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@needs_root
def test_compare_star_bench(no_leaks, tmp_path):
    out = tmp_path / "cmp.json"
    # 100 Mbit/s: 2 MB is then bandwidth-bound (BML ~0.14 s, ring on the star ~0.28 s).
    proc = _run_cli(["bench", "allreduce", "--emulate", "--topology", "bcube:n=3,k=2", "--rate", "100mbit",
                     "--algorithms", "bcube,gloo", "--sizes", "2MB", "--iters", "2", "--warmup", "1",
                     "--compare-star", "--json", str(out)], timeout=240)
    assert "vs ring" in proc.stdout and "star:n=9" in proc.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "allreduce-bml-vs-star"
    rows = {(r["cluster"], r["algorithm"]): r for r in data["rows"]}
    assert set(rows) == {("bcube:n=3,k=2", "bcube"), ("bcube:n=3,k=2", "gloo"), ("star:n=9", "ring"),
                         ("star:n=9", "ps")}
    assert all(r["correct"] and r["size_bytes"] == 2_000_000 for r in rows.values())
    assert rows[("bcube:n=3,k=2", "gloo")]["simulated_s"] is None
    # The simulator's times: one NIC's 2 (N-1)/(kN) share of 2 MB at 100 Mbit/s, and twice that on the star.
    bml_sim = 2 * 8 / 18 * 2_000_000 * 8 / 100e6
    assert rows[("bcube:n=3,k=2", "bcube")]["simulated_s"] == pytest.approx(bml_sim, rel=1e-3)
    assert rows[("star:n=9", "ring")]["simulated_s"] == pytest.approx(2 * bml_sim, rel=1e-3)
    assert rows[("star:n=9", "ps")]["simulated_s"] == pytest.approx(2 * bml_sim, rel=1e-3)
    for key in (("bcube:n=3,k=2", "bcube"), ("star:n=9", "ring"), ("star:n=9", "ps")):
        row = rows[key]
        assert row["emulated_vs_simulated"] == pytest.approx(row["gst_s"] / row["simulated_s"])
        # No faster than the wire (TCP carries 0.956 of the rate), and not absurdly slower.
        assert 1.0 <= row["emulated_vs_simulated"] < 3.0, (key, row)
    (speed,) = data["speedups"]
    assert speed["bml_vs_ring_star"] == pytest.approx(rows[("star:n=9", "ring")]["gst_s"] / speed["bml_s"])
    assert speed["bml_vs_ps_star"] == pytest.approx(rows[("star:n=9", "ps")]["gst_s"] / speed["bml_s"])
    assert speed["simulated_bml_vs_ring_star"] == pytest.approx(2.0, rel=1e-3)
    assert speed["bml_vs_ring_star"] > 1.2 and speed["bml_vs_ps_star"] > 1.2, speed
    assert data["runs"]["bcube"]["config"]["emulate_topology"] == "bcube:n=3,k=2"
    assert data["runs"]["star"]["config"]["algorithms"] == ["ring", "ps"]
    assert our_leftovers() == []


@needs_root
def test_bml_job_command(no_leaks, tmp_path):
    out = tmp_path / "job.json"
    proc = _run_cli(["bench", "bml-job", "--iterations", "3", "--batches", "8", "--rate", "1gbit",
                     "--json", str(out)], timeout=240)
    assert "BML reduction" in proc.stdout
    data = json.loads(out.read_text())
    runs = {(r["batch"], r["network"]): r for r in data["runs"]}
    assert set(runs) == {(8, "BML"), (8, "PS")}
    assert runs[(8, "BML")]["algorithm"] == "bcube" and runs[(8, "BML")]["topology"] == "bcube:n=3,k=2"
    assert runs[(8, "PS")]["algorithm"] == "ps" and runs[(8, "PS")]["topology"] == "star:n=9"
    for run in runs.values():
        assert run["parameters"] == 3_274_634  # BML §4.2's LeNet-5: 3.27 million parameters
        # The hook reduced every gradient once per iteration.
        assert run["bytes_reduced_per_iteration"] == 4 * 3_274_634
        assert len(run["step_times_s"]) == 3
        assert 0 < max(run["step_times_s"]) <= run["jct_s"] <= 1.05 * sum(run["step_times_s"]) + 1.0
        assert math.isfinite(run["final_loss"]) and 1.0 < run["initial_loss"] < 4.0  # ~ln(10) at the start
    (reduction,) = data["reductions"]
    assert reduction["reduction"] == pytest.approx(1 - runs[(8, "BML")]["jct_s"] / runs[(8, "PS")]["jct_s"])
    # One full gradient (13.1 MB) at 1 Gbit/s: BML needs half of PS's time.
    assert data["simulated_gst_s"]["PS"] == pytest.approx(2 * data["simulated_gst_s"]["BML"], rel=1e-3)
    assert data["simulated_gst_s"]["BML"] == pytest.approx(2 * 8 / 18 * 4 * 3_274_634 * 8 / 1e9, rel=1e-2)
    assert our_leftovers() == []
