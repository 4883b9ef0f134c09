"""The index of one slot dir's committed snapshots, shared by every view of the store. Thread-safe.

One record per ``.bin`` file whose manifest was read and checked, and the
highest generation seen or given out by this process. Snapshots are ordered
by generation, never by the wall clock (see :mod:`sidecar.snapshots.store`).
Every :class:`~sidecar.snapshots.store.SnapshotStore` view of the directory
(a plain server's, each router model's, the command line's) reads this one
object, so a scan made through any of them is seen by all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from sidecar.snapshots import manifest


class Index:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, manifest.Manifest] = {}
        self._generation = 0
        """Highest generation seen or given out by this process."""
        self.blocked = ""
        """Why this process must stay off the directory (another sidecar holds it); empty when it may work."""

    def select(self, keep: Callable[[manifest.Manifest], bool]) -> list[manifest.Manifest]:
        """The records ``keep`` accepts, newest (highest generation) first."""
        with self._lock:
            found = [m for m in self._records.values() if keep(m)]
        return manifest.newest_first(found)

    def get(self, file: str) -> manifest.Manifest | None:
        with self._lock:
            return self._records.get(file)

    def count(self) -> int:
        with self._lock:
            return len(self._records)

    def copy(self) -> dict[str, manifest.Manifest]:
        with self._lock:
            return dict(self._records)

    def put(self, record: manifest.Manifest) -> None:
        with self._lock:
            self._records[record.file] = record
            self._generation = max(self._generation, record.generation)

    def pop(self, file: str) -> manifest.Manifest | None:
        with self._lock:
            return self._records.pop(file, None)

    def replace(self, records: Mapping[str, manifest.Manifest]) -> None:
        """Hold exactly ``records`` (a scan's findings); generations never go back."""
        with self._lock:
            self._records = dict(records)
            self._generation = max([self._generation, *(m.generation for m in records.values())])

    def next_generation(self) -> int:
        """One more than the highest generation seen or given out: the next commit's."""
        with self._lock:
            self._generation = max([self._generation, *(m.generation for m in self._records.values())]) + 1
            return self._generation
