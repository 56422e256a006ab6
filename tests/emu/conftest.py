"""Shared helpers of the emulator tests: root detection and leak checks (TCP flows between
hosts: :func:`mlfabric.emu.goodput.run_flows`).

    sudo .venv/bin/python -m pytest tests/emu -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

from mlfabric.emu.cmd import have_root

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


def _not_someone_elses(names: list[str]) -> list[str]:
    """``names`` less those of runs another live process owns: other test sessions or users
    may build clusters on this machine meanwhile, and they are neither leaks nor ours to remove."""
    from mlfabric.emu.cluster import list_runs

    runs = list_runs()

    def others(name: str) -> bool:
        entry = runs.get(name[:6])
        return bool(entry and entry["alive"] and entry["pid"] != os.getpid())

    return [name for name in names if not others(name)]


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves namespaces or links behind (and removes them anyway)."""
    before = set(our_leftovers())
    yield
    left = _not_someone_elses([name for name in our_leftovers() if name not in before])
    if left:
        from mlfabric.emu.cluster import cleanup

        for prefix in sorted({name[:6] for name in left}):  # only these runs, never all of them
            cleanup(force=True, prefix=prefix)
        pytest.fail(f"the test left these behind (now removed): {left}")


@pytest.fixture(autouse=True)
def run_dirs_in_tmp_path(tmp_path, monkeypatch):
    """`mlfabric launch` writes each emulated run's description (cluster.json, the churn trace)
    into a new directory of the temp dir (removed at the end unless kept): the tests' go to
    pytest's tmp_path (their own and their subprocesses'), where they can check it is gone,
    and a failure leaves nothing in /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path
