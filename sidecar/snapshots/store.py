"""The snapshot directory: commit, verify, quarantine, delete. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/store.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sidecar.core import apikeys, errors, hashing, outcomes, protocols, safeio
from sidecar.snapshots import backing, index, manifest, recency, slotdir, slotfile, spill, storeevents
from sidecar.snapshots import commit as checks

TEMP_PREFIX = slotdir.TEMP_PREFIX
PROBE_PREFIX = ".probe-"
PROBE_BYTES = 4096
"""Bytes :meth:`SnapshotStore.probe_write` writes: one page, enough to find a full or read-only disk."""
QUARANTINE_SUFFIX = ".quarantined"
QUARANTINE_KEEP = 4
"""Quarantined snapshots kept for inspection; older ones are deleted."""
FILE_MODE = 0o640
READ_ATTEMPTS = 3
"""Reads of a manifest before an I/O error is reported (and left for the next scan)."""
RETRY_PAUSE = 0.05
"""Seconds before the second read; doubled before the third."""


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


class _BadContent(Exception):
    def __init__(self, reason: outcomes.SnapshotProblem, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(slots=True)
class _Directory:
    """What every view of one slot dir shares: the filesystem, the index, use times, hooks."""

    path: Path
    fs: slotdir.SlotDir
    staging: slotdir.SlotDir
    """Where llama-server writes and reads: the slot dir (``fs`` itself without a block store)."""
    clock: protocols.Clock
    """Its ``wall`` dates commits (``created``) and uses; the order is the generation's, never the clock's."""
    events: storeevents.StoreEvents
    read_only: bool
    """Report bad files through ``events.quarantined`` but rename nothing (``verify --dry-run``)."""
    recency: recency.Recency
    index: index.Index = dataclasses.field(default_factory=index.Index)
    listeners: list[Callable[[manifest.Manifest], None]] = dataclasses.field(default_factory=list)
    """Called with each manifest committed through any view, right after it became visible."""
    newer_said: set[str] = dataclasses.field(default_factory=set)
    """Manifests of a newer format already reported."""
    blocks: backing.Blocks | None = None
    """The block store holding every snapshot's bytes (``--store-dir``); None: whole files beside the manifests."""
    spill: spill.Spill | None = None
    """With a block store: files staged on its disk when the slot dir lacks room (see :mod:`.spill`)."""


class SnapshotStore:
    """The index of committed snapshots and every write to the slot dir; lists every model's snapshots.

    ``events`` is told of bad files, I/O errors, newer formats and files
    that cannot be indexed (see :class:`storeevents.StoreEvents`).
    """

    def __init__(
        self,
        slot_dir: Path,
        *,
        clock: protocols.Clock,
        events: storeevents.StoreEvents | None = None,
        read_only: bool = False,
        store_dir: Path | None = None,
    ) -> None:
        """``store_dir``: keep the snapshots there, in a block store (see :mod:`~sidecar.snapshots.backing`)."""
        told = events or storeevents.Silent()
        home = slot_dir if store_dir is None else store_dir / backing.SNAPSHOTS
        blocks = None
        if store_dir is not None:
            home.mkdir(parents=True, exist_ok=True)
            blocks = backing.Blocks(store_dir, clock=clock)
        fs = slotdir.SlotDir(home, told.io_error)
        staging = fs if store_dir is None else slotdir.SlotDir(slot_dir, told.io_error)
        self._dir = _Directory(
            path=home,
            fs=fs,
            staging=staging,
            clock=clock,
            events=told,
            read_only=read_only,
            recency=recency.Recency(home, clock=clock, read_only=read_only),
            blocks=blocks,
            spill=None if store_dir is None else spill.Spill(staging, store_dir, told.io_error),
        )
        self.model: str | None = None
        """The router-mode model this view writes (see :meth:`for_model`); None: a plain server's."""

    def for_model(self, model: str | None) -> SnapshotStore:
        """A view of the same directory and index that lists and writes only ``model``'s snapshots.

        In llama-server's router mode every model's server shares one slot dir:
        each model's files carry its :func:`manifest.model_tag` and its manifests
        its name. ``None`` is a plain llama-server's (no tag): its engine never
        sees a model's files. Scans, quarantine and the index stay shared with
        this store, which lists every snapshot (``ls``, ``verify``, ``/status``).
        """
        return ModelStore(self._dir, model)

    @property
    def dir(self) -> Path:
        """Where the manifests live: the slot dir, or ``STORE/snapshots`` with a block store."""
        return self._dir.path

    @property
    def staging(self) -> Path:
        """Where llama-server writes and reads (its ``--slot-save-path``): the slot dir."""
        return self._dir.staging.path

    @property
    def blocks(self) -> backing.Blocks | None:
        return self._dir.blocks

    @property
    def keeps(self) -> Path:
        """Where the snapshots' bytes are kept: the block store's root, or the slot dir."""
        return self._dir.path if self._dir.blocks is None else self._dir.blocks.root

    @property
    def _prefix(self) -> str:
        return "" if self.model is None else manifest.model_tag(self.model) + "--"

    def _lists(self, record: manifest.Manifest) -> bool:
        """Whether this view lists ``record``: every snapshot here; its model's in a :class:`ModelStore`."""
        del record
        return True

    # ---- reading -----------------------------------------------------------------

    def snapshots(self, slot: int | None = None) -> list[manifest.Manifest]:
        """Committed snapshots, newest (highest generation) first, optionally of one slot."""
        found = self._dir.index.select(lambda m: (slot is None or m.slot == slot) and self._lists(m))
        return [] if self._dir.index.blocked else found

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
        """Call ``listener`` with each manifest committed in this slot dir, right after it became visible."""
        self._dir.listeners.append(listener)

    def last_used(self, file: str) -> float:
        """Unix time ``file`` was last used: committed, or touched (kept across restarts as its manifest's mtime)."""
        return self._dir.recency.last_used(file, self._dir.index.get(file))

    def touch(self, file: str) -> None:
        """Note that a snapshot was used now (restored into a slot for a request)."""
        self._dir.recency.touch(file)

    @contextlib.contextmanager
    def using(self, file: str) -> Iterator[None]:
        """Keep retention off ``file`` while the block runs."""
        with self._dir.recency.using(file):
            yield

    def in_use(self) -> frozenset[str]:
        return self._dir.recency.in_use()

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
            staged_bytes=self.staged_bytes(),
        )

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

    def check_writable(self) -> str | None:
        """None if the slot dir is a writable directory, else what is wrong (for /readyz)."""
        return self._dir.index.blocked or self._dir.fs.check()

    def block(self, reason: str) -> None:
        """Stay off the directory: list no snapshots, commit nothing, until called with an empty reason."""
        self._dir.index.blocked = reason

    def dir_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the slot dir, None while it is missing: tells a dir put back from a new one."""
        return self._dir.fs.identity()

    # ---- start-up and rescans ------------------------------------------------------

    def scan(self, *, clean: bool) -> list[str]:
        """Rebuild the index from the manifests on disk; returns log-worthy findings.

        With ``clean``, also delete leftovers of interrupted saves: temp files,
        probe files and ``.bin`` files without a manifest. Only do that at
        start-up, when no save of ours can be in flight. A directory that
        cannot be listed leaves the index as it was; a missing one empties it.
        """
        findings: list[str] = []
        fs = self._dir.fs
        try:
            names = set(fs.names())  # not only regular files: a hostile one is refused by name
        except FileNotFoundError as exc:
            fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            names = set()
        except OSError as exc:
            fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            return findings
        before = self._dir.index.copy()
        found: dict[str, manifest.Manifest] = {}
        for name in sorted(names):
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                if clean and fs.unlink(name):
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
                found[loaded.file] = loaded
        if clean:
            for name in sorted(names):
                stem_json = Path(name).stem + ".json"
                orphan = manifest.NAME_RE.match(name) and name not in found and stem_json not in names
                if orphan and fs.unlink(name):
                    findings.append(f"removed {name}: its save was interrupted before the manifest was written")
        if clean and self._dir.blocks is not None:
            findings += self._clean_blocks({Path(f).stem for f in found})
        self._dir.index.replace(found)
        return findings

    def _clean_blocks(self, stems: set[str]) -> list[str]:
        """Leftovers of a block store: recipes of ingests that died before their manifest, staged files."""
        assert self._dir.blocks is not None
        findings = []
        try:
            for name in self._dir.blocks.orphans(stems):
                if self._dir.blocks.drop(name):
                    findings.append(f"dropped recipe {name}: its commit was interrupted before the manifest")
            staged = self._dir.staging.names()
        except OSError as exc:
            self._dir.fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            return findings
        for name in staged:
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)) and self._dir.staging.unlink(name):
                findings.append(f"removed {name} from the slot dir: left over from an interrupted save or restore")
        if self._dir.spill is not None:
            findings += self._dir.spill.clean()
        self._dir.blocks.collect()
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
            present = os.path.lexists(self.dir / json_name) and (
                self._dir.blocks is not None or os.path.lexists(self.dir / bin_name)
            )
            loaded = self._load(json_name) if present else None
        except OSError:
            return  # reported by _load or below; the index keeps what it knew
        if loaded is None:
            self._dir.index.pop(bin_name)
        else:
            self._dir.index.put(loaded)

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
                if json_name not in self._dir.newer_said:
                    self._dir.newer_said.add(json_name)
                    self._dir.events.newer_format(json_name, exc.found)
                return None
            except _BadContent as bad:
                self.quarantine(bin_name, bad.reason, detail=bad.detail)
                return None
            except OSError as exc:
                if attempt + 1 == READ_ATTEMPTS:
                    self._dir.events.io_error(outcomes.SlotDirOperation.READ, json_name, slotdir.describe(exc))
                    raise
                time.sleep(RETRY_PAUSE * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, json_name: str, bin_name: str) -> manifest.Manifest:
        try:
            raw = safeio.read_bounded(self.dir / json_name, manifest.MAX_BYTES)
        except safeio.Refused as exc:
            raise _BadContent(outcomes.SnapshotProblem(exc.reason), f"manifest refused unread: {exc}") from exc
        try:
            loaded = manifest.Manifest.from_json(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, str(exc)) from exc
        if bin_name != loaded.file:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, "manifest names another file")
        if self._dir.blocks is not None:
            return self._read_recipe(loaded)
        try:
            size = safeio.lstat_regular(self.dir / loaded.file).st_size
        except safeio.Refused as exc:
            raise _BadContent(outcomes.SnapshotProblem.NOT_REGULAR, f"snapshot refused: {exc}") from exc
        except FileNotFoundError:
            if not os.path.lexists(self.dir / json_name):
                raise  # both gone: deleted meanwhile, not damage
            raise _BadContent(outcomes.SnapshotProblem.SIZE, "snapshot file is missing") from None
        if size != loaded.bytes:
            raise _BadContent(outcomes.SnapshotProblem.SIZE, f"{size} bytes on disk, manifest says {loaded.bytes}")
        return loaded

    def _read_recipe(self, loaded: manifest.Manifest) -> manifest.Manifest:
        """``loaded`` if its recipe is in the block store with its size; bad content if not, OSError if unreadable."""
        assert self._dir.blocks is not None
        if loaded.recipe is None:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, "a manifest of the block store names no recipe")
        try:
            size = self._dir.blocks.recipe(loaded.recipe).size
        except errors.BlockStoreError as exc:
            reason = backing.snapshot_problem(exc)
            if reason not in outcomes.BAD_CONTENT:
                raise OSError(str(exc)) from exc
            raise _BadContent(reason, str(exc)) from exc
        if size != loaded.bytes:
            raise _BadContent(
                outcomes.SnapshotProblem.SIZE, f"its recipe holds {size} bytes, manifest says {loaded.bytes}"
            )
        return loaded

    # ---- writing -------------------------------------------------------------------

    def temp_name(self, slot: int) -> str:
        return f"{TEMP_PREFIX}{self._prefix}slot{slot}-{secrets.token_hex(6)}.bin"

    def probe_name(self) -> str:
        return f"{PROBE_PREFIX}{secrets.token_hex(6)}.bin"

    def probe_write(self) -> str | None:
        """None if a small file can be written and synced where manifests are kept, else why not.

        Asked while that disk refuses saves (see :mod:`sidecar.act.storefault`); the file is removed at once,
        and a probe file left by a crash goes at the next start-up's scan.
        """
        path = self.dir / self.probe_name()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            backing.remove_quietly(path)
            return slotdir.describe(exc)
        backing.remove_quietly(path)
        return None

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
        owner: str = apikeys.NOBODY,
    ) -> manifest.Manifest:
        """Check, hash and publish a file the server just wrote; see the module docstring.

        ``pause``: the hash's pause after each chunk (``hashing.PACE`` while other slots generate).
        ``created``: Unix time of the server's save (None: now); a commit made later than the save
        (see :mod:`sidecar.act.snapshotter`) still dates the snapshot by its content.
        ``prefill_rate``: the writing server's measured prompt tokens per second (see ``Manifest``).
        ``owner``: whose conversation the slot held (see ``Manifest``).
        """

        def make(
            final: str, checksum: manifest.Checksum, content: manifest.Index | None, now: float, size: int = 0
        ) -> manifest.Manifest:
            return manifest.Manifest(
                slot=slot,
                file=final,
                tokens=tokens,
                bytes=size,
                checksum=checksum,
                generation=self._dir.index.next_generation(),
                created=now,
                task=task,
                fingerprint=fingerprint,
                index=content,
                model=self.model,
                prefill_rate=prefill_rate,
                owner=owner,
            )

        if self._dir.blocks is not None:
            with self._released(temp):
                committed = checks.commit_to_blocks(
                    self._staged_in(temp),
                    self._dir.fs,
                    self._dir.blocks,
                    temp,
                    slot=slot,
                    tokens=tokens,
                    written=written,
                    blocked=self._dir.index.blocked,
                    events=self._dir.events,
                    make=make,
                    prefix=self._prefix,
                    now=self._dir.clock.wall() if created is None else created,
                )
            return self._publish(committed)
        fs, path = self._dir.fs, self.dir / temp
        with checks.removed_if_failed(fs, temp, f"committing {temp}"):
            checked = checks.check_written(fs, temp, tokens=tokens, written=written, blocked=self._dir.index.blocked)
            size = checked.st_size
            # The mode is set through the descriptor that hashed the file: a link planted at the temp name
            # after the server wrote it makes the commit fail, and changes no other file.
            digest = hashing.digest_and_sync(path, pause=pause, limit=size, mode=FILE_MODE, same_as=checked)
            content = checks.read_index(path, self._dir.events)
            now = self._dir.clock.wall() if created is None else created
            final = checks.free_name(self.dir, self._prefix, slot, now)
            record = make(final, manifest.Checksum(hashing.CURRENT, digest), content, now, size)
            checks.still_same(fs, temp, checked)
            os.replace(path, self.dir / final)
        with checks.removed_if_failed(fs, final, f"writing the manifest of {final}"):
            fs.write_atomically(Path(final).stem + ".json", record.to_json(), mode=FILE_MODE)
        return self._publish(record)

    def _publish(self, record: manifest.Manifest) -> manifest.Manifest:
        self._dir.index.put(record)
        for listener in self._dir.listeners:
            listener(record)
        return record

    def check_written(self, temp: str, *, tokens: int, written: int) -> None:
        """The cheap checks of :meth:`commit` (the file is here, holds tokens, has the size the server
        reported), made right after the save when its commit waits; raises ``errors.SnapshotError``
        and removes the file when one fails."""
        staged = self._staged_in(temp)
        with self._released_if_failed(temp), checks.removed_if_failed(staged, temp, f"checking {temp}"):
            checks.check_written(staged, temp, tokens=tokens, written=written, blocked=self._dir.index.blocked)

    def check(self, record: manifest.Manifest) -> None:
        """Raise SnapshotError unless the file still has its manifest's size and checksum.

        The reason is ``checksum`` or ``size`` when the content is proven bad,
        ``io`` when it could not be read (nothing is known then). In a block store: the recipe and its
        blocks' sizes (the bytes are checked as the file is rebuilt, see :meth:`stage`).
        """
        if self._dir.blocks is not None:
            self._dir.blocks.check(record)
            return
        path = self.dir / record.file
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
            if self.exists(Path(record.file).stem + ".json"):
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

    def remove(self, name: str) -> None:
        """Remove a file of the server's (a temp, probe or staged name) from the slot dir, or its disk stand-in."""
        self._dir.staging.unlink(name)
        if self._dir.spill is not None:
            self._dir.spill.release(name)

    def exists(self, name: str) -> bool:
        """Whether the slot dir holds ``name`` (a temp, probe or staged name)."""
        return self._dir.staging.exists(name)

    # ---- the block store (``--store-dir``) -------------------------------------------

    def place_save(self, temp: str, estimated_bytes: int) -> outcomes.StagingFallback | None:
        """Where llama-server writes (or reads) the staged ``temp``: None, the slot dir; else why on the store's disk.

        With a block store, a slot dir whose free space is below ``estimated_bytes`` (and some headroom) gets
        a link named ``temp`` to a file under ``STORE/staging`` (see :mod:`.spill`); if that cannot be made,
        the save stays in the slot dir (reported as an I/O error).
        """
        if self._dir.spill is None:
            return None
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

    def _staged_in(self, name: str) -> slotdir.SlotDir:
        """The directory that holds the staged file ``name``: the slot dir, or the store's staging folder."""
        if self._dir.spill is not None and self._dir.spill.holds(name):
            return self._dir.spill.dir
        return self._dir.staging

    @contextlib.contextmanager
    def _released_if_failed(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if self._dir.spill is not None:
                self._dir.spill.release(name)
            raise

    @contextlib.contextmanager
    def _released(self, name: str) -> Iterator[None]:
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
        return slotfile.read_tokens(self.dir / record.file)

    def stage(self, record: manifest.Manifest) -> str:
        """The name in the slot dir the server restores ``record`` from: its file, or a fresh staged rebuild
        of it (checked against its checksum; give it back with :meth:`unstage`). Raises SnapshotError."""
        if self._dir.blocks is None:
            return record.file
        name = f"{TEMP_PREFIX}restore-{self._prefix}{secrets.token_hex(6)}.bin"
        with self._released_if_failed(name):
            on_disk = self.place_save(name, record.bytes)
            dest = self.staging / name if on_disk is None else self._staged_in(name).path / name
            self._dir.blocks.stage(record, dest)
        return name

    def unstage(self, name: str, record: manifest.Manifest) -> None:
        """Delete what :meth:`stage` staged (nothing for a whole file)."""
        if self._dir.blocks is not None and name != record.file:
            self.remove(name)
            self._dir.blocks.unstaged(record.bytes)

    def whole_file(self, record: manifest.Manifest) -> Path:
        """A path holding ``record``'s whole file to read (an upload): its own file, or a checked rebuild on
        the store's disk (not the slot dir: RAM holds one staged file at most); give it back with
        :meth:`release_whole`. Raises SnapshotError."""
        if self._dir.blocks is None:
            return self.dir / record.file
        path = self.dir / f"{TEMP_PREFIX}upload-{secrets.token_hex(6)}.bin"
        self._dir.blocks.stage(record, path)
        self._dir.blocks.unstaged(record.bytes)  # on disk, not staged in the slot dir
        return path

    def release_whole(self, path: Path, record: manifest.Manifest) -> None:
        if path != self.dir / record.file:
            backing.remove_quietly(path)

    def collect_blocks(self) -> None:
        """Delete the blocks no snapshot names any more (skipped while the block store is in use)."""
        if self._dir.blocks is not None:
            self._dir.blocks.collect()


class ModelStore(SnapshotStore):
    """One model's view of a shared slot dir: lists and writes only ``model``'s snapshots.

    Made by :meth:`SnapshotStore.for_model`; everything but the model (the
    index, scans, quarantine, use times, listeners, hooks) is the directory's,
    shared with every other view.
    """

    def __init__(self, directory: _Directory, model: str | None) -> None:  # the directory is shared, not opened again
        self._dir = directory
        self.model = model

    def _lists(self, record: manifest.Manifest) -> bool:
        return record.model == self.model
