"""A worker's (or parameter-server shard's) C allocator: freed memory is kept for the next step.

A training step allocates and frees the same buffers every step: activations, their
gradients, ZeRO-2's bucket buffers. torch's CPU allocator has no cache of its own; it
calls malloc. glibc's malloc gives memory back to the system whenever the top of its heap
has more than ``M_TRIM_THRESHOLD`` free (128 KiB to start, then adapted to the largest
chunk freed), and serves large requests with ``mmap``, unmapped again when freed. Either
way the next step touches those pages anew, and every 4 KiB of them costs a page fault.
On the GPT job that was about 1,300 faults per step in one process, and up to 2,000 per
worker and step in two, 1–4% of a CPU step (docs/BENCHMARKS.md). CUDA's caching allocator
keeps device memory for the same reason.

So each worker sets both thresholds (``keep_freed_memory``): requests up to
``MMAP_THRESHOLD`` come from the heap, and the heap gives memory back only beyond
``TRIM_THRESHOLD`` free at its top. The worker's resident memory then stays near the
step's peak, which every step reaches anyway. glibc's own environment variables
(``USER_SETTINGS``) set by the user win: the worker then leaves the allocator alone, as it
does with any other C library, and as it does with ``ELASTIC_DP_KEEP_FREED_MEMORY=0`` in
its environment. (Setting one of glibc's thresholds by hand also turns off its adaptation:
``MALLOC_TRIM_THRESHOLD_=131072``, its starting value, made a worker take 23,000 faults per
GPT step and 134.6 ms against 91.6 ms per step.)
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
