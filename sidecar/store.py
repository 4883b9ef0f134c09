"""The snapshot directory: commit, verify, quarantine, delete. Blocking I/O.

The directory is llama-server's ``--slot-save-path``, shared with the server.
The server writes where it is told, non-atomically, so a save goes through
four steps before anyone can see it:

1. the server writes ``.tmp-slot<id>-<random>.bin`` (a name nobody restores);
2. :meth:`SnapshotStore.commit` checks the file's size against the server's
   ``n_written`` and that it holds tokens, hashes it while its pages are
   still cached and ``fdatasync``s it;
3. it renames the file to its final ``slot<id>-<stamp>.bin``;
4. it writes ``slot<id>-<stamp>.json`` (temp file, fsync, ``os.replace``,
   directory fsync). The manifest is the commit marker: a ``.bin`` without
   one is an interrupted commit and is removed at start-up.

Each manifest carries a generation, one more than the highest in the
directory, and snapshots are ordered by it, never by the wall clock: a
clock stepped back cannot make a new snapshot look older than the last.

Only proof of bad content (a checksum or size that does not match, a
manifest that does not parse) takes a snapshot out of use: its files are
renamed with a ``.quarantined`` suffix. An I/O error (EIO, EACCES, a file
vanishing between two calls) proves nothing about the content: the read is
retried, then reported through ``on_io_error`` and left for the next scan.
A manifest of a newer format is left alone and reported once through
``on_newer``. The methods here block; the async code calls them with
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sidecar import errors, hashing, manifest

TEMP_PREFIX = ".tmp-"
PROBE_PREFIX = ".probe-"
QUARANTINE_SUFFIX = ".quarantined"
QUARANTINE_KEEP = 4
"""Quarantined snapshots kept for inspection; older ones are deleted."""
FILE_MODE = 0o640
READ_ATTEMPTS = 3
"""Reads of a manifest before an I/O error is reported (and left for the next scan)."""
RETRY_PAUSE = 0.05
"""Seconds before the second read; doubled before the third."""


class Problem(enum.StrEnum):
    """``SnapshotError.reason`` values raised by the store."""

    CHECKSUM = "checksum"
    SIZE = "size"
    MANIFEST = "manifest"
    IO = "io"
    """An I/O error: nothing is known about the content."""
    MISSING = "missing"
    """The server's file is not in the slot dir (another directory, or gone)."""
    EMPTY = "empty"


BAD_CONTENT = frozenset({Problem.CHECKSUM, Problem.SIZE, Problem.MANIFEST})
"""The only reasons that quarantine a snapshot."""


class Clock(Protocol):
    def __call__(self) -> float: ...


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


class _BadContent(Exception):
    def __init__(self, reason: Problem, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class SnapshotStore:
    """The index of committed snapshots and every write to the slot dir."""

    def __init__(self, slot_dir: Path, *, clock: Clock, read_only: bool = False) -> None:
        self.dir = slot_dir
        self._clock = clock
        self._read_only = read_only
        """Report bad files through ``on_quarantine`` but rename nothing (``verify --dry-run``)."""
        self._lock = threading.Lock()
        self._index: dict[str, manifest.Manifest] = {}
        self._generation = 0
        """Highest generation seen or given out by this process."""
        self._problem = ""
        """The last filesystem error of a scan or a measurement; cleared by the next success."""
        self._newer_said: set[str] = set()
        self._blocked = ""
        """Why this process must stay off the directory (another sidecar holds it); empty when it may work."""
        self.on_quarantine: Callable[[str, str, str], None] = lambda name, reason, detail: None
        """Called with (file name, reason, detail) for each quarantined snapshot."""
        self.on_io_error: Callable[[str, str, str], None] = lambda operation, name, error: None
        """Called with (operation: read|write|scan, file name, error) for each I/O error that was not retried away."""
        self.on_newer: Callable[[str, int], None] = lambda name, found: None
        """Called once per manifest of a newer format, with its name and format."""

    # ---- reading -----------------------------------------------------------------

    def snapshots(self, slot: int | None = None) -> list[manifest.Manifest]:
        """Committed snapshots, newest (highest generation) first, optionally of one slot."""
        with self._lock:
            found = [m for m in self._index.values() if slot is None or m.slot == slot]
        return [] if self._blocked else manifest.newest_first(found)

    def usage(self) -> Usage:
        """Bytes and files in the slot dir and free space; never raises (see ``Usage.problem``)."""
        used = 0
        try:
            entries = self._entries()
            stats = os.statvfs(self.dir)
        except OSError as exc:
            with self._lock:
                count = len(self._index)
            return Usage(0, count, 0, self._failed("scan", "", exc))
        for entry in entries:
            with contextlib.suppress(OSError):  # removed since the listing
                used += entry.stat(follow_symlinks=False).st_size
        with self._lock:
            count = len(self._index)
        self._problem = ""
        return Usage(used_bytes=used, snapshot_files=count, free_bytes=stats.f_bavail * stats.f_frsize)

    def check_writable(self) -> str | None:
        """None if the slot dir is a writable directory, else what is wrong (for /readyz)."""
        if self._blocked:
            return self._blocked
        if not self.dir.is_dir():
            return (
                f"slot dir {self.dir} does not exist or is not a directory (removed, moved or unmounted?): "
                "no snapshots or restores until it is back"
            )
        if not os.access(self.dir, os.W_OK | os.X_OK):
            return f"slot dir {self.dir} is not writable by this user (uid {os.getuid()})"
        return self._problem or None

    def block(self, reason: str) -> None:
        """Stay off the directory: list no snapshots, commit nothing, until called with an empty reason."""
        self._blocked = reason

    def dir_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the slot dir, None while it is missing: tells a dir put back from a new one."""
        try:
            st = os.stat(self.dir)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    # ---- start-up and rescans ------------------------------------------------------

    def scan(self, *, clean: bool) -> list[str]:
        """Rebuild the index from the manifests on disk; returns log-worthy findings.

        With ``clean``, also delete leftovers of interrupted saves: temp files,
        probe files and ``.bin`` files without a manifest. Only do that at
        start-up, when no save of ours can be in flight. A directory that
        cannot be listed leaves the index as it was; a missing one empties it.
        """
        findings: list[str] = []
        try:
            names = {e.name for e in self._entries()}
            self._problem = ""
        except FileNotFoundError as exc:
            self._failed("scan", "", exc)
            names = set()
        except OSError as exc:
            self._failed("scan", "", exc)
            return findings
        with self._lock:
            before = dict(self._index)
        index: dict[str, manifest.Manifest] = {}
        for name in sorted(names):
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                if clean and self._unlink(name):
                    findings.append(f"removed {name}: left over from an interrupted save")
                continue
            if not name.endswith(".json") or name.endswith(QUARANTINE_SUFFIX):
                continue
            bin_name = Path(name).stem + ".bin"
            try:
                loaded = self._load(name)
            except OSError:
                loaded = before.get(bin_name)  # unreadable for now: keep what was known, retry next scan
            if loaded is not None:
                index[loaded.file] = loaded
        if clean:
            for name in sorted(names):
                stem_json = Path(name).stem + ".json"
                orphan = manifest.NAME_RE.match(name) and name not in index and stem_json not in names
                if orphan and self._unlink(name):
                    findings.append(f"removed {name}: its save was interrupted before the manifest was written")
        with self._lock:
            self._index = index
            self._generation = max([self._generation, *(m.generation for m in index.values())])
        return findings

    def refresh(self, name: str) -> None:
        """Re-read one file after a filesystem event."""
        if name.endswith(QUARANTINE_SUFFIX) or name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
            return
        stem = Path(name).stem
        bin_name, json_name = stem + ".bin", stem + ".json"
        if not manifest.NAME_RE.match(bin_name):
            return
        try:
            present = (self.dir / json_name).exists() and (self.dir / bin_name).exists()
            loaded = self._load(json_name) if present else None
        except OSError:
            return  # reported by _load or below; the index keeps what it knew
        with self._lock:
            if loaded is None:
                self._index.pop(bin_name, None)
            else:
                self._index[loaded.file] = loaded
                self._generation = max(self._generation, loaded.generation)

    def _load(self, json_name: str) -> manifest.Manifest | None:
        """Read and check one manifest; None if it is gone, bad (then quarantined) or of a newer format.

        Raises OSError when every read failed with an I/O error (already reported).
        """
        bin_name = Path(json_name).stem + ".bin"
        for attempt in range(READ_ATTEMPTS):
            try:
                return self._read(json_name, bin_name)
            except FileNotFoundError:
                return None  # deleted or renamed since the listing
            except manifest.NewerFormatError as exc:
                if json_name not in self._newer_said:
                    self._newer_said.add(json_name)
                    self.on_newer(json_name, exc.found)
                return None
            except _BadContent as bad:
                self.quarantine(bin_name, bad.reason, detail=bad.detail)
                return None
            except OSError as exc:
                if attempt + 1 == READ_ATTEMPTS:
                    self.on_io_error("read", json_name, _describe(exc))
                    raise
                time.sleep(RETRY_PAUSE * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, json_name: str, bin_name: str) -> manifest.Manifest:
        raw = (self.dir / json_name).read_bytes()
        try:
            loaded = manifest.Manifest.from_json(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadContent(Problem.MANIFEST, str(exc)) from exc
        if bin_name != loaded.file:
            raise _BadContent(Problem.MANIFEST, "manifest names another file")
        try:
            size = (self.dir / loaded.file).stat().st_size
        except FileNotFoundError:
            if not (self.dir / json_name).exists():
                raise  # both gone: deleted meanwhile, not damage
            raise _BadContent(Problem.SIZE, "snapshot file is missing") from None
        if size != loaded.bytes:
            raise _BadContent(Problem.SIZE, f"{size} bytes on disk, manifest says {loaded.bytes}")
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
            if self._blocked:
                raise errors.SnapshotError(self._blocked, reason=Problem.IO)
            try:
                size = path.stat().st_size
            except FileNotFoundError as exc:
                raise errors.SnapshotError(
                    f"the server reported writing {temp} but it is not in {self.dir}: "
                    "--slot-dir must be the same directory as llama-server's --slot-save-path",
                    reason=Problem.MISSING,
                ) from exc
            if tokens <= 0:
                raise errors.SnapshotError("the server saved 0 tokens: the slot is empty", reason=Problem.EMPTY)
            if size != written:
                raise errors.SnapshotError(
                    f"{temp} has {size} bytes but the server reported writing {written}", reason=Problem.SIZE
                )
            digest = hashing.digest_and_sync(path)
            os.chmod(path, FILE_MODE)
            now = self._clock()
            final = self._free_name(slot, now)
            with self._lock:
                generation = max([self._generation, *(m.generation for m in self._index.values())]) + 1
                self._generation = generation
            record = manifest.Manifest(
                slot=slot,
                file=final,
                tokens=tokens,
                bytes=size,
                checksum=manifest.Checksum(hashing.CURRENT, digest),
                generation=generation,
                created=now,
                task=task,
                fingerprint=fingerprint,
            )
            os.replace(path, self.dir / final)
        except OSError as exc:
            self._unlink(temp)
            raise errors.SnapshotError(f"committing {temp} failed: {_describe(exc)}", reason=Problem.IO) from exc
        except BaseException:
            self._unlink(temp)
            raise
        try:
            self._write_manifest(record)
        except OSError as exc:
            self._unlink(final)
            raise errors.SnapshotError(
                f"writing the manifest of {final} failed: {_describe(exc)}", reason=Problem.IO
            ) from exc
        except BaseException:
            self._unlink(final)
            raise
        with self._lock:
            self._index[final] = record
        return record

    def _free_name(self, slot: int, now: float) -> str:
        """``slot<id>-<stamp>.bin`` for ``now``, moved on by microseconds if a file has that name."""
        stamp = datetime.datetime.fromtimestamp(now, datetime.UTC)
        while True:
            final = f"slot{slot}-{stamp.strftime('%Y%m%dT%H%M%S%fZ')}.bin"
            if not (self.dir / final).exists() and not (self.dir / (Path(final).stem + ".json")).exists():
                return final
            stamp += datetime.timedelta(microseconds=1)

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
        """Raise SnapshotError unless the file still has its manifest's size and checksum.

        The reason is ``checksum`` or ``size`` when the content is proven bad,
        ``io`` when it could not be read (nothing is known then).
        """
        path = self.dir / record.file
        try:
            size = path.stat().st_size
            if size != record.bytes:
                raise errors.SnapshotError(
                    f"{record.file} has {size} bytes, its manifest says {record.bytes}", reason=Problem.SIZE
                )
            digest = hashing.file_digest(path, record.checksum.algorithm)
        except FileNotFoundError as exc:
            if self.exists(Path(record.file).stem + ".json"):
                raise errors.SnapshotError(f"{record.file} is gone", reason=Problem.SIZE) from exc
            raise errors.SnapshotError(f"{record.file} was removed meanwhile", reason=Problem.MISSING) from exc
        except OSError as exc:
            self.on_io_error("read", record.file, _describe(exc))
            raise errors.SnapshotError(f"reading {record.file} failed: {_describe(exc)}", reason=Problem.IO) from exc
        if digest != record.checksum.digest:
            raise errors.SnapshotError(
                f"{record.file} does not match its {record.checksum.algorithm} checksum (the file changed on disk)",
                reason=Problem.CHECKSUM,
            )

    def quarantine(self, file: str, reason: str, *, detail: str = "") -> None:
        """Take a snapshot out of use for good, keeping it for inspection.

        Only for proof of bad content (:data:`BAD_CONTENT`); any other reason
        is reported as an I/O error and the files stay as they are.
        """
        if reason not in BAD_CONTENT:
            self.on_io_error("read", file, f"not quarantined ({reason}: {detail}): nothing proves the file bad")
            return
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
            except OSError as exc:
                self.on_io_error("write", name, _describe(exc))
        self.on_quarantine(file, reason, detail)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        try:
            entries = self._entries()
        except OSError:
            return
        dated: list[tuple[float, str]] = []
        for entry in entries:
            if entry.name.endswith(".bin" + QUARANTINE_SUFFIX):
                with contextlib.suppress(OSError):
                    dated.append((entry.stat().st_mtime, entry.name))
        for _, name in sorted(dated, reverse=True)[QUARANTINE_KEEP:]:
            stem = name.removesuffix(".bin" + QUARANTINE_SUFFIX)
            self._unlink(name)
            self._unlink(stem + ".json" + QUARANTINE_SUFFIX)

    def delete(self, record: manifest.Manifest) -> bool:
        """Unpublish (manifest first), then remove the file; False if an I/O error stopped it (reported)."""
        with self._lock:
            self._index.pop(record.file, None)
        return self._unlink(Path(record.file).stem + ".json") and self._unlink(record.file)

    def remove(self, name: str) -> None:
        self._unlink(name)

    def exists(self, name: str) -> bool:
        try:
            return (self.dir / name).exists()
        except OSError:
            return False

    def _unlink(self, name: str) -> bool:
        """Remove a file; True if it is gone (also if it was never there)."""
        try:
            (self.dir / name).unlink()
        except FileNotFoundError:
            return True
        except OSError as exc:
            self.on_io_error("write", name, _describe(exc))
            return False
        return True

    def _entries(self) -> list[os.DirEntry[str]]:
        """Regular files of the slot dir; raises OSError if it cannot be listed."""
        found = []
        with os.scandir(self.dir) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        found.append(entry)
        return found

    def _failed(self, operation: str, name: str, exc: OSError) -> str:
        """Remember and report a filesystem error of the slot dir itself; returns the problem."""
        problem = f"slot dir {self.dir}: {_describe(exc)}"
        if problem != self._problem:
            self.on_io_error(operation, name, _describe(exc))
        self._problem = problem
        return problem


def _describe(exc: OSError) -> str:
    name = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    return f"{name} ({type(exc).__name__}, errno {exc.errno})" + (f": {exc.filename}" if exc.filename else "")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
