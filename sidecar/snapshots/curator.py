"""Committed snapshots checked, quarantined and deleted. Blocking I/O."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from sidecar.core import errors, hashing, outcomes, safeio
from sidecar.snapshots import backing, manifest, slotdir
from sidecar.snapshots.directory import QUARANTINE_SUFFIX, Directory
from sidecar.snapshots.staging import Staging

QUARANTINE_KEEP = 4
"""Quarantined snapshots kept for inspection; older ones are deleted."""


class Curator:
    """Checks committed snapshots and takes bad or unwanted ones out of the slot dir."""

    def __init__(self, directory: Directory, staging: Staging) -> None:
        self._dir = directory
        self._staging = staging

    def check(self, record: manifest.Manifest) -> None:
        """Raise SnapshotError unless the file still has its manifest's size and checksum.

        The reason is ``checksum`` or ``size`` when the content is proven bad,
        ``io`` when it could not be read (nothing is known then). In a block store: the recipe and its
        blocks' sizes (the bytes are checked as the file is rebuilt, see :meth:`stage`).
        """
        if self._dir.blocks is not None:
            self._dir.blocks.check(record)
            return
        path = self._dir.path / record.file
        try:
            fd, st = safeio.open_regular(path)
            try:
                if st.st_size != record.bytes:
                    raise errors.SnapshotError(
                        f"{record.file} has {st.st_size} bytes, its manifest says {record.bytes}",
                        reason=outcomes.SnapshotProblem.SIZE,
                    )
                seconds = hashing.deadline_for(record.bytes)
                digest = hashing.fd_digest(
                    fd, record.checksum.algorithm, limit=record.bytes, deadline=time.monotonic() + seconds
                )
            finally:
                os.close(fd)
        except safeio.Refused as exc:
            raise errors.SnapshotError(
                f"{record.file} refused: {exc}", reason=outcomes.SnapshotProblem.NOT_REGULAR
            ) from exc
        except hashing.Overdue as exc:
            self._dir.events.io_error(
                outcomes.SlotDirOperation.READ, record.file, f"hashing took more than {seconds:.0f} s"
            )
            raise errors.SnapshotError(
                f"reading {record.file}: {exc}; not proven bad, tried again at the next check",
                reason=outcomes.SnapshotProblem.IO,
            ) from exc
        except FileNotFoundError as exc:
            if self._staging.exists(Path(record.file).stem + ".json"):
                raise errors.SnapshotError(f"{record.file} is gone", reason=outcomes.SnapshotProblem.SIZE) from exc
            raise errors.SnapshotError(
                f"{record.file} was removed meanwhile", reason=outcomes.SnapshotProblem.MISSING
            ) from exc
        except OSError as exc:
            self._dir.events.io_error(outcomes.SlotDirOperation.READ, record.file, slotdir.describe(exc))
            raise errors.SnapshotError(
                f"reading {record.file} failed: {slotdir.describe(exc)}", reason=outcomes.SnapshotProblem.IO
            ) from exc
        if digest != record.checksum.digest:
            raise errors.SnapshotError(
                f"{record.file} does not match its {record.checksum.algorithm} checksum (the file changed on disk)",
                reason=outcomes.SnapshotProblem.CHECKSUM,
            )

    def quarantine(self, file: str, reason: str, *, detail: str = "") -> None:
        """Take a snapshot out of use for good, keeping it for inspection.

        Only for proof of bad content (:data:`outcomes.BAD_CONTENT`); any other reason
        is reported as an I/O error and the files stay as they are.
        """
        if reason not in outcomes.BAD_CONTENT:
            self._dir.events.io_error(
                outcomes.SlotDirOperation.READ,
                file,
                f"not quarantined ({reason}: {detail}): nothing proves the file bad",
            )
            return
        proven = outcomes.SnapshotProblem(reason)
        record = self._dir.index.pop(file)
        if self._dir.read_only:
            self._dir.events.quarantined(file, proven, detail)
            return
        stem = Path(file).stem
        if self._dir.blocks is not None:  # its blocks stay until collected; its manifest stays for inspection
            self._dir.blocks.drop(backing.recipe_name(record) if record is not None else stem)
        for name in (stem + ".json", stem + ".bin"):
            self._dir.fs.set_aside(name, QUARANTINE_SUFFIX)
        self._dir.events.quarantined(file, proven, detail)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        fs = self._dir.fs
        try:
            entries = fs.files()
        except OSError:
            return
        dated: list[tuple[float, str]] = []
        kept = ".bin" if self._dir.blocks is None else ".json"
        for entry in entries:
            if entry.name.endswith(kept + QUARANTINE_SUFFIX):
                with contextlib.suppress(OSError):
                    dated.append((entry.stat().st_mtime, entry.name))
        for _, name in sorted(dated, reverse=True)[QUARANTINE_KEEP:]:
            stem = name.removesuffix(kept + QUARANTINE_SUFFIX)
            fs.unlink(name)
            fs.unlink(stem + ".json" + QUARANTINE_SUFFIX)

    def delete(self, record: manifest.Manifest) -> bool:
        """Unpublish (manifest first), then remove the file; False if an I/O error stopped it (reported)."""
        self._dir.index.pop(record.file)
        self._dir.recency.forget(record.file)
        gone = self._dir.fs.unlink(Path(record.file).stem + ".json")
        if self._dir.blocks is not None:  # its blocks no other recipe names go at the next collection
            return gone and (self._dir.blocks.drop(backing.recipe_name(record)) or True)
        return gone and self._dir.fs.unlink(record.file)

    def collect_blocks(self) -> None:
        """Delete the blocks no snapshot names any more (skipped while the block store is in use)."""
        if self._dir.blocks is not None:
            self._dir.blocks.collect()
