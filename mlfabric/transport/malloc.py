"""Keep glibc from mapping and unmapping every large received message (zmq transport).

libzmq receives each message into a buffer it ``malloc``\\ s in its I/O thread; pyzmq frees it
when the runtime has reduced or copied it. glibc serves blocks above its mmap threshold
(128 KiB, raised adaptively up to 32 MiB when such blocks are freed) with a fresh ``mmap``,
so a multi-megabyte chunk costs a page fault and a zeroed page per 4 KiB before the kernel
can copy the socket data in, and a ``munmap`` after. Measured on 4 local ranks, 64 MB ring
allreduce (docs/results.md): up to 7,800 page faults and ~15 ms more kernel time per
allreduce on some ranks, ~10% of the wall time. :func:`tune_malloc` fixes the threshold at
32 MiB (the largest glibc allows), so such blocks come from the heap and are reused, with a
trim threshold and top pad that keep the freed space around for the next message.

It changes process-wide allocator settings, once per process; ``MLFABRIC_MALLOC_TUNING=0``
leaves them alone. It does nothing where glibc's ``mallopt`` is absent (musl, macOS, or an
allocator such as jemalloc preloaded in its place, which ignores it).

Exercise it with ``python -m pytest tests/unit/test_malloc.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

__all__ = ["MALLOC_TUNING_ENV", "tune_malloc"]

log = logging.getLogger("mlfabric.transport.malloc")

MALLOC_TUNING_ENV = "MLFABRIC_MALLOC_TUNING"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 512 << 20), (_M_TOP_PAD, 64 << 20))

_lock = threading.Lock()
_done: bool | None = None  # None: not tried yet; else whether the settings were applied


def tune_malloc() -> bool:
    """Apply the settings above once per process; True if glibc accepted them."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if os.environ.get(MALLOC_TUNING_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            log.debug("%s=0: allocator settings left alone", MALLOC_TUNING_ENV)
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        _done = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
        log.debug("glibc malloc tuned for large messages: %s", _done)
        return _done
