"""The snapshot directory: one view of the slot dir (or the block store) over its parts. Blocking I/O.

:class:`SnapshotStore` lists the committed snapshots and hands out its parts, which callers use directly:
:class:`Writer` (commits), :class:`Loader` (scans), :class:`Curator` (checks, quarantine, deletion),
:class:`Staging` (the server's files), :class:`recency.Recency` (last use, in-use holds).
Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/store.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from sidecar.core import protocols
from sidecar.snapshots import backing, manifest, recency, slotdir, slotfile, spill, storeevents
from sidecar.snapshots.curator import QUARANTINE_KEEP, Curator
from sidecar.snapshots.directory import FILE_MODE, PROBE_PREFIX, QUARANTINE_SUFFIX, TEMP_PREFIX, Directory
from sidecar.snapshots.loader import READ_ATTEMPTS, RETRY_PAUSE, Loader
from sidecar.snapshots.staging import Staging
from sidecar.snapshots.writer import PROBE_BYTES, Writer

__all__ = [
    "FILE_MODE",
    "PROBE_BYTES",
    "PROBE_PREFIX",
    "QUARANTINE_KEEP",
    "QUARANTINE_SUFFIX",
    "READ_ATTEMPTS",
    "RETRY_PAUSE",
    "TEMP_PREFIX",
    "ModelStore",
    "SnapshotStore",
    "Usage",
]


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
        self._dir = Directory(
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
        self._wire()

    def _wire(self) -> None:
        """The parts of this view, each given what it works with."""
        self.staged = Staging(self._dir, self._prefix)
        """The files llama-server writes and reads in the slot dir."""
        self.curator = Curator(self._dir, self.staged)
        """Checks, quarantine, deletion."""
        self.loader = Loader(self._dir, self.curator)
        """Scans and re-reads of the manifests on disk."""
        self.writer = Writer(self._dir, self.staged, self.model)
        """Commits."""
        self.recency = self._dir.recency
        """When each snapshot was last used, and those in use now (kept off retention)."""

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
            staged_bytes=self.staged.staged_bytes(),
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


class ModelStore(SnapshotStore):
    """One model's view of a shared slot dir: lists and writes only ``model``'s snapshots.

    Made by :meth:`SnapshotStore.for_model`; everything but the model (the
    index, scans, quarantine, use times, listeners, hooks) is the directory's,
    shared with every other view.
    """

    def __init__(self, directory: Directory, model: str | None) -> None:  # the directory is shared, not opened again
        self._dir = directory
        self.model = model
        self._wire()

    def _lists(self, record: manifest.Manifest) -> bool:
        return record.model == self.model
