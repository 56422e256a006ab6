"""A plain script runs unchanged under torchrun (the agent serves the rendezvous store).

Run: python -m pytest tests/local/test_torchrun.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlfabric.bench.procs import free_port

pytestmark = pytest.mark.local

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "allreduce.py"


def test_example_under_torchrun() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    out = subprocess.run([str(torchrun), "--nproc-per-node=2", f"--master-port={port}", str(EXAMPLE)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world_size=2" in out.stdout and "allgather [0, 1]" in out.stdout, out.stdout


def test_example_as_a_single_process() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world_size=1" in out.stdout
