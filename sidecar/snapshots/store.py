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
manifest that does not parse, a name that is not a regular file or a
manifest larger than any manifest) takes a snapshot out of use: its files
are renamed with a ``.quarantined`` suffix. Every file of the directory is
read through :mod:`sidecar.core.safeio` (no symbolic links, regular files
only, sizes bounded before anything is read, hashes bounded by the
manifest's size and a deadline), so no file put there can hang the sidecar
or be handed to the server from outside the directory. An I/O error (EIO, EACCES, a file
vanishing between two calls) proves nothing about the content: the read is
retried, then reported through ``on_io_error`` and left for the next scan.
A manifest of a newer format is left alone and reported once through
``on_newer``. The methods here block; the async code calls them with
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import enum
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from sidecar.core import errors, hashing, safeio
from sidecar.snapshots import manifest, slotdir, slotfile

TEMP_PREFIX = slotdir.TEMP_PREFIX
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
    NOT_REGULAR = "not_regular"
    """A snapshot's name is a symbolic link, a FIFO, a device, ...: never read, never restored."""
    OVERSIZED = "oversized"
    """A manifest larger than ``manifest.MAX_BYTES``: refused unread."""


BAD_CONTENT = frozenset({Problem.CHECKSUM, Problem.SIZE, Problem.MANIFEST, Problem.NOT_REGULAR, Problem.OVERSIZED})
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
        self._fs = slotdir.SlotDir(slot_dir, self._report)
        self._clock = clock
        self._read_only = read_only
        """Report bad files through ``on_quarantine`` but rename nothing (``verify --dry-run``)."""
        self._lock = threading.Lock()
        self._index: dict[str, manifest.Manifest] = {}
        self._generation = 0
        """Highest generation seen or given out by this process."""
        self._newer_said: set[str] = set()
        self._blocked = ""
        """Why this process must stay off the directory (another sidecar holds it); empty when it may work."""
        self.on_quarantine: Callable[[str, str, str], None] = lambda name, reason, detail: None
        """Called with (file name, reason, detail) for each quarantined snapshot."""
        self.on_io_error: Callable[[str, str, str], None] = lambda operation, name, error: None
        """Called with (operation: read|write|scan, file name, error) for each I/O error that was not retried away."""
        self.on_newer: Callable[[str, int], None] = lambda name, found: None
        """Called once per manifest of a newer format, with its name and format."""
        self.on_unindexed: Callable[[str, str], None] = lambda name, reason: None
        """Called with (file name, reason) when a committed file's token header could not be read."""
        self._listeners: list[Callable[[manifest.Manifest], None]] = []
        self._last_used: dict[str, float] = {}
        """Unix time each snapshot was last saved, restored or routed to (its ``created`` until then)."""
        self._in_use: dict[str, int] = {}
        """Snapshots being restored or uploaded now: retention never selects them."""
        self.model: str | None = None
        """The router-mode model this store writes (see :meth:`for_model`); None: a plain server's."""
        self._every = True
        """This store lists the snapshots of every model; a :meth:`for_model` view lists its model's only."""
        self._root = self

    def for_model(self, model: str | None) -> SnapshotStore:
        """A view of the same directory and index that lists and writes only ``model``'s snapshots.

        In llama-server's router mode every model's server shares one slot dir:
        each model's files carry its :func:`manifest.model_tag` and its manifests
        its name. ``None`` is a plain llama-server's (no tag): its engine never
        sees a model's files. Scans, quarantine and the index stay shared with
        this store, which lists every snapshot (``ls``, ``verify``, ``/status``).
        """
        view = copy.copy(self)
        view.model = model
        view._every = False
        return view

    @property
    def _prefix(self) -> str:
        return "" if self.model is None else manifest.model_tag(self.model) + "--"

    def _report(self, operation: str, name: str, error: str) -> None:
        self.on_io_error(operation, name, error)  # looked up at each call: callers set it after construction

    # ---- reading -----------------------------------------------------------------

    def snapshots(self, slot: int | None = None) -> list[manifest.Manifest]:
        """Committed snapshots, newest (highest generation) first, optionally of one slot."""
        with self._lock:
            found = [
                m
                for m in self._index.values()
                if (slot is None or m.slot == slot) and (self._every or m.model == self.model)
            ]
        return [] if self._root._blocked else manifest.newest_first(found)

    # ---- the conversation library ---------------------------------------------------

    def library(self) -> list[manifest.Manifest]:
        """Committed snapshots indexed by content, newest first."""
        return [m for m in self.snapshots() if m.index is not None and m.index.chain]

    def best(self, chain: tuple[str, ...]) -> tuple[manifest.Manifest, int] | None:
        """The snapshot sharing the most leading blocks with ``chain`` (the smaller on a tie); None if none does."""
        found: tuple[manifest.Manifest, int] | None = None
        for m in self.library():
            assert m.index is not None
            shared = slotfile.shared_blocks(chain, m.index.chain)
            if shared and (found is None or shared > found[1] or (shared == found[1] and m.bytes < found[0].bytes)):
                found = (m, shared)
        return found

    def subscribe(self, listener: Callable[[manifest.Manifest], None]) -> None:
        """Call ``listener`` with each manifest this store commits, right after it became visible."""
        self._listeners.append(listener)

    def last_used(self, file: str) -> float:
        """Unix time ``file`` was last used: committed, or touched (kept across restarts as its manifest's mtime)."""
        with self._lock:
            known = self._last_used.get(file)
            record = self._index.get(file)
        if known is not None:
            return known
        if record is None:
            return 0.0
        try:
            touched = (self.dir / (Path(file).stem + ".json")).stat().st_mtime
        except OSError:
            touched = 0.0
        return max(record.created, touched)

    def touch(self, file: str) -> None:
        """Note that a snapshot was used now (restored into a slot for a request)."""
        now = self._clock()
        with self._lock:
            self._last_used[file] = now
        if not self._read_only:
            with contextlib.suppress(OSError):
                os.utime(self.dir / (Path(file).stem + ".json"), (now, now))

    @contextlib.contextmanager
    def using(self, file: str) -> Iterator[None]:
        """Keep retention off ``file`` while the block runs."""
        with self._lock:
            self._in_use[file] = self._in_use.get(file, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_use.pop(file) - 1
                if left:
                    self._in_use[file] = left

    def in_use(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._in_use)

    def usage(self) -> Usage:
        """Bytes and files in the slot dir and free space; never raises (see ``Usage.problem``)."""
        measured = self._fs.measure()
        with self._lock:
            count = len(self._index)
        if isinstance(measured, str):
            return Usage(0, count, 0, measured)
        return Usage(used_bytes=measured[0], snapshot_files=count, free_bytes=measured[1])

    def check_writable(self) -> str | None:
        """None if the slot dir is a writable directory, else what is wrong (for /readyz)."""
        return self._root._blocked or self._fs.check()

    def block(self, reason: str) -> None:
        """Stay off the directory: list no snapshots, commit nothing, until called with an empty reason."""
        self._root._blocked = reason

    def dir_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the slot dir, None while it is missing: tells a dir put back from a new one."""
        return self._fs.identity()

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
            names = set(self._fs.names())  # not only regular files: a hostile one is refused by name
        except FileNotFoundError as exc:
            self._fs.failed("scan", exc)
            names = set()
        except OSError as exc:
            self._fs.failed("scan", exc)
            return findings
        with self._lock:
            before = dict(self._index)
        index: dict[str, manifest.Manifest] = {}
        for name in sorted(names):
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                if clean and self._fs.unlink(name):
                    findings.append(f"removed {name}: left over from an interrupted save")
                continue
            bin_name = Path(name).stem + ".bin"
            if not name.endswith(".json") or not manifest.NAME_RE.match(bin_name):
                continue  # not a manifest: quarantined, or a file of ours (.llama-kv-sidecar.*) or someone else's
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
                if orphan and self._fs.unlink(name):
                    findings.append(f"removed {name}: its save was interrupted before the manifest was written")
        with self._lock:
            self._index.clear()  # in place: the views of :meth:`for_model` share this dict
            self._index.update(index)
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
            present = os.path.lexists(self.dir / json_name) and os.path.lexists(self.dir / bin_name)
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
                    self.on_io_error("read", json_name, slotdir.describe(exc))
                    raise
                time.sleep(RETRY_PAUSE * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, json_name: str, bin_name: str) -> manifest.Manifest:
        try:
            raw = safeio.read_bounded(self.dir / json_name, manifest.MAX_BYTES)
        except safeio.Refused as exc:
            raise _BadContent(Problem(exc.reason), f"manifest refused unread: {exc}") from exc
        try:
            loaded = manifest.Manifest.from_json(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadContent(Problem.MANIFEST, str(exc)) from exc
        if bin_name != loaded.file:
            raise _BadContent(Problem.MANIFEST, "manifest names another file")
        try:
            size = safeio.lstat_regular(self.dir / loaded.file).st_size
        except safeio.Refused as exc:
            raise _BadContent(Problem.NOT_REGULAR, f"snapshot refused: {exc}") from exc
        except FileNotFoundError:
            if not os.path.lexists(self.dir / json_name):
                raise  # both gone: deleted meanwhile, not damage
            raise _BadContent(Problem.SIZE, "snapshot file is missing") from None
        if size != loaded.bytes:
            raise _BadContent(Problem.SIZE, f"{size} bytes on disk, manifest says {loaded.bytes}")
        return loaded

    # ---- writing -------------------------------------------------------------------

    def temp_name(self, slot: int) -> str:
        return f"{TEMP_PREFIX}{self._prefix}slot{slot}-{secrets.token_hex(6)}.bin"

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
        pause: float = 0.0,
        created: float | None = None,
        prefill_rate: float | None = None,
    ) -> manifest.Manifest:
        """Check, hash and publish a file the server just wrote; see the module docstring.

        ``pause``: the hash's pause after each chunk (``hashing.PACE`` while other slots generate).
        ``created``: Unix time of the server's save (None: now); a commit made later than the save
        (see :mod:`sidecar.act.snapshotter`) still dates the snapshot by its content.
        ``prefill_rate``: the writing server's measured prompt tokens per second (see ``Manifest``).
        """
        path = self.dir / temp
        with self._removed_if_failed(temp, f"committing {temp}"):
            size = self._check_written(temp, tokens=tokens, written=written)
            digest = hashing.digest_and_sync(path, pause=pause, limit=size)
            index = self._read_index(path)
            os.chmod(path, FILE_MODE)
            now = self._clock() if created is None else created
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
                index=index,
                model=self.model,
                prefill_rate=prefill_rate,
            )
            os.replace(path, self.dir / final)
        with self._removed_if_failed(final, f"writing the manifest of {final}"):
            self._fs.write_atomically(Path(final).stem + ".json", record.to_json(), mode=FILE_MODE)
        with self._lock:
            self._index[final] = record
        for listener in self._listeners:
            listener(record)
        return record

    def check_written(self, temp: str, *, tokens: int, written: int) -> None:
        """The cheap checks of :meth:`commit` (the file is here, holds tokens, has the size the server
        reported), made right after the save when its commit waits; raises ``errors.SnapshotError``
        and removes the file when one fails."""
        with self._removed_if_failed(temp, f"checking {temp}"):
            self._check_written(temp, tokens=tokens, written=written)

    @contextlib.contextmanager
    def _removed_if_failed(self, name: str, doing: str) -> Iterator[None]:
        """Remove ``name`` if the block raises; an OSError becomes a SnapshotError (``io``) saying what failed."""
        try:
            yield
        except safeio.Refused as exc:
            self._fs.unlink(name)
            raise errors.SnapshotError(f"{doing} refused: {exc}", reason=Problem.NOT_REGULAR) from exc
        except hashing.Overdue as exc:
            self._fs.unlink(name)
            raise errors.SnapshotError(f"{doing}: {exc}", reason=Problem.IO) from exc
        except OSError as exc:
            self._fs.unlink(name)
            raise errors.SnapshotError(f"{doing} failed: {slotdir.describe(exc)}", reason=Problem.IO) from exc
        except BaseException:
            self._fs.unlink(name)
            raise

    def _check_written(self, temp: str, *, tokens: int, written: int) -> int:
        """The size of the server's file ``temp`` once it passed the checks that need no read."""
        if self._root._blocked:
            raise errors.SnapshotError(self._root._blocked, reason=Problem.IO)
        try:
            size = safeio.lstat_regular(self.dir / temp).st_size
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
        return size

    def _read_index(self, path: Path) -> manifest.Index | None:
        """The content index of a checked file; None (reported) when its token header cannot be read."""
        try:
            held = slotfile.read_tokens(path)
        except slotfile.SlotFileError as exc:
            self.on_unindexed(path.name, exc.reason)
            return None
        except safeio.Refused as exc:
            self.on_unindexed(path.name, exc.reason)
            return None
        except OSError as exc:
            self.on_unindexed(path.name, slotdir.describe(exc))
            return None
        return manifest.Index(held.count, slotfile.BLOCK_TOKENS, slotfile.prefix_hashes(held.data))

    def _free_name(self, slot: int, now: float) -> str:
        """``slot<id>-<stamp>.bin`` for ``now``, moved on by microseconds if a file has that name."""
        stamp = datetime.datetime.fromtimestamp(now, datetime.UTC)
        while True:
            final = f"{self._prefix}slot{slot}-{stamp.strftime('%Y%m%dT%H%M%S%fZ')}.bin"
            if not (self.dir / final).exists() and not (self.dir / (Path(final).stem + ".json")).exists():
                return final
            stamp += datetime.timedelta(microseconds=1)

    def verify(self, record: manifest.Manifest) -> None:
        """Raise SnapshotError unless the file still has its manifest's size and checksum.

        The reason is ``checksum`` or ``size`` when the content is proven bad,
        ``io`` when it could not be read (nothing is known then).
        """
        path = self.dir / record.file
        try:
            fd, st = safeio.open_regular(path)
            try:
                if st.st_size != record.bytes:
                    raise errors.SnapshotError(
                        f"{record.file} has {st.st_size} bytes, its manifest says {record.bytes}", reason=Problem.SIZE
                    )
                seconds = hashing.deadline_for(record.bytes)
                digest = hashing.fd_digest(
                    fd, record.checksum.algorithm, limit=record.bytes, deadline=time.monotonic() + seconds
                )
            finally:
                os.close(fd)
        except safeio.Refused as exc:
            raise errors.SnapshotError(f"{record.file} refused: {exc}", reason=Problem.NOT_REGULAR) from exc
        except hashing.Overdue as exc:
            self.on_io_error("read", record.file, f"hashing took more than {seconds:.0f} s")
            raise errors.SnapshotError(
                f"reading {record.file}: {exc}; not proven bad, tried again at the next check", reason=Problem.IO
            ) from exc
        except FileNotFoundError as exc:
            if self.exists(Path(record.file).stem + ".json"):
                raise errors.SnapshotError(f"{record.file} is gone", reason=Problem.SIZE) from exc
            raise errors.SnapshotError(f"{record.file} was removed meanwhile", reason=Problem.MISSING) from exc
        except OSError as exc:
            self.on_io_error("read", record.file, slotdir.describe(exc))
            raise errors.SnapshotError(
                f"reading {record.file} failed: {slotdir.describe(exc)}", reason=Problem.IO
            ) from exc
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
            self._fs.set_aside(name, QUARANTINE_SUFFIX)
        self.on_quarantine(file, reason, detail)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        try:
            entries = self._fs.files()
        except OSError:
            return
        dated: list[tuple[float, str]] = []
        for entry in entries:
            if entry.name.endswith(".bin" + QUARANTINE_SUFFIX):
                with contextlib.suppress(OSError):
                    dated.append((entry.stat().st_mtime, entry.name))
        for _, name in sorted(dated, reverse=True)[QUARANTINE_KEEP:]:
            stem = name.removesuffix(".bin" + QUARANTINE_SUFFIX)
            self._fs.unlink(name)
            self._fs.unlink(stem + ".json" + QUARANTINE_SUFFIX)

    def delete(self, record: manifest.Manifest) -> bool:
        """Unpublish (manifest first), then remove the file; False if an I/O error stopped it (reported)."""
        with self._lock:
            self._index.pop(record.file, None)
            self._last_used.pop(record.file, None)
        return self._fs.unlink(Path(record.file).stem + ".json") and self._fs.unlink(record.file)

    def remove(self, name: str) -> None:
        self._fs.unlink(name)

    def exists(self, name: str) -> bool:
        return self._fs.exists(name)
