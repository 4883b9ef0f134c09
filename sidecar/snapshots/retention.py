"""Which conversations the library lets go. Pure code.

Slots are not the unit of keeping: conversations are. A snapshot whose
tokens are a prefix of ``keep`` newer snapshots' is superseded (the newer
ones restore everything it would, and more; ``keep`` above 1 leaves older
turns as a fallback should the newest file go bad). Of the rest, the least recently
used go first while the library is over ``max_bytes``, and any older than
``max_age``. A conversation in use (restored into a slot, being swapped,
being uploaded) is never selected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from sidecar.core import outcomes


@dataclasses.dataclass(frozen=True, slots=True)
class Kept:
    """One snapshot of the library, as retention sees it."""

    file: str
    prefix: tuple[str, ...]
    bytes: int
    generation: int
    """Commit order: higher is newer, whatever the wall clock did."""
    last_used: float
    """Unix time of the last save, restore or request that used it."""


def select(
    kept: Sequence[Kept],
    *,
    in_use: Collection[str],
    keep: int = 1,
    max_bytes: int,
    max_age: float,
    now: float,
) -> list[tuple[Kept, outcomes.GcReason]]:
    """Snapshots to delete, each with its reason; ``in_use`` names files never to select."""
    doomed: dict[str, tuple[Kept, outcomes.GcReason]] = {}
    newest_first = sorted(kept, key=lambda k: k.generation, reverse=True)
    for i, old in enumerate(newest_first):
        if old.file in in_use or not old.prefix:
            continue
        if sum(_extends(newer.prefix, old.prefix) for newer in newest_first[:i]) >= max(1, keep):
            doomed[old.file] = (old, outcomes.GcReason.SUPERSEDED)
    if max_age > 0:
        for k in kept:
            if k.file not in doomed and k.file not in in_use and now - k.last_used > max_age:
                doomed[k.file] = (k, outcomes.GcReason.AGE)
    if max_bytes > 0:
        total = sum(k.bytes for k in kept if k.file not in doomed)
        for k in sorted(kept, key=lambda k: (k.last_used, k.generation)):
            if total <= max_bytes:
                break
            if k.file in doomed or k.file in in_use:
                continue
            doomed[k.file] = (k, outcomes.GcReason.BYTES)
            total -= k.bytes
    return list(doomed.values())


def _extends(longer: tuple[str, ...], shorter: tuple[str, ...]) -> bool:
    """Whether ``longer`` starts with all of ``shorter``'s blocks (chained hashes: the last one decides)."""
    return len(longer) >= len(shorter) and longer[len(shorter) - 1] == shorter[-1]
