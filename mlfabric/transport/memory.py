"""Keep the memory of received messages for reuse instead of mapping fresh pages per message.

libzmq allocates a buffer for every message it receives and frees it once the message is
consumed. With glibc's default malloc, a multi-megabyte buffer is either mmap'ed on its own
or carved from the top of a heap that is trimmed again on free; either way the next message
lands on pages the kernel must fault in and zero again. On an emulated BCube(3,2) at
500 Mbit/s (9 ranks on 2 cores) that was ~145,000 page faults and ~0.6 CPU-seconds per 64 MB
BML allreduce, a third of the machine's CPU (docs/results.md, "BML").

:func:`keep_freed_memory` raises glibc's mmap threshold to its maximum (32 MiB) and its trim
threshold to :data:`TRIM_THRESHOLD_BYTES`, so freed message buffers stay in the allocator and
are reused. The cost is memory that is not handed back to the kernel (at most the largest
set of messages in flight at once). The zmq transport calls it when it is created; set
``MLFABRIC_KEEP_FREED_MEMORY=0`` to leave the allocator alone. It does nothing when the C
library is not glibc or when the process already chose its own thresholds through
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``GLIBC_TUNABLES``.

Exercise it with ``python -m pytest tests/local/test_freed_memory.py``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger("mlfabric.transport.memory")

#: Environment variable that turns :func:`keep_freed_memory` off when set to ``0``.
KEEP_FREED_MEMORY_ENV = "MLFABRIC_KEEP_FREED_MEMORY"
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of a heap kept before glibc gives it back to the kernel.
TRIM_THRESHOLD_BYTES = 512 << 20

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Environment variables through which a process chooses its own malloc settings.
USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc once per process (see the module docstring); True if it did."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0":
        return False
    chosen = [name for name in USER_MALLOC_SETTINGS if os.environ.get(name)]
    if chosen:
        log.debug("malloc left alone: the process sets %s", ", ".join(chosen))
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    # Only glibc has gnu_get_libc_version (and these mallopt parameter numbers).
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. Setting either threshold also turns off glibc's dynamic
    # adjustment of both, which would otherwise move them back after the first large free.
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    log.debug("malloc: mmap threshold %d, trim threshold %d (%s)", MMAP_THRESHOLD_BYTES,
              TRIM_THRESHOLD_BYTES, "set" if ok else "refused")
    return ok
