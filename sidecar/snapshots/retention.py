"""Which conversations the library lets go. Pure code.

Slots are not the unit of keeping: conversations are. A snapshot whose
tokens are a prefix of ``keep`` newer snapshots' is superseded (the newer
ones restore everything it would, and more; ``keep`` above 1 leaves older
turns as a fallback should the newest file go bad). On a model whose state
cannot be cut back (``exact``), a longer snapshot serves only requests that
contain all of it, so a shorter one is the only one an edit of the last
message or a regenerate can use: it is superseded only by ``keep + 1``
newer snapshots that hold every one of its tokens (``covers`` says, to the
token), so the previous turn always survives the next one. Of the rest, the least recently
used go first while the library is over ``max_bytes``, and any older than
``max_age``. A conversation in use (restored into a slot, being swapped,
being uploaded) is never selected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

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
    exact: bool = False
    """Saved from a model whose state cannot be cut back (recurrent or hybrid)."""
    blocks: tuple[tuple[str, int], ...] = ()
    """(digest, size) of its blocks in a block store (``--store-dir``), where snapshots share the blocks of a
    common prefix: the cap then counts each block once. Empty: a whole file of ``bytes``."""


def held_bytes(kept: Iterable[Kept]) -> int:
    """Bytes ``kept`` take on disk: whole files in full, the blocks of a block store once each."""
    whole, shared = 0, dict[str, int]()
    for k in kept:
        if k.blocks:
            shared.update(k.blocks)
        else:
            whole += k.bytes
    return whole + sum(shared.values())


def select(
    kept: Sequence[Kept],
    *,
    in_use: Collection[str],
    keep: int = 1,
    max_bytes: int,
    max_age: float,
    now: float,
    covers: Callable[[Kept, Kept], bool] | None = None,
) -> list[tuple[Kept, outcomes.GcReason]]:
    """Snapshots to delete, each with its reason; ``in_use`` names files never to select.

    ``covers(newer, older)``: whether ``newer`` holds every token of ``older``, the partial last
    block included (for ``exact`` snapshots; without it they are never superseded).
    """
    doomed = {k.file: (k, outcomes.GcReason.SUPERSEDED) for k in _superseded(kept, in_use, keep, covers)}
    if max_age > 0:
        for k in kept:
            if k.file not in doomed and k.file not in in_use and now - k.last_used > max_age:
                doomed[k.file] = (k, outcomes.GcReason.AGE)
    if max_bytes > 0:
        total = held_bytes(k for k in kept if k.file not in doomed)
        for k in sorted(kept, key=lambda k: (k.last_used, k.generation)):
            if total <= max_bytes:
                break
            if k.file in doomed or k.file in in_use:
                continue
            doomed[k.file] = (k, outcomes.GcReason.BYTES)
            total = held_bytes(k for k in kept if k.file not in doomed) if k.blocks else total - k.bytes
    return list(doomed.values())


def _superseded(
    kept: Sequence[Kept], in_use: Collection[str], keep: int, covers: Callable[[Kept, Kept], bool] | None
) -> Iterator[Kept]:
    """The snapshots whose tokens ``keep`` newer ones hold (``keep + 1`` for ``exact`` ones), newest first."""
    newest_first = sorted(kept, key=lambda k: k.generation, reverse=True)
    for i, old in enumerate(newest_first):
        if old.file in in_use or not old.prefix:
            continue
        if old.exact:
            if covers is None:
                continue
            extenders = sum(_extends(newer.prefix, old.prefix) and covers(newer, old) for newer in newest_first[:i])
            if extenders >= max(1, keep) + 1:
                yield old
        elif sum(_extends(newer.prefix, old.prefix) for newer in newest_first[:i]) >= max(1, keep):
            yield old


def _extends(longer: tuple[str, ...], shorter: tuple[str, ...]) -> bool:
    """Whether ``longer`` starts with all of ``shorter``'s blocks (chained hashes: the last one decides)."""
    return len(longer) >= len(shorter) and longer[len(shorter) - 1] == shorter[-1]


def make_room(kept: Sequence[Kept], *, in_use: Collection[str], need: int, free: int, floor: int) -> list[Kept]:
    """The snapshots to delete so that a write of ``need`` bytes leaves ``floor`` free of ``free``; [] if none.

    Least recently used first (the order of ``max_bytes``), just enough: the freed bytes count each block
    of a block store once, freed only when no kept snapshot names it. If deleting every snapshot not in
    ``in_use`` would not free enough, nothing is selected (nothing is deleted for a write that still
    would not fit).
    """
    short = need + floor - free
    if short <= 0:
        return []
    names: dict[str, int] = {}  # digest: kept snapshots naming it
    for k in kept:
        for digest in dict(k.blocks):
            names[digest] = names.get(digest, 0) + 1
    victims: list[Kept] = []
    freed = 0
    for k in sorted(kept, key=lambda k: (k.last_used, k.generation)):
        if k.file in in_use:
            continue
        victims.append(k)
        if not k.blocks:
            freed += k.bytes
        for digest, size in dict(k.blocks).items():
            names[digest] -= 1
            if not names[digest]:
                freed += size
        if freed >= short:
            return victims
    return []
