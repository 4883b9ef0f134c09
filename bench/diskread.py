"""Timed reads of a file from disk and from the page cache, shared by the scaling and hashing benches."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

CHUNK = 8 << 20
"""Bytes per read: the size the sidecar hashes in."""


def best(fn: Callable[[], float], reps: int) -> float:
    """Fastest of `reps` calls, in seconds: the capability, least disturbed by other work."""
    return min(fn() for _ in range(reps))


def evict(path: Path) -> None:
    """Drop the file from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_direct(path: Path) -> float:
    """Seconds to read the file with O_DIRECT, past the page cache."""
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        started = time.perf_counter()
        offset = 0
        while (got := os.preadv(fd, [buf], offset)) > 0:
            offset += got
        return time.perf_counter() - started
    finally:
        os.close(fd)
        buf.close()


def read_cold(path: Path) -> float:
    """Seconds to read the file with buffered reads after evicting it."""
    evict(path)
    buf = bytearray(CHUNK)
    started = time.perf_counter()
    with path.open("rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return time.perf_counter() - started


def read_warm(path: Path) -> float:
    """Seconds to read the file from the page cache (after one read to fill it)."""
    buf = bytearray(CHUNK)
    with path.open("rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
        fh.seek(0)
        started = time.perf_counter()
        while fh.readinto(buf):
            pass
    return time.perf_counter() - started
