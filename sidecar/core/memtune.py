"""glibc's allocator, told to give large buffers back to the system when they are freed.

The sidecar handles whole slot files (10 MB and up) in worker threads: hashed, cut into blocks, rebuilt,
uploaded. glibc maps such a buffer apart and unmaps it when it is freed, but only up to its mmap threshold,
which it raises to the size of each mapped buffer freed (up to 32 MiB on 64-bit). After the first freed slot
file, later ones come from the threads' heaps, and what they leave between long-lived small objects stays
resident (``tests/unit/test_memtune.py``: 10 MB buffers freed in 8 threads among small objects kept, side by
side). Setting the threshold fixes it where it is (a setting made by hand is never raised): a buffer of
1 MiB or more is mapped apart and given back when freed. ``MALLOC_MMAP_THRESHOLD_`` in the environment, if
set, wins.

Blocks (16 to 512 KiB) stay below that threshold: they come from the heaps of the threads that read, hash and
write them, and what they leave free between long-lived small objects stays resident, heap after heap (a soak's
sidecar held 44 MB in thread heaps, and grew by 60 MB in its first minutes). :func:`trim`, called by ``run``
every :data:`TRIM_SECONDS`, gives every free page inside every heap back (``malloc_trim``; a probe in
``tests/unit/test_memtune.py``: 109 MB resident after 76,800 freed 64 KiB blocks in 8 threads, 27 MB trimmed, in
13 ms).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's malloc.h)."""
THRESHOLD = 1 << 20
"""Bytes from which an allocation is mapped apart, and unmapped when freed."""
TRIM_SECONDS = 10.0
"""How often ``run`` gives free heap pages back (:func:`trim`): a few milliseconds each, in a worker thread."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def fix_mmap_threshold(threshold: int = THRESHOLD) -> bool:
    """Set glibc's mmap threshold to ``threshold`` for this process; False where it is not glibc, or the
    environment set it already."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    try:
        mallopt = libc.mallopt if libc is not None else None
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def trim() -> bool:
    """Give the free pages inside every allocator heap of this process back to the system (glibc's
    ``malloc_trim(0)``); False where it is not glibc. Blocking for a few milliseconds, with the GIL released."""
    libc = _libc()
    try:
        malloc_trim = libc.malloc_trim if libc is not None else None
    except AttributeError:
        return False
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True
