"""A recorder of what the snapshot store reports (``storeevents.StoreEvents``), for the unit tests."""

from __future__ import annotations

from sidecar.core import outcomes


class Calls:
    """One kind of report, as (name, reason or operation, detail) tuples in the order told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []


class Told:
    """Every report of one store: quarantines (``bad``), I/O errors (``io``), newer formats, unindexed files."""

    def __init__(self) -> None:
        self.bad = Calls()
        """(file, reason, detail) per quarantined snapshot."""
        self.io = Calls()
        """(operation, file, error) per I/O error."""
        self.newer: list[tuple[str, int]] = []
        self.not_indexed: list[tuple[str, str]] = []
        self.on_disk: list[tuple[str, outcomes.StagingFallback, int]] = []
        """(name, reason, estimated bytes) per save or restore staged on the store's disk."""

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        self.bad.calls.append((file, reason, detail))

    def io_error(self, operation: outcomes.SlotDirOperation, name: str, error: str) -> None:
        self.io.calls.append((operation, name, error))

    def newer_format(self, name: str, found: int) -> None:
        self.newer.append((name, found))

    def unindexed(self, name: str, reason: str) -> None:
        self.not_indexed.append((name, reason))

    def staged_on_disk(self, name: str, reason: outcomes.StagingFallback, estimated_bytes: int) -> None:
        self.on_disk.append((name, reason, estimated_bytes))
