"""Taking snapshots: disk floor, the server's save, the store's commit, retention.

Every attempt ends in one ``SaveRecord`` (:mod:`.records`); retention runs after each commit
(:mod:`.garbage`). A save nobody waits for, made while another slot
generates, leaves its checksum and commit until no slot is processing; commits keep the order of the
saves.

Invariants and trade-offs: docs/modules.md, `sidecar/save/snapshotter.py`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable

import structlog

from sidecar.core import apikeys, config, errors, events, metrics, outcomes, protocols
from sidecar.save import diskroom, garbage, policy, records, storefault, windowsave
from sidecar.slots import actions
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.snapshot")
BACKGROUND = frozenset({policy.SaveReason.IDLE, policy.SaveReason.PERIODIC})
"""Saves nobody waits for: while other slots generate, their commit waits (see the module docstring)."""
COMMIT_WAIT = 60.0
"""Longest a commit waits for a moment when no slot is processing, in seconds after the server's save."""


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """A file the server has written for a save, under its temp name until committed."""

    action: policy.Save
    temp: str
    result: protocols.ActionResult
    fingerprint: manifest.Fingerprint
    created: float
    """Unix time just before the server's save call: what the snapshot holds is at least this new."""
    written_at: float
    """Monotonic time the save call returned."""
    call_seconds: float
    """The save call, as the sidecar timed it."""
    epoch: int
    """The caller's count of server processes at the save (see ``Engine``)."""
    prefill_rate: float | None = None
    """The server's measured prompt tokens per second at the save, recorded in the manifest."""
    owner: str = apikeys.NOBODY
    """Whose conversation the slot held at the save, recorded in the manifest."""


class Snapshotter:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.SnapshotSettings,
        clock: protocols.Clock,
        committed_later: Callable[[Written, records.SaveRecord], None] = lambda written, record: None,
    ) -> None:
        """``committed_later`` is called with each pending save once its commit ended (``record.result``
        says how)."""
        self._actions = slot_actions
        self._snapshots = snapshots
        self._stats = stats
        self._room = diskroom.DiskRoom(snapshots=snapshots, stats=stats, settings=settings)
        self._settings = settings
        self._clock = clock
        self.records = records.Records(stats=stats, clock=clock)
        """Every save attempt's record, counted; the newest kept (``records.last``)."""
        self.garbage = garbage.Collector(snapshots=snapshots, settings=settings, clock=clock, room=self._room)
        """Retention, applied after each commit."""
        self._low_disk = False
        self._unwritable: storefault.Episode | None = None
        """The disk the snapshots are kept on refused a save's write (see :mod:`~sidecar.save.storefault`)."""
        self.pending: collections.deque[Written] = collections.deque()
        """Saves whose commit waits, oldest first."""
        self.pace: float | None = None
        """Seconds per token of the newest save that wrote tokens, as the server timed it (every slot stalls
        that long per token of the slot saved); None before the first."""
        self._committed_later = committed_later

    @property
    def low_disk(self) -> bool:
        """The newest save found its disk below ``--min-free-bytes`` even after making room (until a save fits)."""
        return self._low_disk

    async def save(
        self,
        action: policy.Save,
        *,
        identity: events.Identity,
        slot_n_ctx: int,
        others_busy: bool = False,
        epoch: int = 0,
        prefill_rate: float | None = None,
        owner: str = apikeys.NOBODY,
    ) -> records.SaveRecord | Written:
        """Save one slot: the caller holds the action lock and has just read the slot idle.

        ``others_busy``: another slot was processing at that read. A save in the background (idle,
        periodic) then returns its :class:`Written` file, committed later by :meth:`commit_pending`;
        every other save is committed now, after the pending ones, and returns its record.
        """
        slot = action.slot
        fingerprint = manifest.Fingerprint.of(identity, n_ctx=slot_n_ctx)
        below = await self._below_floor(action, fingerprint)
        if below is not None:
            return below
        temp = self._snapshots.writer.temp_name(slot)
        await asyncio.to_thread(self._snapshots.staged.place_save, temp, self._room.staging_bytes(action.tokens))
        started = time.perf_counter()
        created = self._clock.wall()
        try:
            result = await self._actions.save(slot, temp)
            if identity.memory is events.Memory.SWA:  # made reusable after a restore (see .windowsave)
                result = await asyncio.to_thread(
                    windowsave.apply,
                    self._snapshots.staged.staged_path(temp),
                    result,
                    model_path=identity.model_path,
                    kind=identity.memory,
                )
            written = Written(
                action=action,
                temp=temp,
                result=result,
                fingerprint=fingerprint,
                created=created,
                written_at=self._clock.monotonic(),
                call_seconds=time.perf_counter() - started,
                epoch=epoch,
                prefill_rate=prefill_rate,
                owner=owner,
            )
            if result.tokens > 0:  # the server's own time: the call's also holds its wait for the loop
                self.pace = (result.server_ms / 1000 if result.server_ms > 0 else written.call_seconds) / result.tokens
            if others_busy and action.reason in BACKGROUND:
                await asyncio.to_thread(
                    self._snapshots.writer.check_written, temp, tokens=result.tokens, written=result.bytes
                )
                self._defer(written)
                return written
        except (errors.SnapshotError, errors.UpstreamError) as exc:
            return self.records.failed(slot, exc, time.perf_counter() - started)
        await self.commit_pending()
        return await self._commit(written)

    async def commit_pending(self, *, pause: float = 0.0, written_before: float | None = None) -> None:
        """Commit the pending saves, oldest first: all, or those written before ``written_before`` (monotonic).

        ``pause``: the hash's pause after each chunk (``hashing.PACE`` while slots generate).
        """
        while self.pending and (written_before is None or self.pending[0].written_at <= written_before):
            written = self.pending[0]
            try:
                record = await self._commit(written, pause=pause)
            finally:  # committed, failed, or cut short (its file is removed then)
                self.pending.popleft()
                self._stats.commits_pending.dec()
            self._committed_later(written, record)

    def commit_due(self, *, quiet: bool) -> float | None:
        """Which pending saves to commit now: those written before the returned monotonic time; None: none.

        ``quiet``: no slot is processing. Otherwise only saves pending for ``COMMIT_WAIT`` are due.
        """
        if not self.pending:
            return None
        if quiet:
            return self.pending[-1].written_at
        cutoff = self._clock.monotonic() - COMMIT_WAIT
        return cutoff if self.pending[0].written_at <= cutoff else None

    def _defer(self, written: Written) -> None:
        self.pending.append(written)
        self._stats.commits_pending.inc()
        log.info(
            "snapshot_commit_deferred",
            slot=written.action.slot,
            tokens=written.result.tokens,
            bytes=written.result.bytes,
            seconds=round(written.call_seconds, 4),
            server_ms=written.result.server_ms,
            reason=written.action.reason.value,
            effect=f"another slot is processing: its checksum would slow that generation; committed (and "
            f"restorable) once no slot is processing, or after {COMMIT_WAIT:.0f} s",
        )

    async def _commit(self, written: Written, *, pause: float = 0.0) -> records.SaveRecord:
        slot, result = written.action.slot, written.result
        waited = self._clock.monotonic() - written.written_at
        started = time.perf_counter()
        try:
            committed = await asyncio.to_thread(
                self._snapshots.writer.commit,
                written.temp,
                slot=slot,
                tokens=result.tokens,
                written=result.bytes,
                task=written.action.signature.task,
                fingerprint=written.fingerprint,
                pause=pause,
                created=written.created,
                prefill_rate=written.prefill_rate,
                owner=written.owner,
            )
        except errors.SnapshotError as exc:
            seconds = written.call_seconds + time.perf_counter() - started
            fault = storefault.classify(exc)
            if fault is not None:
                return await self._refused(slot, fault, exc, seconds)
            return self.records.failed(slot, exc, seconds)
        self._writable_again()
        seconds = written.call_seconds + time.perf_counter() - started
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
            reason=written.action.reason.value,
            saved_at=round(written.created, 3),
            save_seconds=round(written.call_seconds, 4),
            waited_seconds=round(waited, 3),
        )
        record = self.records.record(
            slot, None, committed.file, seconds=seconds, tokens=committed.tokens, size=committed.bytes
        )
        await self.garbage.collect()
        return record

    async def _below_floor(self, action: policy.Save, fingerprint: manifest.Fingerprint) -> records.SaveRecord | None:
        """The record of a save the disk cannot take now (unmeasurable, refused, or below the floor even once
        the least recently used snapshots made room); None: go on."""
        slot = action.slot
        free = await asyncio.to_thread(self._snapshots.disk.free_bytes)
        if isinstance(free, str):
            return self.records.fail(slot, outcomes.SaveCause.SLOT_DIR, free, 0.0)
        if self._unwritable is not None and not await self._may_write(self._unwritable, free):
            episode = self._unwritable
            self._unwritable = dataclasses.replace(episode, skipped=episode.skipped + 1)
            detail = f"skipped without a save call: {episode.detail}"
            return self.records.record(
                slot,
                outcomes.SaveCause.STORE_UNWRITABLE,
                detail,
                tokens=action.tokens,
                result=outcomes.SaveResult.SKIPPED,
            )
        min_free = self._settings.min_free_bytes
        estimate = await asyncio.to_thread(self._room.estimate, action, fingerprint, free)
        if estimate.short(min_free):
            estimate = await self._room.make_room(estimate)
        if estimate.short(min_free):
            where = self._room.where(estimate.disk)
            if not self._low_disk:
                log.warning(
                    "snapshot_skipped_low_disk",
                    slot=slot,
                    disk=estimate.disk.value,
                    directory=str(where),
                    free_bytes=estimate.free_bytes,
                    estimated_bytes=estimate.bytes,
                    staged_file_counted=estimate.staged,
                    min_free_bytes=min_free,
                    effect="this save and the next are skipped while the disk stays below the floor; existing "
                    "snapshots are kept and still restore (deleting every snapshot not in use would not make "
                    "room either)",
                    hint=f"free space on the filesystem of {where} or lower --min-free-bytes",
                )
            self._low_disk = True
            detail = (
                f"{estimate.disk.value} disk below the free-space floor: {estimate.free_bytes} bytes free, the save "
                f"would write about {estimate.bytes}, --min-free-bytes is {min_free}"
            )
            return self.records.record(slot, outcomes.SaveCause.LOW_DISK, detail, tokens=action.tokens)
        self._low_disk = False
        return None

    async def _may_write(self, episode: storefault.Episode, free_bytes: int) -> bool:
        """Whether a save may be tried while the disk refused the last one (free space back, a probe written)."""
        if not storefault.worth_probing(episode, free_bytes=free_bytes, now=self._clock.monotonic()):
            return False
        return await asyncio.to_thread(self._snapshots.writer.probe_write) is None

    async def _refused(
        self, slot: int, fault: outcomes.StoreFault, exc: errors.SnapshotError, seconds: float
    ) -> records.SaveRecord:
        """The record of a commit the disk refused; saves are skipped until it may take one again."""
        await asyncio.to_thread(self._snapshots.curator.collect_blocks)  # the failed ingest's new blocks
        usage = await asyncio.to_thread(self._snapshots.disk.usage)
        before = self._unwritable
        first = before is None
        retries = 0 if before is None or before.fault is not fault else before.retries + 1
        self._unwritable = storefault.Episode(fault, usage.free_bytes, str(exc), self._clock.monotonic(), retries)
        keeps = self._snapshots.disk.keeps
        if first:
            log.error(
                "snapshot_store_unwritable",
                slot=slot,
                reason=fault.value,
                directory=str(keeps),
                free_bytes=usage.free_bytes,
                error=str(exc),
                effect="this save is lost and later saves are skipped (llama-server is not asked to save); "
                "committed snapshots are kept and still restore, and the server keeps serving; saves "
                "resume on their own once the disk takes writes again",
                hint=storefault.HINTS[fault],
            )
        self._stats.snapshot_write_errors.labels(fault.value).inc()  # after the line: a count comes with its reason
        detail = f"the disk of {keeps} refused the save ({fault.value}): {exc}; {storefault.HINTS[fault]}"
        return self.records.record(slot, outcomes.SaveCause.STORE_UNWRITABLE, detail, seconds=seconds)

    def _writable_again(self) -> None:
        if self._unwritable is None:
            return
        episode, self._unwritable = self._unwritable, None
        log.info(
            "snapshot_store_writable_again",
            directory=str(self._snapshots.disk.keeps),
            reason=episode.fault.value,
            skipped=episode.skipped,
            effect="saves go on as before",
        )
