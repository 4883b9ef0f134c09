"""Taking snapshots: disk floor, the server's save, the store's commit, retention.

The caller holds ``SlotActions.lock`` and has just read the slot idle (see
:mod:`sidecar.actions`); every attempt ends in one :class:`SaveRecord` whose
``result`` is the ``snapshots_total`` label and whose ``cause`` says why a
save did not end ``ok``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from sidecar import (
    actions,
    config,
    errors,
    events,
    hashing,
    manifest,
    metrics,
    outcomes,
    policy,
    protocols,
    store,
)

log = structlog.get_logger("sidecar.snapshot")
PACED = frozenset({policy.SaveReason.IDLE, policy.SaveReason.PERIODIC})
"""Saves nobody waits for: their hash is paced while other slots generate."""


@dataclasses.dataclass(frozen=True, slots=True)
class SaveRecord:
    """One save attempt; the newest is shown in /status."""

    slot: int
    result: outcomes.SaveResult
    cause: outcomes.SaveCause | None
    """Why the save did not end ``ok``; None when it did."""
    detail: str
    """The committed file, or what went wrong and what to do."""
    at: float
    """Unix time of the attempt's end."""
    seconds: float
    tokens: int
    bytes: int


class Snapshotter:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.SnapshotSettings,
        clock: protocols.Clock,
    ) -> None:
        self._actions = slot_actions
        self._snapshots = snapshots
        self._stats = stats
        self._settings = settings
        self._clock = clock
        self.last: SaveRecord | None = None
        self._low_disk = False

    async def save(
        self, action: policy.Save, *, identity: events.Identity, slot_n_ctx: int, others_busy: bool = False
    ) -> SaveRecord:
        """Save one slot: the caller holds the action lock and has just read the slot idle.

        ``others_busy``: another slot was processing at that read. A save in the background (idle,
        periodic) then paces its hash (``hashing.PACE``) so as not to lengthen their token gaps;
        a save someone waits for (a swap, an admin's, the final one) never does.
        """
        slot = action.slot
        need = self._estimate_bytes(action.tokens)
        usage = await asyncio.to_thread(self._snapshots.usage)
        if usage.problem:
            return self._fail(slot, outcomes.SaveCause.SLOT_DIR, usage.problem, 0.0)
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
            return self._record(
                slot, outcomes.SaveCause.LOW_DISK, "disk below the free-space floor", tokens=action.tokens
            )
        self._low_disk = False
        temp = self._snapshots.temp_name(slot)
        started = time.perf_counter()
        try:
            result = await self._actions.save(slot, temp)
            committed = await asyncio.to_thread(
                self._snapshots.commit,
                temp,
                slot=slot,
                tokens=result.tokens,
                written=result.bytes,
                task=action.signature[0],
                fingerprint=manifest.Fingerprint.of(identity, n_ctx=slot_n_ctx),
                pause=hashing.PACE if others_busy and action.reason in PACED else 0.0,
            )
        except errors.SnapshotError as exc:
            seconds = time.perf_counter() - started
            if exc.reason == "empty":
                log.info("snapshot_skipped_empty", slot=slot, reason=str(exc))
                return self._record(slot, outcomes.SaveCause.EMPTY, str(exc), seconds=seconds)
            cause = outcomes.SaveCause.NOT_LINKED if exc.reason == "missing" else outcomes.SaveCause.CHECK
            return self._fail(slot, cause, str(exc), seconds)
        except errors.UpstreamNotSupported as exc:
            detail = f"{exc}: start llama-server with --slot-save-path set to the sidecar's --slot-dir"
            return self._fail(slot, outcomes.SaveCause.NOT_SUPPORTED, detail, time.perf_counter() - started)
        except errors.UpstreamError as exc:
            return self._fail(slot, outcomes.SaveCause.SERVER, str(exc), time.perf_counter() - started)
        seconds = time.perf_counter() - started
        self._stats.snapshot_duration.observe(seconds)
        self._stats.last_snapshot.set(committed.created)
        log.info(
            "snapshot_committed",
            slot=slot,
            file=committed.file,
            tokens=committed.tokens,
            bytes=committed.bytes,
            seconds=round(seconds, 4),
            server_ms=result.server_ms,
            reason=action.reason.value,
        )
        record = self._record(
            slot, None, committed.file, seconds=seconds, tokens=committed.tokens, size=committed.bytes
        )
        await self.collect_garbage()
        return record

    async def collect_garbage(self) -> None:
        doomed = policy.select_for_deletion(
            self._snapshots.snapshots(),
            keep_per_slot=self._settings.keep_per_slot,
            max_bytes=self._settings.max_bytes,
            max_age=self._settings.max_age,
            now=self._clock.wall(),
            in_use=self._snapshots.in_use(),
            last_used=self._snapshots.last_used,
        )
        for record, reason in doomed:
            await asyncio.to_thread(self._snapshots.delete, record)
            self._stats.gc_deleted.labels(reason.value).inc()
            log.info("snapshot_deleted", file=record.file, slot=record.slot, reason=reason.value)

    def skip(self, action: policy.Skip) -> SaveRecord:
        log.info("snapshot_skipped", slot=action.slot, reason=action.why)
        return self._record(action.slot, outcomes.SaveCause.BELOW_MIN_TOKENS, action.why, tokens=action.signature[1])

    def busy(self, action: policy.Save) -> SaveRecord:
        detail = (
            "the slot was processing a request when read right before the save: nothing is sent to a busy "
            "slot (the server would hold the call until the request ends); it is saved once idle"
        )
        log.info("snapshot_skipped_busy", slot=action.slot, reason=action.reason.value)
        return self._record(action.slot, outcomes.SaveCause.SLOT_BUSY, detail, tokens=action.tokens)

    def _estimate_bytes(self, tokens: int) -> int:
        known = self._snapshots.snapshots()
        if not known:
            return 0
        newest = known[0]
        return int(newest.bytes / max(newest.tokens, 1) * tokens)

    def _fail(self, slot: int, cause: outcomes.SaveCause, detail: str, seconds: float) -> SaveRecord:
        log.error("snapshot_failed", slot=slot, cause=cause.value, error=detail)
        return self._record(slot, cause, detail, seconds=seconds)

    def _record(
        self,
        slot: int,
        cause: outcomes.SaveCause | None,
        detail: str,
        *,
        seconds: float = 0.0,
        tokens: int = 0,
        size: int = 0,
    ) -> SaveRecord:
        if cause is None:
            result = outcomes.SaveResult.OK
        elif cause in outcomes.SKIP_CAUSES:
            result = outcomes.SaveResult.SKIPPED
        else:
            result = outcomes.SaveResult.FAILED
        self._stats.snapshots.labels(str(slot), result.value).inc()
        self._stats.count_model(self._stats.model_snapshots, result.value)
        self.last = SaveRecord(slot, result, cause, detail, self._clock.wall(), seconds, tokens, size)
        return self.last
