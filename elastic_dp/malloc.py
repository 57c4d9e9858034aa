"""A worker's (or parameter-server shard's) C allocator: freed memory is kept for the next step.

A training step allocates and frees the same buffers every step, and torch's CPU
allocator calls malloc directly: with glibc's defaults the freed memory goes back to the
system and the next step page-faults it in again. ``keep_freed_memory`` sets glibc's
mmap and trim thresholds so the process keeps it, as CUDA's caching allocator does on a
GPU, unless the user set glibc's variables (``USER_SETTINGS``) or
``ELASTIC_DP_KEEP_FREED_MEMORY=0``. Why these thresholds, and what they save:
docs/sync.md (memory from step to step).
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 32 * 2**20
"""Requests up to this size come from the heap (glibc's largest on a 64-bit system)."""

TRIM_THRESHOLD = 256 * 2**20
"""The heap returns memory to the system only when more than this is free at its top."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
ENV = "ELASTIC_DP_KEEP_FREED_MEMORY"
"""``0`` leaves glibc's allocator at its defaults."""


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory for reuse; True if it was set
    (False: not glibc, ``ENV`` is 0, or the user configured glibc's allocator through its
    environment)."""
    if os.environ.get(ENV, "1") == "0" or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
