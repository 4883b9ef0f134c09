"""What the snapshot store reports to its owner: why a file is out of use, and the hooks it calls.

:class:`StoreEvents` is given to the store at construction: ``run`` counts
and logs each report, the command-line tools print them, tests record them.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.core import outcomes


class StoreEvents(Protocol):
    """Told by the store, on the thread that found it, what it found in the slot dir."""

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        """A snapshot proven bad (``reason`` is in ``outcomes.BAD_CONTENT``) was taken out of use."""

    def io_error(self, operation: outcomes.SlotDirOperation, name: str, error: str) -> None:
        """An I/O error that was not retried away; nothing was quarantined or deleted for it."""

    def newer_format(self, name: str, found: int) -> None:
        """A manifest of a newer format (told once per file): left alone, not restored."""

    def unindexed(self, name: str, reason: str) -> None:
        """A committed file whose token header could not be read: restorable, not routable."""

    def staged_on_disk(self, name: str, reason: outcomes.StagingFallback, estimated_bytes: int) -> None:
        """A save or restore is staged on the store's disk, not in the slot dir (see :mod:`.spill`)."""


class Silent:
    """:class:`StoreEvents` that drops every report (the store's default)."""

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        del file, reason, detail

    def io_error(self, operation: outcomes.SlotDirOperation, name: str, error: str) -> None:
        del operation, name, error

    def newer_format(self, name: str, found: int) -> None:
        del name, found

    def unindexed(self, name: str, reason: str) -> None:
        del name, reason

    def staged_on_disk(self, name: str, reason: outcomes.StagingFallback, estimated_bytes: int) -> None:
        del name, reason, estimated_bytes
