"""The files llama-server writes and reads in the slot dir: saves staged, rebuilds for restores. Blocking I/O.

A rebuild given back is kept as the slot dir's one spare (``SPARE``) when the slot dir is a tmpfs of
small pages, where allocating a file's pages is most of a rebuild's cost (261 MB: 0.10-0.19 s of
writing into a new file, 0.04-0.08 s over a spare's pages, Linux 6.18): the next rebuild overwrites
it in place. One spare at most (a second rebuild given back is deleted), so the slot dir still holds
at most one file of the sidecar's beyond what the server saves or restores; it is dropped when a save
would lack room for it, before a restart's rebuilds ahead, at start-up (a ``.tmp-`` name), and once no
rebuild took it for ``SPARE_SECONDS``: a burst of swaps reuses it, an idle sidecar holds no RAM in the
slot dir.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from sidecar.core import mounts, outcomes
from sidecar.snapshots import backing, manifest, slotdir, slotfile
from sidecar.snapshots.directory import PROBE_PREFIX, TEMP_PREFIX, Directory

SPARE = f"{TEMP_PREFIX}restore-spare.bin"
"""The rebuild kept for its pages (see the module docstring)."""
SPARE_SECONDS = 30.0
"""How long a spare waits for the next rebuild before it is deleted: an agent's or a busy host's swap per turn
reuses it (a turn on a loaded 2-core machine took well over 5 s), and the slot dir (RAM) is empty once no
restore came for that long."""


class Staging:
    """The staged files of one view of the slot dir; ``prefix``: its model's tag (see ``SnapshotStore.for_model``)."""

    def __init__(self, directory: Directory, prefix: str) -> None:
        self._dir = directory
        self._prefix = prefix
        self.keeps_spare = directory.blocks is not None and mounts.tmpfs_of_small_pages(directory.staging.path)
        """Whether a rebuild given back is kept as the spare whose pages the next one reuses."""
        self.spare_seconds = SPARE_SECONDS
        """Seconds a spare is kept unused (:data:`SPARE_SECONDS`)."""
        self._spare_lock = threading.Lock()
        self._spare_kept = 0
        """Counts the spares kept: a timer deletes the spare only if none was kept after the one it was set for."""

    def staged_bytes(self) -> int:
        """Bytes of the files staged in the slot dir now (RAM on a tmpfs): what is there, not what was counted."""
        if self._dir.blocks is None:
            return 0
        total = 0
        with contextlib.suppress(OSError):
            for entry in self._dir.staging.files():  # regular files only: a link to a file staged on disk is not
                if entry.name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                    with contextlib.suppress(OSError):
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    def place_save(self, temp: str, estimated_bytes: int) -> outcomes.StagingFallback | None:
        """Where llama-server writes (or reads) the staged ``temp``: None, the slot dir; else why on the store's disk.

        With a block store, a slot dir whose free space is below ``estimated_bytes`` (and some headroom) gets
        a link named ``temp`` to a file under ``STORE/staging`` (see :mod:`.spill`); if that cannot be made,
        the save stays in the slot dir (reported as an I/O error).
        """
        if self._dir.spill is None:
            return None
        reason = self._dir.spill.room(estimated_bytes)
        if reason is not None and self.drop_spare():
            reason = self._dir.spill.room(estimated_bytes)
        if reason is None:
            return None
        try:
            self._dir.spill.place(temp)
        except OSError as exc:
            self._dir.events.io_error(outcomes.SlotDirOperation.WRITE, temp, slotdir.describe(exc))
            return None
        self._dir.events.staged_on_disk(temp, reason, estimated_bytes)
        return reason

    def staged_in(self, name: str) -> slotdir.SlotDir:
        """The directory that holds the staged file ``name``: the slot dir, or the store's staging folder."""
        if self._dir.spill is not None and self._dir.spill.holds(name):
            return self._dir.spill.dir
        return self._dir.staging

    def staged_path(self, name: str) -> Path:
        """Where the staged file ``name`` is: in the slot dir, or the store's staging folder."""
        return self.staged_in(name).path / name

    @contextlib.contextmanager
    def released_if_failed(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if self._dir.spill is not None:
                self._dir.spill.release(name)
            raise

    @contextlib.contextmanager
    def released(self, name: str) -> Iterator[None]:
        """Remove the link and file of ``name`` staged on disk when the block ends, however it ends."""
        try:
            yield
        finally:
            if self._dir.spill is not None:
                self._dir.spill.release(name)

    def read_tokens(self, record: manifest.Manifest) -> slotfile.SlotTokens:
        """The token ids at the head of ``record``'s file; raises SlotFileError or OSError."""
        if self._dir.blocks is not None:
            return self._dir.blocks.read_tokens(record)
        return slotfile.read_tokens(self._dir.path / record.file)

    def stage(self, record: manifest.Manifest) -> str:
        """The name in the slot dir the server restores ``record`` from: its file, or a fresh staged rebuild
        of it (checked against its checksum; give it back with :meth:`unstage`). Raises SnapshotError."""
        if self._dir.blocks is None:
            return record.file
        name = f"{TEMP_PREFIX}restore-{self._prefix}{secrets.token_hex(6)}.bin"
        with self.released_if_failed(name):
            on_disk = self.place_save(name, record.bytes)
            if on_disk is None:
                spare = self._dir.staging.path / SPARE if self.keeps_spare else None
                self._dir.blocks.stage(record, self._dir.staging.path / name, reuse=spare)
            else:
                self._dir.blocks.stage(record, self.staged_in(name).path / name)
        return name

    def unstage(self, name: str, record: manifest.Manifest) -> None:
        """Delete what :meth:`stage` staged (nothing for a whole file), or keep it as the spare."""
        if self._dir.blocks is not None and name != record.file:
            if not self._keep_spare(name):
                self.remove(name)
            self._dir.blocks.unstaged(record.bytes)

    def _keep_spare(self, name: str) -> bool:
        """Make the staged ``name`` the spare, unless spares are not kept or one is already there."""
        if not self.keeps_spare or (self._dir.spill is not None and self._dir.spill.holds(name)):
            return False
        path = self._dir.staging.path
        if os.path.lexists(path / SPARE):
            return False
        with self._spare_lock:  # against a timer deleting the spare it was set for meanwhile
            try:
                os.rename(path / name, path / SPARE)
            except OSError:
                return False
            self._spare_kept += 1
            kept = self._spare_kept
        timer = threading.Timer(self.spare_seconds, self._expire_spare, args=(kept,))
        timer.daemon = True  # an exit does not wait for it: the start-up after removes ``.tmp-`` names
        timer.start()
        return True

    def _expire_spare(self, kept: int) -> None:
        """Delete the spare if it is still the one kept as number ``kept`` (no later one was kept since)."""
        with self._spare_lock:
            if kept == self._spare_kept:
                self.drop_spare()

    def drop_spare(self) -> bool:
        """Delete the spare; True if there was one."""
        try:
            os.unlink(self._dir.staging.path / SPARE)
        except OSError:
            return False
        return True

    def whole_file(self, record: manifest.Manifest) -> Path:
        """A path holding ``record``'s whole file to read (an upload): its own file, or a checked rebuild on
        the store's disk (not the slot dir: RAM holds one staged file at most); give it back with
        :meth:`release_whole`. Raises SnapshotError."""
        if self._dir.blocks is None:
            return self._dir.path / record.file
        path = self._dir.path / f"{TEMP_PREFIX}upload-{secrets.token_hex(6)}.bin"
        self._dir.blocks.stage(record, path)
        self._dir.blocks.unstaged(record.bytes)  # on disk, not staged in the slot dir
        return path

    def release_whole(self, path: Path, record: manifest.Manifest) -> None:
        if path != self._dir.path / record.file:
            backing.remove_quietly(path)

    def remove(self, name: str) -> None:
        """Remove a file of the server's (a temp, probe or staged name) from the slot dir, or its disk stand-in."""
        self._dir.staging.unlink(name)
        if self._dir.spill is not None:
            self._dir.spill.release(name)

    def exists(self, name: str) -> bool:
        """Whether the slot dir holds ``name`` (a temp, probe or staged name)."""
        return self._dir.staging.exists(name)
