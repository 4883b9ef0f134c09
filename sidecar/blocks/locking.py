"""Ingests and reassemblies against garbage collection: one ``flock`` on the store. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/blocks/locking.py`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".lock"


@contextlib.contextmanager
def held(root: Path, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """Hold the store's lock for the block; yields False (not held) only when ``wait`` is False and it is taken."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        # A store on a filesystem remounted read-only: nothing can ingest or collect there, and the
        # committed snapshots must still be rebuilt for restores. flock needs no write access.
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the file releases the lock
