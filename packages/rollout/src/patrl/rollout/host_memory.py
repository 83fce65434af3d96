"""Keep freed host memory for reuse: glibc malloc tuned for a CPU decode loop.

A CPU decode step allocates and frees the same large temporaries (full-vocabulary logits and
their sampling copies) every step. Above glibc's mmap threshold each is served with fresh pages
and unmapped on free, so a step pays a page fault per page of its temporaries, and the
threshold's drift made step times depend on what ran before (which misled the profiler).
Pinning the threshold at its ceiling and trimming late keeps the pages.

Process-wide and irreversible (malloc has no per-caller settings); applied once, by the first
CPU engine of the process, unless `EngineConfig.tune_host_malloc` is off. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Pin glibc's mmap threshold at its ceiling and keep 256 MB of freed heap before trimming
    (once per process); True when the settings are in force."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    _applied = bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _applied
