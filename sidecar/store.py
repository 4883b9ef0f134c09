"""The snapshot directory: commit, verify, quarantine, delete. Blocking I/O.

The directory is llama-server's ``--slot-save-path``, shared with the server.
The server writes where it is told, non-atomically, so a save goes through
four steps before anyone can see it:

1. the server writes ``.tmp-slot<id>-<random>.bin`` (a name nobody restores);
2. :meth:`SnapshotStore.commit` checks the file's size against the server's
   ``n_written`` and that it holds tokens, hashes it and fsyncs it;
3. it renames the file to its final ``slot<id>-<stamp>.bin``;
4. it writes ``slot<id>-<stamp>.json`` (temp file, fsync, ``os.replace``,
   directory fsync). The manifest is the commit marker: a ``.bin`` without
   one is an interrupted commit and is removed at start-up.

Files that fail a check are renamed with a ``.quarantined`` suffix so they
are never offered to the server again. The methods here block; the async
code calls them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from sidecar import errors, manifest

TEMP_PREFIX = ".tmp-"
PROBE_PREFIX = ".probe-"
QUARANTINE_SUFFIX = ".quarantined"
QUARANTINE_KEEP = 4
"""Quarantined snapshots kept for inspection; older ones are deleted."""
FILE_MODE = 0o640


class Clock(Protocol):
    def __call__(self) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    used_bytes: int
    """Bytes of every regular file in the slot dir (snapshots, temp, quarantine)."""
    snapshot_files: int
    """Committed snapshots (those with a manifest)."""
    free_bytes: int
    """Bytes free for unprivileged users on the slot dir's filesystem."""


class SnapshotStore:
    """The index of committed snapshots and every write to the slot dir."""

    def __init__(self, slot_dir: Path, *, clock: Clock, read_only: bool = False) -> None:
        self.dir = slot_dir
        self._clock = clock
        self._read_only = read_only
        """Report bad files through ``on_quarantine`` but rename nothing (``verify --dry-run``)."""
        self._lock = threading.Lock()
        self._index: dict[str, manifest.Manifest] = {}
        self.on_quarantine: Callable[[str, str, str], None] = lambda name, reason, detail: None
        """Called with (file name, reason, detail) for each quarantined snapshot."""

    # ---- reading -----------------------------------------------------------------

    def snapshots(self, slot: int | None = None) -> list[manifest.Manifest]:
        """Committed snapshots, newest first, optionally of one slot."""
        with self._lock:
            found = [m for m in self._index.values() if slot is None or m.slot == slot]
        return sorted(found, key=lambda m: (m.created, m.file), reverse=True)

    def usage(self) -> Usage:
        used = 0
        for entry in self._entries():
            try:
                used += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        stats = os.statvfs(self.dir)
        with self._lock:
            count = len(self._index)
        return Usage(used_bytes=used, snapshot_files=count, free_bytes=stats.f_bavail * stats.f_frsize)

    def check_writable(self) -> str | None:
        """None if the slot dir is a writable directory, else what is wrong."""
        if not self.dir.is_dir():
            return f"slot dir {self.dir} does not exist or is not a directory"
        if not os.access(self.dir, os.W_OK | os.X_OK):
            return f"slot dir {self.dir} is not writable by this user (uid {os.getuid()})"
        return None

    # ---- start-up and rescans ------------------------------------------------------

    def scan(self, *, clean: bool) -> list[str]:
        """Rebuild the index from the manifests on disk; returns log-worthy findings.

        With ``clean``, also delete leftovers of interrupted saves: temp files,
        probe files and ``.bin`` files without a manifest. Only do that at
        start-up, when no save of ours can be in flight.
        """
        findings: list[str] = []
        index: dict[str, manifest.Manifest] = {}
        names = {e.name for e in self._entries()}
        for name in sorted(names):
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                if clean:
                    self._unlink(name)
                    findings.append(f"removed {name}: left over from an interrupted save")
                continue
            if not name.endswith(".json") or name.endswith(QUARANTINE_SUFFIX):
                continue
            loaded = self._load(name)
            if loaded is not None:
                index[loaded.file] = loaded
        if clean:
            for name in sorted(names):
                if manifest.NAME_RE.match(name) and name not in index and (Path(name).stem + ".json") not in names:
                    self._unlink(name)
                    findings.append(f"removed {name}: its save was interrupted before the manifest was written")
        with self._lock:
            self._index = index
        return findings

    def refresh(self, name: str) -> None:
        """Re-read one file after a filesystem event (called on the event loop thread)."""
        if name.endswith(QUARANTINE_SUFFIX) or name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
            return
        stem = Path(name).stem
        bin_name, json_name = stem + ".bin", stem + ".json"
        if not manifest.NAME_RE.match(bin_name):
            return
        if not (self.dir / json_name).exists() or not (self.dir / bin_name).exists():
            with self._lock:
                self._index.pop(bin_name, None)
            return
        loaded = self._load(json_name)
        if loaded is not None:
            with self._lock:
                self._index[loaded.file] = loaded

    def _load(self, json_name: str) -> manifest.Manifest | None:
        try:
            loaded = manifest.Manifest.from_json((self.dir / json_name).read_text())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            self.quarantine(Path(json_name).stem + ".bin", "manifest", detail=str(exc))
            return None
        if Path(json_name).stem + ".bin" != loaded.file:
            self.quarantine(Path(json_name).stem + ".bin", "manifest", detail="manifest names another file")
            return None
        try:
            size = (self.dir / loaded.file).stat().st_size
        except FileNotFoundError:
            self.quarantine(loaded.file, "size", detail="snapshot file is missing")
            return None
        if size != loaded.bytes:
            self.quarantine(loaded.file, "size", detail=f"{size} bytes on disk, manifest says {loaded.bytes}")
            return None
        return loaded

    # ---- writing -------------------------------------------------------------------

    def temp_name(self, slot: int) -> str:
        return f"{TEMP_PREFIX}slot{slot}-{secrets.token_hex(6)}.bin"

    def probe_name(self) -> str:
        return f"{PROBE_PREFIX}{secrets.token_hex(6)}.bin"

    def commit(
        self,
        temp: str,
        *,
        slot: int,
        tokens: int,
        written: int,
        task: int | None,
        fingerprint: manifest.Fingerprint,
    ) -> manifest.Manifest:
        """Check, hash and publish a file the server just wrote; see the module docstring."""
        path = self.dir / temp
        try:
            try:
                size = path.stat().st_size
            except FileNotFoundError as exc:
                raise errors.SnapshotError(
                    f"the server reported writing {temp} but it is not in {self.dir}: "
                    "--slot-dir must be the same directory as llama-server's --slot-save-path",
                    reason="missing",
                ) from exc
            if tokens <= 0:
                raise errors.SnapshotError("the server saved 0 tokens: the slot is empty", reason="empty")
            if size != written:
                raise errors.SnapshotError(
                    f"{temp} has {size} bytes but the server reported writing {written}", reason="size"
                )
            digest = _hash_and_sync(path)
            os.chmod(path, FILE_MODE)
            now = self._clock()
            stamp = datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
            final = f"slot{slot}-{stamp}.bin"
            record = manifest.Manifest(
                slot=slot,
                file=final,
                tokens=tokens,
                bytes=size,
                sha256=digest,
                created=now,
                task=task,
                fingerprint=fingerprint,
            )
            os.replace(path, self.dir / final)
        except OSError as exc:
            self._unlink(temp)
            raise errors.SnapshotError(f"committing {temp} failed: {exc}", reason="io") from exc
        except BaseException:
            self._unlink(temp)
            raise
        try:
            self._write_manifest(record)
        except OSError as exc:
            self._unlink(final)
            raise errors.SnapshotError(f"writing the manifest of {final} failed: {exc}", reason="io") from exc
        except BaseException:
            self._unlink(final)
            raise
        with self._lock:
            self._index[final] = record
        return record

    def _write_manifest(self, record: manifest.Manifest) -> None:
        target = self.dir / (Path(record.file).stem + ".json")
        temp = self.dir / f"{TEMP_PREFIX}{secrets.token_hex(6)}.json"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            with os.fdopen(fd, "w") as fh:
                fh.write(record.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temp, target)
        except BaseException:
            self._unlink(temp.name)
            raise
        _fsync_dir(self.dir)

    def verify(self, record: manifest.Manifest) -> None:
        """Raise SnapshotError unless the file still has its manifest's size and sha256."""
        path = self.dir / record.file
        try:
            size = path.stat().st_size
            if size != record.bytes:
                raise errors.SnapshotError(
                    f"{record.file} has {size} bytes, its manifest says {record.bytes}", reason="size"
                )
            digest = _hash(path)
        except FileNotFoundError as exc:
            raise errors.SnapshotError(f"{record.file} is gone", reason="size") from exc
        if digest != record.sha256:
            raise errors.SnapshotError(
                f"{record.file} does not match its sha256 (the file changed on disk)", reason="checksum"
            )

    def quarantine(self, file: str, reason: str, *, detail: str = "") -> None:
        """Take a snapshot out of use for good, keeping it for inspection."""
        with self._lock:
            self._index.pop(file, None)
        if self._read_only:
            self.on_quarantine(file, reason, detail)
            return
        stem = Path(file).stem
        for name in (stem + ".json", stem + ".bin"):
            try:
                os.replace(self.dir / name, self.dir / (name + QUARANTINE_SUFFIX))
            except FileNotFoundError:
                continue
        self.on_quarantine(file, reason, detail)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        kept = sorted(
            (e for e in self._entries() if e.name.endswith(".bin" + QUARANTINE_SUFFIX)),
            key=lambda e: e.stat().st_mtime,
            reverse=True,
        )
        for entry in kept[QUARANTINE_KEEP:]:
            stem = entry.name.removesuffix(".bin" + QUARANTINE_SUFFIX)
            self._unlink(entry.name)
            self._unlink(stem + ".json" + QUARANTINE_SUFFIX)

    def delete(self, record: manifest.Manifest) -> None:
        """Unpublish (manifest first), then remove the file."""
        with self._lock:
            self._index.pop(record.file, None)
        self._unlink(Path(record.file).stem + ".json")
        self._unlink(record.file)

    def remove(self, name: str) -> None:
        self._unlink(name)

    def exists(self, name: str) -> bool:
        return (self.dir / name).exists()

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / name).unlink()

    def _entries(self) -> Iterable[os.DirEntry[str]]:
        try:
            with os.scandir(self.dir) as it:
                return [e for e in it if e.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []


def _hash(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _hash_and_sync(path: Path) -> str:
    with path.open("rb+") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        os.fsync(fh.fileno())
    return digest


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
