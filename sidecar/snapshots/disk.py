"""The disk of one snapshot directory: what it holds, what is free, whether it takes writes. Blocking I/O.

Every measure here is read afresh and never raises: what stopped it is said instead (``Usage.problem``,
a string for :meth:`Disk.free_bytes`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar.snapshots import slotdir
from sidecar.snapshots.directory import Directory
from sidecar.snapshots.staging import Staging


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    used_bytes: int
    """Bytes of every regular file in the slot dir (snapshots, temp, quarantine)."""
    snapshot_files: int
    """Committed snapshots (those with a manifest)."""
    free_bytes: int
    """Bytes free for unprivileged users on the slot dir's filesystem (0 when unknown)."""
    problem: str = ""
    """Why the slot dir could not be measured; empty when it could."""
    unique_bytes: int = 0
    """With a block store: bytes of its blocks, each stored once (0 without one)."""
    represented_bytes: int = 0
    """With a block store: the sum of its files' sizes, what whole files would take."""
    staged_bytes: int = 0
    """With a block store: bytes staged in the slot dir now (saves not yet ingested, rebuilds for restores)."""


class Disk:
    """The directory's disk (and the block store's, with ``--store-dir``), as the store's part ``disk``."""

    def __init__(self, directory: Directory, staged: Staging) -> None:
        self._dir = directory
        self._staged = staged

    @property
    def keeps(self) -> Path:
        """Where the snapshots' bytes are kept: the block store's root, or the slot dir."""
        return self._dir.path if self._dir.blocks is None else self._dir.blocks.root

    def usage(self) -> Usage:
        """Bytes and files in the slot dir and free space; never raises (see ``Usage.problem``)."""
        measured = self._dir.fs.measure()
        count = self._dir.index.count()
        if isinstance(measured, str):
            return Usage(0, count, 0, measured)
        if self._dir.blocks is None:
            return Usage(used_bytes=measured[0], snapshot_files=count, free_bytes=measured[1])
        try:
            held = self._dir.blocks.usage()
        except OSError as exc:
            return Usage(0, count, 0, f"cannot measure the block store: {slotdir.describe(exc)}")
        return Usage(
            used_bytes=measured[0] + held.unique_bytes,
            snapshot_files=count,
            free_bytes=measured[1],
            unique_bytes=held.unique_bytes,
            represented_bytes=held.represented_bytes,
            staged_bytes=self._staged.staged_bytes(),
        )

    def free_bytes(self) -> int | str:
        """Free bytes on the slot dir's filesystem, or what stopped the measure: :meth:`usage` without listing
        the slot dir or the block store's changed folders and recipes, for a check made before every save."""
        return self._dir.fs.free()

    def staging_room(self) -> tuple[int, bool] | None:
        """With a block store: the slot dir's free bytes and whether the store's disk is its filesystem
        (None without a block store, or if unmeasurable)."""
        return None if self._dir.spill is None else self._dir.spill.slot_dir_room()

    def check_writable(self) -> str | None:
        """None if the slot dir is a writable directory, else what is wrong (for /readyz)."""
        return self._dir.index.blocked or self._dir.fs.check()

    def block(self, reason: str) -> None:
        """Stay off the directory: list no snapshots, commit nothing, until called with an empty reason."""
        self._dir.index.blocked = reason

    def dir_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the slot dir, None while it is missing: tells a dir put back from a new one."""
        return self._dir.fs.identity()
