"""The fence between block uploads and shared-store collections. Pure decision, one listing.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/fence.py`.
"""

from __future__ import annotations

from collections.abc import Iterable

DEADLINE = 300.0
"""Seconds after its start past which a collection deletes nothing more (the rest waits for its next run)."""
STALE = 2 * DEADLINE
"""A marker older than this is a collection that died: uploads stop waiting for it."""
POLL = 2.0
"""Seconds between two listings while an upload waits for a collection."""
RECIPE_FRESH = 600.0
"""An upload whose recipe is older than this at the fence writes it again under a new attempt."""
MIN_GRACE = 2 * RECIPE_FRESH
"""A collection leaves recipes and blocks younger than this alone whatever its ``--grace``: an upload in
progress relies on them until it publishes."""


def running(starts: Iterable[float], *, now: float) -> list[float]:
    """The start times of markers of collections that may still delete (younger than :data:`STALE`)."""
    return [s for s in starts if now - s < STALE]
