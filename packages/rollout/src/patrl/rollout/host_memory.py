"""Keep freed host memory for reuse: glibc malloc tuned for a CPU decode loop.

A decode step on CPU allocates and frees the same large temporaries every step: the logits
of a 152k-token vocabulary are 0.6 MB a sequence, 10 MB for 16 sequences, and sampling copies
them. glibc serves an allocation above its mmap threshold (128 KB at start, raised to the
size of the largest mmapped chunk freed so far, at most 32 MB) with fresh pages from the
kernel and unmaps them on free, and trims the top of its heap once 2x that threshold is
free; so until a larger free has raised the threshold past them, a step pays a page fault
for every 4 KB of its temporaries. On this
project's 2-core box a page fault of fresh memory costs more than the copy into it (see
tpreshard's in-place grow), and a TP=2 decode step of 16 sequences of vocab_2l (302M
parameters, 152k vocabulary) measured 0.081 s by default against 0.061-0.063 s with the
threshold pinned at 32 MB and 256 MB kept before trimming (2026-11-24). Worse, the default's
step time depended on what ran before: after a batch of 64 had raised the threshold, the
same 16-sequence step ran at 0.061 s inside a rollout while the profiler, measuring the cell
on its own, saw 0.087 s, and the planner priced every fold at that batch on the wrong number.

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
