"""Taking snapshots: disk floor, the server's save, the store's commit, retention.

One :class:`Snapshotter` per process; its lock guarantees that at most one
save is in flight (a save stalls every slot of the server), whether it was
proposed by the policy, asked for by an admin, or taken at shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import structlog

from sidecar import config, errors, events, manifest, metrics, policy, store, upstream

log = structlog.get_logger("sidecar.snapshot")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveRecord:
    """The newest save attempt, for /status."""

    slot: int
    result: str
    detail: str
    at: float
    seconds: float
    tokens: int
    bytes: int


class Snapshotter:
    def __init__(
        self,
        *,
        client: upstream.LlamaClient,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.SnapshotSettings,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._store = snapshots
        self._metrics = stats
        self._settings = settings
        self._wall = wall
        self.lock = asyncio.Lock()
        self.last: SaveRecord | None = None
        self._low_disk = False

    async def save(
        self, action: policy.Save, *, identity: events.Identity, slot_n_ctx: int
    ) -> manifest.Manifest | None:
        """Save one slot; returns the committed manifest, or None if skipped or failed."""
        async with self.lock:
            return await self._save(action, identity, slot_n_ctx)

    async def _save(self, action: policy.Save, identity: events.Identity, slot_n_ctx: int) -> manifest.Manifest | None:
        slot = action.slot
        need = self._estimate_bytes(action.tokens)
        usage = await asyncio.to_thread(self._store.usage)
        if usage.problem:
            self._fail(slot, usage.problem, time.perf_counter())
            return None
        if usage.free_bytes - need < self._settings.min_free_bytes:
            if not self._low_disk:
                log.warning(
                    "snapshot_skipped_low_disk",
                    slot=slot,
                    free_bytes=usage.free_bytes,
                    estimated_bytes=need,
                    min_free_bytes=self._settings.min_free_bytes,
                    hint="free space in the slot dir or lower --min-free-bytes; existing snapshots are kept",
                )
            self._low_disk = True
            self._record(slot, "skipped", "disk below the free-space floor", 0.0, action.tokens, 0)
            return None
        self._low_disk = False
        temp = self._store.temp_name(slot)
        started = time.perf_counter()
        try:
            result = await self._client.save(slot, temp)
            record = await asyncio.to_thread(
                self._store.commit,
                temp,
                slot=slot,
                tokens=result.tokens,
                written=result.bytes,
                task=action.signature[0],
                fingerprint=manifest.Fingerprint.of(identity, n_ctx=slot_n_ctx),
            )
        except errors.SnapshotError as exc:
            if exc.reason == "empty":
                self._record(slot, "skipped", str(exc), time.perf_counter() - started, 0, 0)
                log.info("snapshot_skipped_empty", slot=slot, reason=str(exc))
                return None
            self._fail(slot, str(exc), started)
            return None
        except errors.UpstreamNotSupported as exc:
            self._fail(
                slot,
                f"{exc}: start llama-server with --slot-save-path set to the sidecar's --slot-dir",
                started,
            )
            return None
        except errors.UpstreamError as exc:
            await asyncio.to_thread(self._store.remove, temp)
            self._fail(slot, str(exc), started)
            return None
        seconds = time.perf_counter() - started
        self._metrics.snapshot_duration.observe(seconds)
        self._metrics.last_snapshot.set(record.created)
        self._record(slot, "ok", record.file, seconds, record.tokens, record.bytes)
        log.info(
            "snapshot_committed",
            slot=slot,
            file=record.file,
            tokens=record.tokens,
            bytes=record.bytes,
            seconds=round(seconds, 4),
            server_ms=result.server_ms,
            reason=action.reason.value,
        )
        await self.collect_garbage()
        return record

    async def collect_garbage(self) -> None:
        doomed = policy.select_for_deletion(
            self._store.snapshots(),
            keep_per_slot=self._settings.keep_per_slot,
            max_bytes=self._settings.max_bytes,
            max_age=self._settings.max_age,
            now=self._wall(),
        )
        for record, reason in doomed:
            await asyncio.to_thread(self._store.delete, record)
            self._metrics.gc_deleted.labels(reason.value).inc()
            log.info("snapshot_deleted", file=record.file, slot=record.slot, reason=reason.value)

    def skip(self, action: policy.Skip) -> None:
        self._record(action.slot, "skipped", action.why, 0.0, action.signature[1], 0)
        log.info("snapshot_skipped", slot=action.slot, reason=action.why)

    def _estimate_bytes(self, tokens: int) -> int:
        known = self._store.snapshots()
        if not known:
            return 0
        newest = known[0]
        return int(newest.bytes / max(newest.tokens, 1) * tokens)

    def _fail(self, slot: int, detail: str, started: float) -> None:
        self._record(slot, "failed", detail, time.perf_counter() - started, 0, 0)
        log.error("snapshot_failed", slot=slot, error=detail)

    def _record(self, slot: int, result: str, detail: str, seconds: float, tokens: int, size: int) -> None:
        self._metrics.snapshots.labels(str(slot), result).inc()
        self.last = SaveRecord(slot, result, detail, self._wall(), seconds, tokens, size)
