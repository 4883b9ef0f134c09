"""Putting snapshots back after a restart, and checking that it helped.

A restore round runs once per server process (after a detected restart, or
at start-up when the sidecar finds empty slots). For each slot it re-reads
/slots right before acting, so a user's request that reached the new
server first wins over an old snapshot; it tries the newest compatible
snapshot, re-hashing it first so a corrupt file is never handed to the
server; a file that fails the check is quarantined and the next older one
is tried.

Verification: a restore only counts as effective once the server reuses the
tokens. When a restored slot runs its next task, the growth of
``llamacpp:prompt_tokens_cached_total`` since the restore is compared with
the restored token count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import structlog

from sidecar import errors, events, manifest, metrics, policy, store, upstream

log = structlog.get_logger("sidecar.restore")
EFFECTIVE_SHARE = 0.5
"""Share of the restored tokens the server must reuse for a restore to count as effective."""


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreRecord:
    slot: int
    result: str
    detail: str
    at: float
    file: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    since_healthy: float | None = None


@dataclasses.dataclass(slots=True)
class _Pending:
    tokens: int
    cached_before: float | None


class Restorer:
    def __init__(
        self,
        *,
        client: upstream.LlamaClient,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        lock: asyncio.Lock,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._store = snapshots
        self._metrics = stats
        self._lock = lock
        self._mono = mono
        self._wall = wall
        self.last: list[RestoreRecord] = []
        self.pending: dict[int, _Pending] = {}
        self._verification_off_said = False

    async def restore_all(
        self,
        slots: tuple[events.SlotView, ...],
        identity: events.Identity,
        *,
        healthy_at: float | None,
        counters: events.Counters | None,
    ) -> dict[int, manifest.Manifest]:
        """One restore round; returns the manifest restored into each slot."""
        done: dict[int, manifest.Manifest] = {}
        records: list[RestoreRecord] = []
        async with self._lock:
            for view in slots:
                record, restored = await self._restore_slot(view.id, identity, healthy_at)
                records.append(record)
                if restored is not None:
                    done[view.id] = restored
                    self.pending[view.id] = _Pending(restored.tokens, counters.cached_tokens if counters else None)
        self.last = records
        return done

    async def _restore_slot(
        self, slot: int, identity: events.Identity, healthy_at: float | None
    ) -> tuple[RestoreRecord, manifest.Manifest | None]:
        try:
            fresh = await self._client.slots()
        except errors.UpstreamError as exc:
            return self._count(slot, policy.RestoreOutcome.FAILED, f"cannot read /slots: {exc}"), None
        view = next((v for v in fresh if v.id == slot), None)
        if view is None:
            return self._count(slot, policy.RestoreOutcome.FAILED, "slot vanished from /slots"), None
        plan = policy.plan_restore(view, self._store.snapshots(slot), identity)
        for file, why in plan.refusals:
            log.warning("snapshot_incompatible", slot=slot, file=file, differences=why)
        if plan.outcome is not None:
            detail = {
                policy.RestoreOutcome.SLOT_BUSY: "slot already holds a request's tokens or is processing",
                policy.RestoreOutcome.NO_SNAPSHOT: "no snapshot of this slot",
                policy.RestoreOutcome.INCOMPATIBLE: "no snapshot of this slot fits this server",
            }.get(plan.outcome, "")
            return self._count(slot, plan.outcome, detail), None
        for candidate in plan.candidates:
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self._store.verify, candidate)
            except errors.SnapshotError as exc:
                if exc.reason not in store.BAD_CONTENT:  # unreadable now, not proven bad: keep it
                    log.warning("snapshot_unreadable", slot=slot, file=candidate.file, error=str(exc))
                    continue
                log.error("snapshot_corrupt", slot=slot, file=candidate.file, reason=exc.reason, error=str(exc))
                await asyncio.to_thread(self._store.quarantine, candidate.file, exc.reason, detail=str(exc))
                continue
            try:
                result = await self._client.restore(slot, candidate.file)
            except errors.UpstreamError as exc:
                log.error(
                    "restore_failed",
                    slot=slot,
                    file=candidate.file,
                    error=str(exc),
                    hint="the server refused a file that passed its checksum: check that llama-server "
                    "runs with the same KV settings (--swa-full, cache types) as when it was saved",
                )
                return self._count(slot, policy.RestoreOutcome.FAILED, str(exc), candidate.file), None
            seconds = time.perf_counter() - started
            since = self._mono() - healthy_at if healthy_at is not None else None
            self._metrics.restore_duration.observe(seconds)
            if since is not None:
                self._metrics.restart_to_restore.observe(since)
            self._metrics.restored_tokens.labels(str(slot)).inc(result.tokens)
            log.info(
                "slot_restored",
                slot=slot,
                file=candidate.file,
                tokens=result.tokens,
                seconds=round(seconds, 4),
                server_ms=result.server_ms,
                since_healthy=None if since is None else round(since, 4),
            )
            record = self._count(slot, policy.RestoreOutcome.OK, "", candidate.file, result.tokens, seconds, since)
            return record, candidate
        return self._count(slot, policy.RestoreOutcome.FAILED, "every snapshot of this slot failed its check"), None

    def verify(self, slots: tuple[events.SlotView, ...], counters: events.Counters | None) -> None:
        """Judge pending restores whose slot has run a task since; call with fresh counters."""
        for view in slots:
            pending = self.pending.get(view.id)
            if pending is None or view.task is None or view.processing:
                continue
            del self.pending[view.id]
            if counters is None or pending.cached_before is None:
                if not self._verification_off_said:
                    log.warning(
                        "restore_verification_off",
                        reason="llama-server's /metrics is not readable",
                        hint="start llama-server with --metrics to check that restores save prefill",
                    )
                    self._verification_off_said = True
                continue
            reused = counters.cached_tokens - pending.cached_before
            if reused >= EFFECTIVE_SHARE * pending.tokens:
                self._metrics.restore_verifications.labels("effective").inc()
                log.info("restore_effective", slot=view.id, restored_tokens=pending.tokens, reused_tokens=reused)
            else:
                self._metrics.restore_verifications.labels("ineffective").inc()
                log.warning(
                    "restore_ineffective",
                    slot=view.id,
                    restored_tokens=pending.tokens,
                    reused_tokens=reused,
                    hint="the server re-prefilled instead of reusing the restored KV. For sliding-window "
                    "models (Gemma 3, gpt-oss, ...) start llama-server with --swa-full; otherwise the "
                    "next request may have been a different conversation",
                )

    def _count(
        self,
        slot: int,
        outcome: policy.RestoreOutcome,
        detail: str,
        file: str | None = None,
        tokens: int = 0,
        seconds: float = 0.0,
        since: float | None = None,
    ) -> RestoreRecord:
        self._metrics.restores.labels(str(slot), outcome.value).inc()
        if outcome is not policy.RestoreOutcome.OK:
            log.info(
                "restore_skipped" if outcome is not policy.RestoreOutcome.FAILED else "restore_not_done",
                slot=slot,
                result=outcome.value,
                reason=detail,
            )
        return RestoreRecord(slot, outcome.value, detail, self._wall(), file, tokens, seconds, since)
