"""What every view of one slot dir shares: the filesystem, the index, use times, hooks; and the names of its files."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from sidecar.core import protocols
from sidecar.snapshots import backing, index, manifest, recency, slotdir, spill, storeevents

TEMP_PREFIX = slotdir.TEMP_PREFIX
PROBE_PREFIX = ".probe-"
QUARANTINE_SUFFIX = ".quarantined"
FILE_MODE = 0o640


@dataclasses.dataclass(slots=True)
class Directory:
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
