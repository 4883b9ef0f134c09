"""What the running sidecar does with the store's reports: count each in its metric and log it.

The store calls these on the thread that found the problem (see
:class:`sidecar.snapshots.storeevents.StoreEvents`); counting and logging are
thread-safe.
"""

from __future__ import annotations

import structlog

from sidecar.core import metrics, outcomes

log = structlog.get_logger("sidecar.app")

QUARANTINE_HINTS = {
    "checksum": "the file changed on disk after it was saved: check the disk, and who writes the slot dir",
    "size": "the file was truncated, grew or vanished after it was saved: check the disk and free space",
    "manifest": "the manifest is damaged or names another file: check who writes the slot dir",
    "not_regular": "a symbolic link, FIFO or device was put in the slot dir under a snapshot's name; only "
    "llama-server and the sidecar should write there: check the volume's owners and mounts",
    "oversized": "no manifest is that large: something other than the sidecar wrote it; check who writes the slot dir",
}
"""What to check for each reason a snapshot was quarantined."""


class StoreLog:
    """:class:`~sidecar.snapshots.storeevents.StoreEvents` that counts and logs, for ``llama-kv-sidecar run``."""

    def __init__(self, stats: metrics.Metrics) -> None:
        self._stats = stats

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        self._stats.quarantined.labels(reason.value).inc()
        log.error(
            "snapshot_quarantined",
            file=file,
            reason=reason.value,
            detail=detail,
            effect="refused: never read further nor restored; renamed with a .quarantined suffix for inspection",
            hint=QUARANTINE_HINTS[reason.value],
        )

    def io_error(self, operation: outcomes.SlotDirOperation, name: str, error: str) -> None:
        self._stats.slot_dir_errors.labels(operation.value).inc()
        log.error(
            "slot_dir_io_error",
            operation=operation.value,
            file=name,
            error=error,
            effect="nothing is quarantined or deleted for it; retried at the next scan",
            hint="check the slot dir's disk, mount and permissions (the sidecar and llama-server need read and write)",
        )

    def unindexed(self, name: str, reason: str) -> None:
        log.warning(
            "snapshot_not_indexed",
            file=name,
            reason=reason,
            effect="kept and restorable into its slot, but the conversation library cannot route requests to it",
            hint="a llama-server of another slot file format wrote it; the sidecar reads format 4",
        )

    def staged_on_disk(self, name: str, reason: outcomes.StagingFallback, estimated_bytes: int) -> None:
        self._stats.staged_on_disk.labels(reason.value).inc()
        log.warning(
            "snapshot_staged_on_disk",
            file=name,
            reason=reason.value,
            estimated_bytes=estimated_bytes,
            effect="llama-server writes or reads this slot file on the store's disk through a link in the slot "
            "dir, not in RAM: it works, at the disk's speed",
            hint="give the slot dir's tmpfs more room (size= of the mount) than the largest slot file, "
            "or keep conversations shorter",
        )

    def newer_format(self, name: str, found: int) -> None:
        log.warning(
            "manifest_newer_format",
            file=name,
            format=found,
            effect="left alone, not restored: a newer llama-kv-sidecar wrote it",
            hint="run the newer llama-kv-sidecar on this slot dir, or remove the snapshot by hand",
        )
