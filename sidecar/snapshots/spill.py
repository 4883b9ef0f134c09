"""Staging on disk when the slot dir lacks room: RAM stays bounded, no save fails for want of it. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/spill.py`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from sidecar.core import outcomes
from sidecar.snapshots import slotdir

FOLDER = "staging"
"""The folder of ``STORE`` a file staged on disk goes into."""
HEADROOM = 1 << 20
"""Bytes the slot dir keeps free beyond a staged file's estimated size (other files, the estimate's error)."""
FILE_MODE = 0o640


def fits(free_bytes: int, estimated_bytes: int) -> bool:
    """Whether a file of about ``estimated_bytes`` may be staged in a slot dir with ``free_bytes`` free. Pure."""
    return estimated_bytes + estimated_bytes // 16 + HEADROOM <= free_bytes


class Spill:
    """Files staged on the store's disk, each behind a link of its name in the slot dir."""

    def __init__(self, slot_dir: slotdir.SlotDir, store_root: Path, report: slotdir.Report) -> None:
        self._slot_dir = slot_dir
        self.dir = slotdir.SlotDir(store_root / FOLDER, report)
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def room(self, estimated_bytes: int) -> outcomes.StagingFallback | None:
        """None if a file of ``estimated_bytes`` fits in the slot dir now, else why it is staged on disk."""
        try:
            stats = os.statvfs(self._slot_dir.path)
        except OSError:
            return None  # the slot dir's own problem: reported by its checks, the save fails there
        return None if fits(stats.f_bavail * stats.f_frsize, estimated_bytes) else outcomes.StagingFallback.NO_ROOM

    def slot_dir_room(self) -> tuple[int, bool] | None:
        """The slot dir's free bytes and whether it is on the store's filesystem; None if it cannot be measured."""
        try:
            stats = os.statvfs(self._slot_dir.path)
            shares = os.stat(self._slot_dir.path).st_dev == os.stat(self.dir.path.parent).st_dev
        except OSError:
            return None
        return stats.f_bavail * stats.f_frsize, shares

    def place(self, name: str) -> Path:
        """Stage ``name`` on disk: an empty file in ``STORE/staging`` and a link to it in the slot dir; its path.

        Raises OSError (nothing left behind) if either cannot be made.
        """
        self.dir.path.mkdir(exist_ok=True)
        target = self.dir.path / name
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        os.close(fd)
        try:
            os.symlink(target, self._slot_dir.path / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(target)
            raise
        with self._lock:
            self._names.add(name)
        return target

    def holds(self, name: str) -> bool:
        """Whether ``name`` is staged on disk (its slot dir entry is a link this process made)."""
        with self._lock:
            return name in self._names

    def release(self, name: str) -> None:
        """Remove the link and its file (either may be gone already)."""
        with self._lock:
            if name not in self._names:
                return
            self._names.discard(name)
        self._slot_dir.unlink(name)
        self.dir.unlink(name)

    def staged_bytes(self) -> int:
        """Bytes staged on disk now."""
        with self._lock:
            names = list(self._names)
        total = 0
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(self.dir.path / name).st_size
        return total

    def clean(self) -> list[str]:
        """At start-up: remove what a crash left in ``STORE/staging`` (no save or restore of ours is in flight)."""
        findings: list[str] = []
        try:
            names = self.dir.names()
        except FileNotFoundError:
            return findings
        except OSError as exc:
            self.dir.failed(outcomes.SlotDirOperation.SCAN, exc)
            return findings
        for name in names:
            if self.dir.unlink(name):
                findings.append(f"removed {FOLDER}/{name} from the store: left over from an interrupted save")
        return findings
