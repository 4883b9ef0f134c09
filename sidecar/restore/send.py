"""One restore call into a slot, and what its answer means: restored, refused, raced or incomplete."""

from __future__ import annotations

import asyncio
import itertools
import time

import structlog

from sidecar.core import errors, events, metrics, outcomes, protocols, tasks
from sidecar.restore import ahead, records, verify
from sidecar.slots import actions
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.restore")
Outcome = outcomes.RestoreOutcome


class Sender:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        rebuilt_ahead: ahead.Ahead,
        acts: records.Acts,
        tally: records.Tally,
        verifier: verify.Verifier,
    ) -> None:
        self._actions = slot_actions
        self._snapshots = snapshots
        self._stats = stats
        self._clock = clock
        self._ahead = rebuilt_ahead
        self._acts = acts
        self._tally = tally
        self._verifier = verifier
        self._serials = itertools.count(1)
        self._giving_back: set[asyncio.Task[None]] = set()

    async def read(self, slot: int) -> tuple[events.SlotView | None, str]:
        try:
            view = await self._actions.view(slot)
        except errors.UpstreamError as exc:
            return None, f"cannot read /slots: {exc}"
        return view, "" if view is not None else "slot vanished from /slots"

    async def stage(self, candidate: manifest.Manifest, *, slot: int | None = None) -> tuple[str | None, bool]:
        """The name the server restores ``candidate`` from, and whether it was rebuilt now (time has passed);
        None if it cannot be rebuilt (logged, and quarantined on proof of bad content: a missing or corrupt
        block refuses that snapshot only).

        Without a block store that is the snapshot's own file. With one, its file rebuilt ahead while the
        server loaded (:mod:`sidecar.restore.ahead`), or else rebuilt now into the slot dir under a fresh name,
        checked against its checksum either way; the caller gives it back with :meth:`give_back`. ``slot``:
        where a restore round restores it (a file rebuilt ahead for another snapshot of that slot, displaced
        by ``candidate``, is given back first, its pages to this rebuild).
        """
        if self._snapshots.blocks is None:
            return candidate.file, False
        await self._ahead.settle()  # a swap's rebuild begun while its slot was saved
        ready = self._ahead.take(candidate)
        if ready is not None:
            return ready, False
        if slot is not None:
            await self._ahead.displaced(slot, candidate)
        await self._ahead.drop_swap()  # another swap's: one rebuild of ours in the slot dir at a time
        self._acts.mark()
        try:
            return await asyncio.to_thread(self._snapshots.staged.stage, candidate), True
        except errors.SnapshotError as exc:
            if exc.reason not in outcomes.BAD_CONTENT:
                log.warning(
                    "snapshot_unreadable",
                    slot=candidate.slot,
                    file=candidate.file,
                    error=str(exc),
                    effect="not restored now; tried again later (nothing proves it bad)",
                )
                return None, False
            log.error(
                "snapshot_corrupt",
                slot=candidate.slot,
                file=candidate.file,
                reason=exc.reason,
                error=str(exc),
                effect="refused and quarantined: its file cannot be rebuilt exactly from the block store; "
                "every snapshot that does not name the bad block still restores",
                hint="check the --store-dir disk; a block changed or vanished outside the sidecar",
            )
            await asyncio.to_thread(self._snapshots.curator.quarantine, candidate.file, exc.reason, detail=str(exc))
            return None, False

    def give_back(self, staged: str, candidate: manifest.Manifest) -> None:
        """Delete what :meth:`Staging.stage` staged, off the restore's path: freeing a large file takes a while (a
        quarter of a second for 300 MB on tmpfs, on a busy machine), and the next slot or request waits."""
        if staged == candidate.file:
            return
        task = tasks.watch(
            asyncio.create_task(asyncio.to_thread(self._snapshots.staged.unstage, staged, candidate), name="give-back"),
            effect="a staged rebuild stays in the slot dir until the sidecar's next start-up",
        )
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def send(
        self,
        slot: int,
        before: events.SlotView,
        candidate: manifest.Manifest,
        healthy_at: float | None,
        counters: events.Counters | None,
        path_started: float,
        *,
        by: outcomes.SavedBy = outcomes.SavedBy.RESTORE,
        filename: str,
    ) -> tuple[records.RestoreRecord, manifest.Manifest | None]:
        """The restore call itself, right after ``before`` was read; then look for a racing request.

        ``path_started``: when the slot's restore began (its first read), for the log's ``path_seconds``.
        ``filename``: what the server reads, the snapshot's file or its staged rebuild (see :meth:`Staging.stage`).
        """
        started = time.perf_counter()
        self._acts.mark()
        try:
            result = await self._actions.restore(slot, filename)
        except errors.UpstreamError as exc:
            return self._refused(slot, candidate, exc), None
        seconds = time.perf_counter() - started
        path_seconds = time.perf_counter() - path_started
        after, _ = await self.read(slot)
        if after is not None and after.task != before.task:
            return self._raced(slot, candidate), None
        if result.tokens != candidate.tokens:
            return self._incomplete(slot, candidate, result.tokens), None
        since = self._clock.monotonic() - healthy_at if healthy_at is not None else None
        self._stats.restore_duration.observe(seconds)
        if since is not None:
            self._stats.restart_to_restore.observe(since)
        self._stats.restored_tokens.labels(str(slot)).inc(result.tokens)
        log.info(
            "slot_restored",
            slot=slot,
            file=candidate.file,
            tokens=result.tokens,
            seconds=round(seconds, 4),
            path_seconds=round(path_seconds, 4),
            server_ms=result.server_ms,
            since_healthy=None if since is None else round(since, 4),
        )
        task = after.task if after is not None else before.task
        done = records.Done(next(self._serials), by, slot, candidate.file, result.tokens, seconds, self._clock.wall())
        return self._verifier.hold(done, task, counters, since), candidate

    def _refused(self, slot: int, candidate: manifest.Manifest, exc: errors.UpstreamError) -> records.RestoreRecord:
        log.error(
            "restore_failed",
            slot=slot,
            file=candidate.file,
            error=str(exc),
            hint="the server refused a file that passed its checksum: check that llama-server "
            "runs with the same KV settings (--swa-full, cache types) as when it was saved",
        )
        return self._tally.count(slot, Outcome.FAILED, str(exc), candidate.file)

    def _raced(self, slot: int, candidate: manifest.Manifest) -> records.RestoreRecord:
        log.warning(
            "restore_raced",
            slot=slot,
            file=candidate.file,
            effect="a request ran on the slot while the restore call was in flight; the server ran the "
            "restore after it, replacing that request's KV with the snapshot",
            hint="its answer is not affected; its next turn re-prefills what it does not share with the snapshot",
        )
        return self._tally.count(slot, Outcome.RACED, "a request took the slot during the restore", candidate.file)

    def _incomplete(self, slot: int, candidate: manifest.Manifest, tokens: int) -> records.RestoreRecord:
        log.error(
            "restore_incomplete",
            slot=slot,
            file=candidate.file,
            restored_tokens=tokens,
            snapshot_tokens=candidate.tokens,
            effect="counted failed: the server's answer does not say it restored the snapshot; the slot's "
            "next request re-prefills what it lacks",
            hint="llama-server's KV layout does not fit the snapshot: check its -c, -np, cache types and "
            "--swa-full against the server that saved it",
        )
        detail = f"the server restored {tokens} of the snapshot's {candidate.tokens} tokens"
        return self._tally.count(slot, Outcome.FAILED, detail, candidate.file)
