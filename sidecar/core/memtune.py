"""glibc's allocator, told to give large buffers back to the system when they are freed.

The sidecar handles whole slot files (10 MB and up) in worker threads: hashed, cut into blocks, rebuilt,
uploaded. glibc maps such a buffer apart and unmaps it when it is freed, but only up to its mmap threshold,
which it raises to the size of each mapped buffer freed (up to 32 MiB on 64-bit). After the first freed slot
file, later ones come from the threads' heaps, and what they leave between long-lived small objects stays
resident (``tests/unit/test_memtune.py``: 10 MB buffers freed in 8 threads among small objects kept, side by
side). Setting the threshold fixes it where it is (a setting made by hand is never raised): a buffer of
1 MiB or more is mapped apart and given back when freed. ``MALLOC_MMAP_THRESHOLD_`` in the environment, if
set, wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's malloc.h)."""
THRESHOLD = 1 << 20
"""Bytes from which an allocation is mapped apart, and unmapped when freed."""


def fix_mmap_threshold(threshold: int = THRESHOLD) -> bool:
    """Set glibc's mmap threshold to ``threshold`` for this process; False where it is not glibc, or the
    environment set it already."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
