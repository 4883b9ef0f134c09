"""Retention after a commit: the snapshots no longer kept, chosen by the pure policy and deleted.

A snapshot whose every token a newer one of its slot holds is *covered* (read from the newer file's head,
remembered: committed snapshots never change), so retention may drop it first.
"""

from __future__ import annotations

import asyncio

from sidecar.core import config, protocols
from sidecar.save import diskroom, policy
from sidecar.snapshots import manifest, slotfile, store

COVERED_KEEP = 4096
"""Answers of ``_covers`` remembered (snapshots never change once committed)."""


class Collector:
    """Deletes what retention (``--keep-per-slot``, ``--max-bytes``, ``--max-age``) no longer keeps."""

    def __init__(
        self,
        *,
        snapshots: store.SnapshotStore,
        settings: config.SnapshotSettings,
        clock: protocols.Clock,
        room: diskroom.DiskRoom,
    ) -> None:
        self._snapshots = snapshots
        self._settings = settings
        self._clock = clock
        self._room = room
        self._covered: dict[tuple[str, str], bool] = {}

    async def collect(self) -> None:
        """Delete the snapshots retention no longer keeps (through the disk room, which says so)."""
        doomed = await asyncio.to_thread(
            policy.select_for_deletion,
            self._snapshots.snapshots(),
            keep_per_slot=self._settings.keep_per_slot,
            max_bytes=self._settings.max_bytes,
            max_age=self._settings.max_age,
            now=self._clock.wall(),
            in_use=self._snapshots.recency.in_use(),
            last_used=self._snapshots.last_used,
            covers=self._covers,
            blocks=None if self._snapshots.blocks is None else self._snapshots.blocks.digests,
        )
        await self._room.delete(doomed)

    def _covers(self, newer: manifest.Manifest, older: manifest.Manifest) -> bool:
        """Whether ``newer``'s file holds every token of ``older``, to the token (read from its head; cached)."""
        if older.index is None or older.index.whole is None or newer.tokens < older.tokens:
            return False
        key = (newer.file, older.file)
        known = self._covered.get(key)
        if known is None:
            try:
                held = self._snapshots.staged.read_tokens(newer)
            except (OSError, slotfile.SlotFileError):
                return False  # unreadable now: not proven, so the older one stays
            known = slotfile.whole_hash(held.data[: older.tokens * 4]) == older.index.whole
            if len(self._covered) > COVERED_KEEP:
                self._covered.clear()
            self._covered[key] = known
        return known
