"""A late rank on an emulated star agrees with the simulator (root): the per-connection FIFO
model of ``mlfabric.sim`` against real TCP streams (examples/late_rank.py).

    sudo .venv/bin/python -m pytest tests/emu/test_late_rank.py -q
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.emu.conftest import needs_root, our_leftovers

ROOT = Path(__file__).resolve().parents[2]


@needs_root
def test_a_late_rank_delays_the_emulated_ring_as_simulated() -> None:
    cmd = [sys.executable, "-m", "mlfabric.cli", "launch", "--hosts", "4", "--topology", "star", "--rate", "500mbit",
           "--", sys.executable, str(ROOT / "examples" / "late_rank.py"), "--rate", "500mbit", "--late", "100ms",
           "--size", "16MB", "--iters", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {int(m[1]): (float(m[2]), float(m[3])) for m in re.finditer(r"\]\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\n", out.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], out.stdout
    # The ring's ranks downstream of the late one finish later, by about the delay: simulated
    # 484.0 / 441.3 / 398.7 ms for ranks 0-2 (16 MB at 500 Mbit/s, 3 chunks, 100 ms late).
    for rank in (0, 1, 2):
        emulated, simulated = rows[rank]
        assert 0.95 <= emulated / simulated <= 1.3, (rank, rows)
    # Rank 0 (right after the late rank) ends ~85 ms after rank 2 (right before it).
    assert rows[0][0] - rows[2][0] > 0.5 * (rows[0][1] - rows[2][1]), rows
    makespan = re.search(r"makespan: emulated ([\d.]+) ms, simulated ([\d.]+) ms", out.stdout)
    assert makespan and 0.95 <= float(makespan[1]) / float(makespan[2]) <= 1.3
    assert not our_leftovers()
