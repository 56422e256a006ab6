"""mlfabric.transport.memory: received zmq messages reuse freed memory instead of faulting in
fresh pages; the switch and the user's own malloc settings are respected.

Each case runs in a fresh interpreter, since the allocator setting is process-wide and once.

Run: python -m pytest tests/local/test_freed_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlfabric.transport.memory import KEEP_FREED_MEMORY_ENV, USER_MALLOC_SETTINGS

pytestmark = pytest.mark.local

# Receive batches of multi-megabyte messages of varying sizes, several held at once, as a
# rank does during BML's steps; print whether the tuning applied and the page faults taken.
_RECEIVER = """
import resource, zmq
from mlfabric.transport.memory import keep_freed_memory
applied = keep_freed_memory()
ctx = zmq.Context(io_threads=1)
a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
port = b.bind_to_random_port("tcp://127.0.0.1")
a.connect(f"tcp://127.0.0.1:{port}")
payloads = [bytes(s) for s in (3_000_000, 9_000_000, 5_000_000, 11_000_000, 7_000_000, 13_000_000)]
def batches(n):
    for i in range(n):
        for j in range(6):
            a.send(payloads[(i + j) % 6], copy=False)
        frames = [b.recv(copy=False) for _ in range(6)]
        assert sum(len(f) for f in frames) == 48_000_000
        del frames
batches(4)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
batches(20)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
a.close(0); b.close(0); ctx.term()
"""


def _receive(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if k not in (KEEP_FREED_MEMORY_ENV, *USER_MALLOC_SETTINGS)}
    out = subprocess.run([sys.executable, "-c", _RECEIVER], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_received_messages_reuse_memory_instead_of_faulting_in_pages() -> None:
    applied, tuned_faults = _receive()
    off, default_faults = _receive(**{KEEP_FREED_MEMORY_ENV: "0"})
    assert applied and not off
    # 20 batches of 48 MB: glibc's defaults fault in most of those pages again every time
    # (~155,000 faults measured), the tuned allocator hands the same memory back.
    assert default_faults > 20_000, default_faults
    assert tuned_faults < default_faults / 10, (tuned_faults, default_faults)


def test_the_processs_own_malloc_settings_are_left_alone() -> None:
    applied, _ = _receive(MALLOC_TRIM_THRESHOLD_="1048576")
    assert not applied
    applied, _ = _receive(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert not applied
