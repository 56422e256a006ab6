"""Shared helpers of the emulator tests: root detection, leak checks, TCP flows between hosts.

    sudo .venv/bin/python -m pytest tests/emu -q
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence

import pytest

from mlfabric.emu import goodput
from mlfabric.emu.cluster import ClusterPlan
from mlfabric.emu.cmd import have_root

#: Run the meter as a script: ``-m mlfabric...`` would import the package (and torch) in every flow.
GOODPUT = goodput.__file__
_OURS = re.compile(r"^mf[0-9a-f]{4}")


def _emulation_available() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not have_root():
        return "needs root (CAP_NET_ADMIN): CI runs these as root"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
        subprocess.run(["tc", "-V"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"iproute2 is missing ({exc}): apt-get install iproute2"
    return None


_REASON = _emulation_available()
needs_root = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def our_leftovers() -> list[str]:
    """Namespaces and machine-namespace links whose names carry an emulator prefix."""
    if _REASON is not None:
        return []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    names = [line.split()[0] for line in ns if line.strip()]
    names += [line.split(":", 2)[1].strip().split("@")[0] for line in links if ":" in line]
    return [name for name in names if _OURS.match(name)]


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves namespaces or links behind (and removes them anyway)."""
    before = set(our_leftovers())
    yield
    left = [name for name in our_leftovers() if name not in before]
    if left:
        from mlfabric.emu.cluster import cleanup

        cleanup(force=True)
        pytest.fail(f"the test left these behind (now removed): {left}")


def run_flows(plan: ClusterPlan, pairs: Sequence[tuple[int, int]], *, seconds: float = 2.5,
              port: int = 5201, during=None) -> list[dict]:
    """One TCP flow per ``(src, dst)`` host pair, all at once; the receivers' JSON, in order.

    ``during`` (optional) is called once all senders have started.
    """
    py = sys.executable
    receivers = []
    try:
        for i, (src, dst) in enumerate(pairs):
            host = plan.hosts[dst]
            proc = subprocess.Popen(["ip", "netns", "exec", host.netns, py, GOODPUT, "recv",
                                     "--bind", host.address, "--port", str(port + i), "--timeout", "30"],
                                    stdout=subprocess.PIPE, text=True)
            receivers.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        senders = [subprocess.Popen(["ip", "netns", "exec", plan.hosts[src].netns, py, GOODPUT,
                                     "send", "--to", plan.hosts[dst].address, "--port", str(port + i),
                                     "--seconds", str(seconds)], stdout=subprocess.DEVNULL)
                   for i, (src, dst) in enumerate(pairs)]
        if during is not None:
            during()
        for sender in senders:
            assert sender.wait(timeout=seconds + 30) == 0
        results = []
        for proc in receivers:
            out, _ = proc.communicate(timeout=30)
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in receivers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
