"""The snapshot directory: one view of the slot dir (or the block store) over its parts. Blocking I/O.

:class:`SnapshotStore` lists the committed snapshots and hands out its parts, which callers use directly:
:class:`Writer` (commits), :class:`Loader` (scans), :class:`Curator` (checks, quarantine, deletion),
:class:`Staging` (the server's files), :class:`recency.Recency` (last use, in-use holds), :class:`Disk`
(usage, free space, the writable check).
Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/store.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sidecar.core import protocols
from sidecar.snapshots import backing, manifest, recency, slotdir, slotfile, spill, storeevents
from sidecar.snapshots.curator import QUARANTINE_KEEP, Curator
from sidecar.snapshots.directory import FILE_MODE, PROBE_PREFIX, QUARANTINE_SUFFIX, TEMP_PREFIX, Directory
from sidecar.snapshots.disk import Disk, Usage
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
        self.disk = Disk(self._dir, self.staged)
        """What the directory's disk holds and has free, whether it takes writes; being kept off it."""
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
