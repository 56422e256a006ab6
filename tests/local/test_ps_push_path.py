"""Issue 35's check 6: a direct push reaches the socket in at most 5 stops, its header encoded once.

    .venv/bin/python -m pytest tests/local/test_ps_push_path.py -q

``tools/push_stops.py`` pushes once from a worker to a server over two tcp transports in this
process and captures the stack in ``socket.sendmsg``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "push_stops.py"


def test_a_direct_push_takes_at_most_five_stops_and_one_encode() -> None:
    spec = importlib.util.spec_from_file_location("push_stops", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["push_stops"] = module
    spec.loader.exec_module(module)
    frames, encodes = module.measure()
    assert frames[0].endswith(" push") and "ps/worker.py" in frames[0]
    assert any("ps/policy.py" in f and f.endswith("send_push") for f in frames)
    assert len(frames) <= 5, frames
    assert encodes == 1
