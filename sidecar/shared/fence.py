"""The fence between block uploads and shared-store collections. Pure decision, one listing.

A shared-store collection (``gc``) deletes blocks no recipe names. An
upload that finds a block already in the store does not send it again, and
relies on it: if a collection that listed the store before the upload's
recipe existed deleted that block afterwards, the upload would publish a
manifest naming a missing block. No lock spans nodes, so the two meet
through a marker:

* a collection writes ``gc-running/<start>-<random>`` before it lists the
  store, deletes only while less than :data:`DEADLINE` seconds have passed
  since its start, and removes the marker when done;
* an upload, once its recipe and every block are in the store, lists the
  markers: if a collection may still be deleting (a marker younger than
  :data:`STALE`, twice the deadline, so a clock a little off or a collection
  that died without removing its marker is covered), it waits until none
  is, then checks its recipe and blocks again (sending what went), and only
  then writes its manifest.

A collection that starts after that listing sees the upload's recipe and
keeps every block it names; one that started before is waited for. So a
published manifest never names a block a collection in progress deletes.
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
