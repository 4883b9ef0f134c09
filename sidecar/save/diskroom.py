"""Room on the disk a save writes to: its estimate, and the least recently used snapshots deleted to make room.

The decisions are pure (:mod:`~sidecar.snapshots.floor` for the estimate, :func:`policy.select_for_space` for
the victims); this part measures, deletes and says so. It runs under the slot actions' lock, right before a
save, like retention after a commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import structlog

from sidecar.core import config, metrics, outcomes
from sidecar.save import policy
from sidecar.snapshots import floor, manifest, store

log = structlog.get_logger("sidecar.snapshot")


class DiskRoom:
    def __init__(
        self, *, snapshots: store.SnapshotStore, stats: metrics.Metrics, settings: config.SnapshotSettings
    ) -> None:
        self._snapshots = snapshots
        self._stats = stats
        self._settings = settings

    def estimate_bytes(self, tokens: int) -> int:
        """A whole slot file of ``tokens``: at the newest snapshot's bytes per token, and with a block store
        beyond the part that does not grow with the tokens (:func:`.floor.whole_file`); 0 before any snapshot."""
        known = self._snapshots.snapshots()
        if not known:
            return 0
        newest = known[0]
        if self._snapshots.blocks is None:
            return int(newest.bytes / max(newest.tokens, 1) * tokens)
        return floor.whole_file(self._sizes(newest.fingerprint), tokens)

    def staging_bytes(self, tokens: int) -> int:
        """The file a save of ``tokens`` stages: :meth:`estimate_bytes`, or before any snapshot the launcher's
        estimate from the model's header (``staging_bytes_per_token``), so a first save too large for the slot
        dir is staged on the store's disk instead of failing."""
        return self.estimate_bytes(tokens) or self._settings.staging_bytes_per_token * tokens

    def _sizes(self, fingerprint: manifest.Fingerprint) -> list[tuple[int, int]]:
        """(tokens, bytes) of the snapshots of ``fingerprint``, newest first."""
        return [(m.tokens, m.bytes) for m in self._snapshots.snapshots() if m.fingerprint == fingerprint]

    def estimate(self, action: policy.Save, fingerprint: manifest.Fingerprint, free_bytes: int) -> floor.Estimate:
        """What the save would write on the disk ``free_bytes`` was measured on (see :mod:`.floor`)."""
        whole = self.estimate_bytes(action.tokens)
        if self._snapshots.blocks is None:
            return floor.whole_files(whole_bytes=whole, free_bytes=free_bytes)
        newest = next((m for m in self._snapshots.snapshots(action.slot) if m.fingerprint == fingerprint), None)
        held = 0 if newest is None else newest.tokens
        fixed = floor.fixed_bytes(self._sizes(fingerprint))
        room = self._snapshots.disk.staging_room()
        return floor.block_store(
            whole_bytes=whole,
            new_bytes=floor.tail_bytes(tokens=action.tokens, held_tokens=held, whole_bytes=whole, fixed=fixed),
            store_free=free_bytes,
            staging_free=None if room is None else room[0],
            shares_disk=room is not None and room[1],
        )

    async def make_room(self, estimate: floor.Estimate) -> floor.Estimate:
        """Delete the least recently used snapshots not in use, just enough for ``estimate`` to fit above the
        floor (none if all of them would not do); the estimate with the free space measured after."""
        min_free = self._settings.min_free_bytes
        known = self._snapshots.snapshots()
        blocks = None if self._snapshots.blocks is None else self._snapshots.blocks.digests
        victims = await asyncio.to_thread(
            policy.select_for_space,
            known,
            need=estimate.bytes,
            free=estimate.free_bytes,
            floor=min_free,
            in_use=self._snapshots.recency.in_use(),
            last_used=self._snapshots.last_used,
            blocks=blocks,
        )
        if not victims:
            return estimate
        freed = await asyncio.to_thread(policy.freed_bytes, known, victims, blocks=blocks)
        await self.delete([(record, outcomes.GcReason.SPACE) for record in victims])
        free = await asyncio.to_thread(self._snapshots.disk.free_bytes)
        after = estimate if isinstance(free, str) else dataclasses.replace(estimate, free_bytes=free)
        where = self.where(estimate.disk)
        log.warning(
            "snapshots_evicted_for_space",
            disk=estimate.disk.value,
            directory=str(where),
            count=len(victims),
            freed_bytes=freed,
            free_bytes_before=estimate.free_bytes,
            free_bytes_after=after.free_bytes,
            estimated_bytes=estimate.bytes,
            min_free_bytes=min_free,
            effect="the least recently used snapshots not in use were deleted so that the save fits above "
            "--min-free-bytes; they no longer restore",
            hint=f"give the filesystem of {where} more room, or set --max-bytes to bound the snapshots below "
            "what the disk holds",
        )
        return after

    def where(self, disk: floor.Disk) -> Path:
        """The directory on the filesystem a floor check measured."""
        return self._snapshots.disk.keeps if disk == floor.Disk.STORE else self._snapshots.dir

    async def delete(self, doomed: Sequence[tuple[manifest.Manifest, outcomes.GcReason]]) -> None:
        """Delete each snapshot, counted and logged with its reason, then the blocks none names any more."""
        for record, reason in doomed:
            await asyncio.to_thread(self._snapshots.curator.delete, record)
            self._stats.gc_deleted.labels(reason.value).inc()
            log.info("snapshot_deleted", file=record.file, slot=record.slot, reason=reason.value)
        if doomed:
            await asyncio.to_thread(self._snapshots.curator.collect_blocks)
