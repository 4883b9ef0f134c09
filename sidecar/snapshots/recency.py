"""When each snapshot was last used, and which are in use now: what retention's LRU reads. Thread-safe.

A snapshot is used when it is committed, restored into a slot or routed to
(:meth:`Recency.touch`). The time survives restarts as its manifest's mtime.
A snapshot being restored or uploaded is held with :meth:`Recency.using`:
retention never selects it while the block runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from sidecar.core import protocols
from sidecar.snapshots import manifest


class Recency:
    def __init__(self, directory: Path, *, clock: protocols.Clock, read_only: bool) -> None:
        self._dir = directory
        self._clock = clock
        self._read_only = read_only
        self._lock = threading.Lock()
        self._last_used: dict[str, float] = {}
        """Unix time each snapshot was last touched by this process."""
        self._in_use: dict[str, int] = {}
        """How many holders each snapshot in use has now."""

    def last_used(self, file: str, record: manifest.Manifest | None) -> float:
        """Unix time ``file`` was last used: touched, else its manifest's mtime or ``created`` (0: unknown)."""
        with self._lock:
            known = self._last_used.get(file)
        if known is not None:
            return known
        if record is None:
            return 0.0
        try:
            touched = (self._dir / (Path(file).stem + ".json")).stat().st_mtime
        except OSError:
            touched = 0.0
        return max(record.created, touched)

    def touch(self, file: str) -> None:
        """Note that ``file`` was used now (its manifest's mtime too, unless read-only)."""
        now = self._clock.wall()
        with self._lock:
            self._last_used[file] = now
        if not self._read_only:
            with contextlib.suppress(OSError):
                os.utime(self._dir / (Path(file).stem + ".json"), (now, now))

    def forget(self, file: str) -> None:
        with self._lock:
            self._last_used.pop(file, None)

    @contextlib.contextmanager
    def using(self, file: str) -> Iterator[None]:
        """Keep retention off ``file`` while the block runs."""
        with self._lock:
            self._in_use[file] = self._in_use.get(file, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_use.pop(file) - 1
                if left:
                    self._in_use[file] = left

    def in_use(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._in_use)
