"""Ingests and reassemblies against garbage collection: one ``flock`` on the store. Blocking I/O.

An ingest may rely on a block the store already holds (it does not write
it again) while a concurrent collection finds no committed recipe naming
that block and deletes it: the ingest would then commit a recipe naming a
missing block. Two ways out were weighed:

* a grace period (collect only blocks older than N seconds, ingests touch
  the blocks they reuse): no waiting, but a collection that read a block's
  time just before an ingest touched it still deletes it, so it is safe
  only with an ingest that never lasts N seconds, and a clock that never jumps;
* a lock: every ingest and reassembly holds ``.lock`` shared (``LOCK_SH``,
  any number at once), a collection holds it exclusive (``LOCK_EX``). No
  collection runs while a recipe is being written or read, whatever the
  timings. A collection waits for the ingests in progress (or, with
  ``wait=False``, gives up at once and says so), and an ingest waits for a
  collection in progress: a listing and some unlinks, rare and short.

The lock is taken: the kernel releases it when its holder dies, ``kill -9``
included, so a crash never leaves the store locked. ``flock`` locks belong
to an open file, so two threads of one process exclude each other as two
processes do.
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
