"""Which slot a completion request should run in, and what to put there first. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/routing.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sidecar.core import outcomes
from sidecar.snapshots import slotfile


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """What one slot holds now."""

    slot: int
    prefix: tuple[str, ...]
    """Hash chain of the slot's tokens; empty for an empty slot."""
    busy: bool
    last_used: float
    """Monotonic time the slot last ran or received a request."""
    dirty: bool
    """The slot's content changed since its last snapshot."""
    continued: bool = False
    """The request is the conversation the slot ran last (by its turn key), continued or with a late message
    edited: what it cuts off of the slot is a branch no one comes back to, not saved first."""


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One conversation in the library."""

    file: str
    prefix: tuple[str, ...]
    exact_tokens: int = 0
    """Tokens of the snapshot, where every one of them is known to begin the request (0: not known). Of two
    entries that share as many of the request's blocks over chains of one length, the one with more such tokens
    wins: its tail past the last whole block is the request's too (a turn saved after the other)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    source: outcomes.Source
    slot: int | None
    """The slot to pin the request to; None: none now (every slot it could go to is busy). The request is held
    and placed again once a slot frees, never sent unpinned: llama-server would give it the first slot to
    free, over content no snapshot may hold yet."""
    entry: Entry | None = None
    """With ``Source.LIBRARY`` or ``Source.SHARED``: the snapshot to restore into ``slot`` first; with
    ``Source.RAM``: what the server's RAM cache holds (``file`` empty)."""
    save_first: bool = False
    """Save ``slot``'s own content before it is replaced (every source but ``Source.SLOT``): it changed since its
    last snapshot."""
    blocks: int = 0
    """Leading blocks of the request the chosen source already holds."""


def route(
    request: tuple[str, ...],
    slots: Sequence[Held],
    library: Sequence[Entry],
    *,
    min_gain_blocks: int = 1,
    shared: Entry | None = None,
    ram: Entry | None = None,
) -> Decision:
    """Where to run a request whose prefix hash chain is ``request``.

    A library entry wins over the best slot only when it holds at least
    ``min_gain_blocks`` more leading blocks: a swap costs a save and a
    restore, so a marginal gain is not worth it. ``ram`` (what the server's
    RAM cache holds) wins over the library where it holds as much: the
    server copies it in memory. A ``shared`` entry (one the shared store
    holds) must beat them all by that margin: it costs a download too.
    """
    best_slot, slot_blocks = _best_slot(request, slots)
    best_entry, entry_blocks = _best_entry(request, library)
    gain = max(1, min_gain_blocks)
    shared_blocks = slotfile.shared_blocks(request, shared.prefix) if shared is not None else 0
    ram_blocks = slotfile.shared_blocks(request, ram.prefix) if ram is not None else 0
    if shared is not None and shared_blocks >= max(slot_blocks, entry_blocks, ram_blocks) + gain:
        victim = _victim(slots)
        if victim is not None:
            return Decision(outcomes.Source.SHARED, victim.slot, shared, victim.dirty, shared_blocks)
    if ram is not None and ram_blocks >= entry_blocks and ram_blocks >= slot_blocks + gain:
        victim = _victim(slots)
        if victim is not None:
            return Decision(outcomes.Source.RAM, victim.slot, ram, victim.dirty, ram_blocks)
    if best_entry is not None and entry_blocks >= slot_blocks + gain:
        victim = _victim(slots)
        if victim is not None:
            return Decision(outcomes.Source.LIBRARY, victim.slot, best_entry, victim.dirty, entry_blocks)
    if best_slot is not None and slot_blocks > 0:
        if best_slot.busy:  # held until it frees: pinned there now, it would run over what the request there leaves
            return Decision(outcomes.Source.SLOT, None, blocks=slot_blocks)
        # Another conversation that shares only a prefix (an agent's system prompt) cuts the slot back to it:
        # what the slot held past it, if unsaved, is saved first (llama-server keeps no copy in RAM when it
        # keeps more than half of the slot). The slot's own conversation, continued or edited, is not saved.
        cuts = slot_blocks < len(best_slot.prefix) and not best_slot.continued
        return Decision(outcomes.Source.SLOT, best_slot.slot, save_first=cuts and best_slot.dirty, blocks=slot_blocks)
    victim = _victim(slots)
    if victim is None:
        return Decision(outcomes.Source.COLD, None)
    return Decision(outcomes.Source.COLD, victim.slot, save_first=victim.dirty)


def _best_slot(request: tuple[str, ...], slots: Sequence[Held]) -> tuple[Held | None, int]:
    best: Held | None = None
    blocks = 0
    for held in slots:
        shared = slotfile.shared_blocks(request, held.prefix)
        if shared > blocks or (shared == blocks and shared > 0 and best is not None and best.busy and not held.busy):
            best, blocks = held, shared
    return best, blocks


def _best_entry(request: tuple[str, ...], library: Sequence[Entry]) -> tuple[Entry | None, int]:
    best: Entry | None = None
    blocks = 0
    for entry in library:
        shared = slotfile.shared_blocks(request, entry.prefix)
        if shared > blocks or (shared == blocks and shared > 0 and best is not None and _closer(entry, best)):
            best, blocks = entry, shared
    return best, blocks


def _closer(entry: Entry, best: Entry) -> bool:
    """Of two entries that share as many of the request's blocks: the shorter chain cuts less off (a longer one
    went on elsewhere); of two as long, the one known to hold more of the request's tokens."""
    if len(entry.prefix) != len(best.prefix):
        return len(entry.prefix) < len(best.prefix)
    return entry.exact_tokens > best.exact_tokens


def _victim(slots: Sequence[Held]) -> Held | None:
    """The idle slot to give a new or swapped-in conversation: empty first, then least recently used."""
    idle = [h for h in slots if not h.busy]
    if not idle:
        return None
    return min(idle, key=lambda h: (bool(h.prefix), h.last_used, h.slot))
