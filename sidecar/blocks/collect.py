"""Garbage collection: delete the blocks no committed recipe names, and the temp files of dead writes. Blocking I/O.

It runs under the store's lock held exclusive (see
:mod:`~sidecar.blocks.locking`), so no ingest is between writing its blocks
and committing its recipe, and no reassembly is reading: every ``.tmp-``
file then belongs to a write that died (``kill -9``, a full disk) and no
recipe names it, and a block no committed recipe names is garbage. A
collection killed half-way has deleted some garbage and nothing else.

If a recipe cannot be read (damaged, refused, an I/O error), the blocks it
names are unknown, so nothing but temp files is deleted: a damaged recipe
costs disk, never another recipe's blocks. :func:`garbage` decides; it is pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterable
from pathlib import Path

from sidecar.blocks import blockdir, recipedir
from sidecar.core import errors


class Outcome(enum.StrEnum):
    DONE = "done"
    BUSY = "busy"
    """Not waited for: ingests or reassemblies held the store (``wait=False``); nothing was deleted."""
    DAMAGED = "damaged"
    """A recipe could not be read: only temp files were deleted."""


@dataclasses.dataclass(frozen=True, slots=True)
class Collected:
    outcome: Outcome
    blocks_deleted: int = 0
    bytes_freed: int = 0
    """Bytes of the blocks and temp files deleted."""
    temps_removed: int = 0
    blocks_kept: int = 0
    bytes_kept: int = 0
    unreadable: tuple[str, ...] = ()
    """Recipes that could not be read (outcome ``damaged``)."""


def garbage(referenced: set[str], present: Iterable[tuple[str, Path, int]]) -> tuple[list[tuple[Path, int]], int, int]:
    """(the blocks to delete with their sizes, blocks kept, bytes kept): every present block no recipe names."""
    doomed: list[tuple[Path, int]] = []
    kept = kept_bytes = 0
    for digest, path, size in present:
        if digest and digest not in referenced:
            doomed.append((path, size))
        elif digest:
            kept, kept_bytes = kept + 1, kept_bytes + size
    return doomed, kept, kept_bytes


def collect(blocks: blockdir.BlockDir, recipes: recipedir.RecipeDir) -> Collected:
    """Collect; the caller holds the store's lock exclusive."""
    referenced: set[str] = set()
    unreadable: list[str] = []
    for name in recipes.names():
        try:
            referenced |= recipes.read(name).digests()
        except errors.BlockStoreError:
            unreadable.append(name)
    entries = list(blocks.entries())
    temps = [(path, size) for digest, path, size in entries if not digest]
    temps += [(path, _size(path)) for path in recipes.temps()]
    freed = removed = 0
    for path, size in temps:
        if _unlink(path):
            freed, removed = freed + size, removed + 1
    if unreadable:
        kept = sum(1 for d, _, _ in entries if d)
        kept_bytes = sum(s for d, _, s in entries if d)
        return Collected(Outcome.DAMAGED, 0, freed, removed, kept, kept_bytes, tuple(unreadable))
    doomed, kept, kept_bytes = garbage(referenced, entries)
    deleted = 0
    for path, size in doomed:
        if _unlink(path):
            freed, deleted = freed + size, deleted + 1
    return Collected(Outcome.DONE, deleted, freed, removed, kept, kept_bytes)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return os.lstat(path).st_size
    return 0
