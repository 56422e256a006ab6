"""glibc malloc tuning for large received messages (transport/malloc.py), in subprocesses so
that the allocator settings of the test process stay untouched.

    python -m pytest tests/unit/test_malloc.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A libzmq-like pattern: one thread allocates and fills 16 MiB message buffers, another frees
# them with a few in flight. Prints: whether tune_malloc applied, then the page faults per
# message after a warm-up (the working set is touched once during the warm-up).
_SCRIPT = r"""
import ctypes, queue, resource, threading
from mlfabric.transport.malloc import tune_malloc
applied = tune_malloc()
assert tune_malloc() == applied  # idempotent
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE, WARMUP, MEASURED, IN_FLIGHT = 16 << 20, 12, 30, 3
q = queue.Queue(maxsize=IN_FLIGHT)  # bounded: a fixed working set, as a socket window gives
def io_thread():
    for _ in range(WARMUP + MEASURED):
        p = libc.malloc(SIZE); ctypes.memset(p, 1, SIZE); q.put(p)
    q.put(None)
threading.Thread(target=io_thread, daemon=True).start()
pending, seen, start = [], 0, None
while (p := q.get()) is not None:
    seen += 1
    if seen == WARMUP:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pending.append(p)
    if len(pending) > IN_FLIGHT:
        libc.free(pending.pop(0))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
print(applied, faults / MEASURED)
"""


def _run(tuning: str) -> tuple[bool, float]:
    env = {**os.environ, "MLFABRIC_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_tuned_malloc_reuses_large_message_buffers() -> None:
    applied, tuned = _run("1")
    assert applied
    off_applied, untuned = _run("0")
    assert not off_applied  # the opt-out leaves the allocator alone
    pages = (16 << 20) // 4096
    # Tuned: buffers come back from the heap, no page is faulted in again per message.
    assert tuned < 0.02 * pages, tuned
    # glibc's default maps fresh pages for a large part of every message (why we tune).
    assert untuned > 0.2 * pages and untuned > 20 * max(tuned, 1.0), (untuned, tuned)
