"""Putting snapshots back after a restart, and checking that it helped.

A restore round runs once per server process (after a detected restart, or
at start-up when the sidecar finds empty slots). The window in which a
user's request can reach a slot between the sidecar's look at it and the
restore call is kept as small as the server allows:

* files are checked (size and xxh3-128 checksum) ahead, while the server is still
  loading (:meth:`Restorer.precheck`), so no hashing sits inside the window;
  with a block store, the files the round will restore are rebuilt then too
  (:mod:`sidecar.act.ahead`), so no rebuild sits inside it either;
  a file checked then is trusted by the next restore round while its size,
  mtime and inode stay the same; any other file is hashed in the round, and
  the slot read again after; a file that fails a check is quarantined and the
  next older one is tried;
* the slot is read right before the restore call, and only an idle, empty
  slot is restored into; the round's first read of every slot serves as
  that read until the round has hashed a file or restored a slot (nothing
  else passes between them), so a round with its files checked ahead reads
  ``/slots`` once before its first restore call;
* the slot is read again right after: if its ``id_task`` moved, a request
  ran on it while the call was in flight, the server deferred the restore
  behind it and then replaced that request's KV. That is counted as
  ``raced``, never as ``ok``.

What counts as ``ok``: the server's answer must say it restored every
token of the snapshot (``n_restored``; fewer is ``failed``,
``restore_incomplete``), and the server's layout must fit what the snapshot
needs. On a sliding-window model (``memory`` ``swa``, from the GGUF header)
the server cannot say the second: without ``--swa-full`` a restore
"succeeds" and is not reused, and ``--swa-full`` is not in /props. Such a
restore is ``unverified`` (so shown in /status) and counted in
``restores_total`` only once the verification below decides: ``ok`` if the
slot's next request reused the tokens, ``ineffective`` if not,
``unverified`` if nothing decided before the restore was lost.

Verification: a restore only counts as effective once the server reuses the
tokens, judged per slot from that slot's next task. Through the proxy that
task's own answer says how many prompt tokens the server reused
(``timings.cache_n``, the ``usage`` cached tokens): the library hands it over
(:meth:`Restorer.answered`). Otherwise, when a task that started after the
restore (``id_task`` past the one read right after it) has run on the slot,
the growth of ``llamacpp:prompt_tokens_cached_total`` stands for it only if
no other slot ran a task meanwhile; else the growth mixes several slots'
reuse and the restore is counted ``unverified``. The tokens an effective
restore spared the server are priced in prefill seconds
(:mod:`sidecar.act.savings`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from sidecar.act import actions, ahead, policy, restoreplan, savings
from sidecar.core import errors, events, hashing, metrics, outcomes, protocols, tasks
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.restore")
EFFECTIVE_SHARE = 0.5
"""Share of the restored tokens the server must reuse for a restore to count as effective."""
Outcome = outcomes.RestoreOutcome


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreRecord:
    slot: int
    result: outcomes.RestoreOutcome
    detail: str
    at: float
    """Unix time of the attempt's end."""
    file: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    since_healthy: float | None = None

    @property
    def restored(self) -> bool:
        """The server holds the snapshot now (counted ``ok``, or waiting for its verdict)."""
        return self.result in (Outcome.OK, Outcome.UNVERIFIED)


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """A restore or swap that put tokens back, and what the slot's next task made of it (for the page)."""

    serial: int
    by: outcomes.SavedBy
    slot: int
    file: str
    tokens: int
    seconds: float
    at: float
    """Unix time the restore call ended."""
    verdict: outcomes.Verification | None = None
    """None while the slot's next task has not run (or could not be judged: no /metrics, a restart)."""
    reused_tokens: int = 0
    saved_seconds: float | None = None
    """Prefill seconds it saved; None until judged effective and priced."""


RECENT = 20
"""Restores and swaps kept in :attr:`Restorer.recent`."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unverified:
    """A restore waiting for the slot's next task to show whether the server reused it."""

    tokens: int
    cached_before: float | None
    task: int | None
    """The slot's ``id_task`` read right after the restore: only a later task may judge it."""
    at: float
    """Monotonic time the restore ended: only counters read after it may judge it."""
    by: outcomes.SavedBy = outcomes.SavedBy.RESTORE
    """What put the tokens back: a restore round or a library swap."""
    serial: int = 0
    """The :class:`Done` entry the verdict goes to."""
    others: tuple[tuple[int, int | None], ...] | None = None
    """The other slots' ``id_task`` at the first poll after the restore: if one moves, the counter is not
    this slot's alone."""
    uncounted: bool = False
    """Not counted in ``restores_total`` yet (a sliding-window model): the verdict decides ok or ineffective."""


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """A snapshot file being checked now (for liveness: a hash that hangs is a stuck sidecar)."""

    file: str
    deadline: float
    """Monotonic time by which the check gives up (``hashing.deadline_for`` its size)."""


_DETAILS = {
    Outcome.SLOT_BUSY: "slot already holds a request's tokens or is processing",
    Outcome.NO_SNAPSHOT: "no snapshot of this slot",
    Outcome.INCOMPATIBLE: "no snapshot of this slot fits this server",
}
_VERDICTS = {
    Outcome.OK: "the slot's next request reused it",
    Outcome.INEFFECTIVE: "the slot's next request did not reuse it: this sliding-window model needs "
    "llama-server started with --swa-full for a restore to be reused",
    Outcome.UNVERIFIED: "nothing decided whether the server reused it before it was lost (a restart, no "
    "readable /metrics, or other slots' tasks mixed into the server's reuse counter)",
}
_Stamp = tuple[int, int, int]
"""(size, mtime_ns, inode) of a file when it passed its check."""


class Order(Protocol):
    """A restore round's order: what goes next and where, and who is told of each restore as it lands."""

    async def next_step(self, pending: tuple[int, ...]) -> restoreplan.Step:
        """What to restore next into one of ``pending`` (not empty), as :func:`restoreplan.plan` says; may wait."""

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """``record`` is restored into ``slot``, before the round goes on."""


class Restorer:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        identity: Callable[[], events.Identity | None] = lambda: None,
    ) -> None:
        """``identity``: the running server's identity as last read (what every snapshot must match)."""
        self._actions = slot_actions
        self._identity = identity
        self._snapshots = snapshots
        self._stats = stats
        self._clock = clock
        self.last: list[RestoreRecord] = []
        self.unverified: dict[int, Unverified] = {}
        self._memory: events.Memory | None = None
        """The model's memory kind, as the newest judged observation's identity says (for the hints)."""
        """Restores waiting for their verification (the slot's next task), by slot."""
        self.savings = savings.Savings()
        """Prefill seconds the effective restores and swaps saved."""
        self.recent: collections.deque[Done] = collections.deque(maxlen=RECENT)
        """The newest restores and swaps that put tokens back, oldest first."""
        self._serials = itertools.count(1)
        self._checked: dict[str, _Stamp] = {}
        self._verification_off_said = False
        self._acted = 0
        """Files hashed and restore calls made: a view read before either is no longer fresh."""
        self.checking: Check | None = None
        """The file being checked now; None between checks."""
        self.checked_at = float("-inf")
        """Monotonic time the last check ended (progress, for liveness)."""
        self._ahead = ahead.Ahead(snapshots, stats)
        self._giving_back: set[asyncio.Task[None]] = set()

    async def precheck(self, *, rebuild: bool = False) -> None:
        """Check the newest good snapshot of every slot now, so the restore round does not hash.

        Called while the server loads (or before the first poll), when the
        files are all the sidecar can work on. ``rebuild``: with a block store,
        also rebuild those snapshots into the slot dir (:mod:`sidecar.act.ahead`),
        so the round does not rebuild either.
        """
        self._checked.clear()  # every restore round's files are hashed anew: just before it, or in it
        by_slot: dict[int, list[manifest.Manifest]] = {}
        for snap in self._snapshots.snapshots():  # newest (highest generation) first, never by the wall clock
            by_slot.setdefault(snap.slot, []).append(snap)
        started = time.perf_counter()
        checked = 0
        good: list[manifest.Manifest] = []
        for _, newest_first in sorted(by_slot.items()):
            for candidate in newest_first:
                checked += 1
                if await self._check(candidate):
                    good.append(candidate)
                    break
        if checked:
            log.info("snapshots_prechecked", files=checked, seconds=round(time.perf_counter() - started, 4))
        if rebuild and self._snapshots.blocks is not None:
            await self._ahead.build(good)

    @property
    def ahead(self) -> bool:
        """Whether files rebuilt ahead wait for a restore round (give them back with :meth:`drop_ahead`)."""
        return self._ahead.pending

    async def drop_ahead(self) -> None:
        """Delete the files rebuilt ahead that no restore took (no restore round came)."""
        await self._ahead.discard()

    async def restore_all(
        self,
        identity: events.Identity,
        *,
        healthy_at: float | None,
        counters: events.Counters | None,
        order: Order | None = None,
    ) -> dict[int, manifest.Manifest] | None:
        """One restore round into every idle, empty slot; returns the manifest restored into each slot.

        ``order``: what goes next and where, and who is told of each restore as it lands (else each slot's
        own snapshots in slot order, told of none). None if the round could not start (/slots unreadable):
        try again at the next poll.
        """
        done: dict[int, manifest.Manifest] = {}
        records: list[RestoreRecord] = []
        async with self._actions.lock:
            listed_at = time.perf_counter()
            try:
                listing = await self._actions.slots()
            except errors.UpstreamError as exc:
                log.warning("restore_round_postponed", error=str(exc), effect="tried again at the next poll")
                return None
            acted = self._acted
            pending = {view.id: view for view in listing}
            while pending:
                slots = tuple(pending)
                step = (
                    await order.next_step(slots)
                    if order is not None
                    else restoreplan.plan(slots, (), self._snapshots.snapshots())[0]
                )
                view = pending.pop(step.slot)
                fresh = (view, listed_at) if self._acted == acted else None  # nothing has run since the listing
                record, restored = await self._restore_slot(step, fresh, identity, healthy_at, counters)
                records.append(record)
                if restored is not None:
                    done[view.id] = restored
                    if order is not None:
                        order.restored(view.id, restored)
            await self._ahead.discard()  # a newer snapshot won, or the slot was not empty
        self._checked.clear()
        self.last = sorted(records, key=lambda record: record.slot)
        return done

    async def swap_in(
        self, slot: int, candidate: manifest.Manifest, *, counters: events.Counters | None, checked: bool = False
    ) -> tuple[RestoreRecord, events.SlotView | None]:
        """Restore ``candidate`` into ``slot``, replacing what it holds (its owner saved it first).

        For the library's swaps and the shared store's fetches: the snapshot
        must fit the running server (:func:`manifest.incompatibilities`, the
        check of a restore round: weights, adapters, build, slot count, the
        slot's context) and pass its size and checksum check; the slot is
        read right before the call and never restored into while it is
        processing, and read again after it to catch a racing request, as in a
        restore round. Returns the record and the slot as read after a
        successful restore. ``checked``: the caller committed ``candidate``
        just now (a fetch from the shared store, hashed as it was downloaded
        and again by its commit): it is not hashed a third time.
        """
        async with self._actions.lock:
            if not checked and not await self._check(candidate):
                return self._count(slot, Outcome.FAILED, "the snapshot failed its check", candidate.file), None
            started = time.perf_counter()
            view, problem = await self._read(slot)
            if view is None:
                return self._count(slot, Outcome.FAILED, problem), None
            refusal = self.refusal(candidate, n_ctx=view.n_ctx)
            if refusal:
                log.warning(
                    "snapshot_incompatible",
                    slot=slot,
                    file=candidate.file,
                    differences=refusal,
                    effect="not restored: the request runs without it, prefilled by llama-server",
                    hint="a snapshot of another model, adapters, build or slot count reached this node "
                    "(copied into the slot dir or the shared store); remove it if it keeps coming back",
                )
                return self._count(slot, Outcome.INCOMPATIBLE, refusal, candidate.file), None
            if view.processing:
                return self._count(slot, Outcome.SLOT_BUSY, "the slot is processing a request"), None
            staged, rebuilt = await self._stage(candidate)
            if staged is None:
                return self._count(slot, Outcome.FAILED, "the snapshot failed its check", candidate.file), None
            try:
                if rebuilt:  # rebuilt from the block store: time has passed, read it again
                    view, problem = await self._read(slot)
                    if view is None:
                        return self._count(slot, Outcome.FAILED, problem), None
                    if view.processing:
                        return self._count(slot, Outcome.SLOT_BUSY, "the slot is processing a request"), None
                record, restored = await self._send(
                    slot, view, candidate, None, counters, started, by=outcomes.SavedBy.SWAP, filename=staged
                )
            finally:
                self._give_back(staged, candidate)
            if restored is None:
                return record, None
            after, _ = await self._read(slot)
            return record, after

    def refusal(self, candidate: manifest.Manifest, *, n_ctx: int) -> str:
        """Why ``candidate`` cannot go into a slot of ``n_ctx`` on the running server; "" if it can.

        The one compatibility check of every road into a slot (restart restore,
        admin restore, library swap, shared-store fetch): the same function the
        restore round's plan applies.
        """
        identity = self._identity()
        if identity is None:
            return "the server's identity (/props) is not read yet: nothing can be matched against it"
        return "; ".join(manifest.incompatibilities(candidate, identity, slot_n_ctx=n_ctx))

    async def _restore_slot(
        self,
        step: restoreplan.Step,
        fresh: tuple[events.SlotView, float] | None,
        identity: events.Identity,
        healthy_at: float | None,
        counters: events.Counters | None,
    ) -> tuple[RestoreRecord, manifest.Manifest | None]:
        """Restore ``step``; ``fresh``: a view of its slot and when its read began, nothing run since (else None)."""
        slot = step.slot
        view: events.SlotView | None
        if fresh is not None:
            (view, started), problem = fresh, ""
        else:
            started = time.perf_counter()
            view, problem = await self._read(slot)
        if view is None:
            return self._count(slot, Outcome.FAILED, problem), None
        plan = policy.plan_restore(view, step.candidates, identity, in_order=True)
        for file, why in plan.refusals:
            log.warning("snapshot_incompatible", slot=slot, file=file, differences=why)
        if plan.outcome is not None:
            return self._count(slot, plan.outcome, _DETAILS.get(plan.outcome, "")), None
        for candidate in plan.candidates:
            staged, rebuilt = await self._stage(candidate)  # rebuilt and checked (maybe ahead), or the file itself
            if staged is None:
                continue
            try:
                if rebuilt or (staged == candidate.file and not self._checked_unchanged(candidate)):
                    # Not checked ahead: hash it now (a rebuild was), then read the slot again, as time has passed.
                    if staged == candidate.file and not await self._check(candidate):
                        continue
                    view, problem = await self._read(slot)
                    if view is None:
                        return self._count(slot, Outcome.FAILED, problem), None
                    if view.processing or not view.empty:
                        return self._count(slot, Outcome.SLOT_BUSY, _DETAILS[Outcome.SLOT_BUSY]), None
                return await self._send(slot, view, candidate, healthy_at, counters, started, filename=staged)
            finally:
                self._give_back(staged, candidate)
        return self._count(slot, Outcome.FAILED, "every snapshot planned for this slot failed its check"), None

    async def _send(
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
    ) -> tuple[RestoreRecord, manifest.Manifest | None]:
        """The restore call itself, right after ``before`` was read; then look for a racing request.

        ``path_started``: when the slot's restore began (its first read), for the log's ``path_seconds``.
        ``filename``: what the server reads, the snapshot's file or its staged rebuild (see :meth:`_stage`).
        """
        started = time.perf_counter()
        self._acted += 1
        try:
            result = await self._actions.restore(slot, filename)
        except errors.UpstreamError as exc:
            return self._refused(slot, candidate, exc), None
        seconds = time.perf_counter() - started
        path_seconds = time.perf_counter() - path_started
        after, _ = await self._read(slot)
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
        done = Done(next(self._serials), by, slot, candidate.file, result.tokens, seconds, self._clock.wall())
        return self._to_verify(done, task, counters, since), candidate

    def _refused(self, slot: int, candidate: manifest.Manifest, exc: errors.UpstreamError) -> RestoreRecord:
        log.error(
            "restore_failed",
            slot=slot,
            file=candidate.file,
            error=str(exc),
            hint="the server refused a file that passed its checksum: check that llama-server "
            "runs with the same KV settings (--swa-full, cache types) as when it was saved",
        )
        return self._count(slot, Outcome.FAILED, str(exc), candidate.file)

    def _raced(self, slot: int, candidate: manifest.Manifest) -> RestoreRecord:
        log.warning(
            "restore_raced",
            slot=slot,
            file=candidate.file,
            effect="a request ran on the slot while the restore call was in flight; the server ran the "
            "restore after it, replacing that request's KV with the snapshot",
            hint="its answer is not affected; its next turn re-prefills what it does not share with the snapshot",
        )
        return self._count(slot, Outcome.RACED, "a request took the slot during the restore", candidate.file)

    def _incomplete(self, slot: int, candidate: manifest.Manifest, tokens: int) -> RestoreRecord:
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
        return self._count(slot, Outcome.FAILED, detail, candidate.file)

    def _to_verify(
        self, done: Done, task: int | None, counters: events.Counters | None, since: float | None
    ) -> RestoreRecord:
        """Keep a restore that put ``done.tokens`` back until the slot's next task (after ``task``) judges it.

        Counted ok now; on a sliding-window model counted only once that task shows whether the server reused it.
        """
        identity = self._identity()
        sliding = identity is not None and identity.memory is events.Memory.SWA
        self.recent.append(done)
        self.unverified[done.slot] = Unverified(
            tokens=done.tokens,
            cached_before=counters.cached_tokens if counters else None,
            task=task,
            at=self._clock.monotonic(),
            by=done.by,
            serial=done.serial,
            uncounted=sliding,
        )
        if not sliding:
            return self._count(done.slot, Outcome.OK, "", done.file, done.tokens, done.seconds, since)
        log.info(
            "restore_unverified",
            slot=done.slot,
            file=done.file,
            reason="the model uses sliding-window attention, and llama-server does not say whether it runs "
            "with --swa-full (without it a restore succeeds and is not reused)",
            effect="shown as unverified in /status; counted in restores_total once the slot's next request "
            "shows whether the server reused it (ok) or not (ineffective)",
        )
        detail = "waiting for the slot's next request to show whether the server reuses it"
        return RestoreRecord(
            done.slot, Outcome.UNVERIFIED, detail, self._clock.wall(), done.file, done.tokens, done.seconds, since
        )

    async def _read(self, slot: int) -> tuple[events.SlotView | None, str]:
        try:
            view = await self._actions.view(slot)
        except errors.UpstreamError as exc:
            return None, f"cannot read /slots: {exc}"
        return view, "" if view is not None else "slot vanished from /slots"

    async def _stage(self, candidate: manifest.Manifest) -> tuple[str | None, bool]:
        """The name the server restores ``candidate`` from, and whether it was rebuilt now (time has passed);
        None if it cannot be rebuilt (logged, and quarantined on proof of bad content: a missing or corrupt
        block refuses that snapshot only).

        Without a block store that is the snapshot's own file. With one, its file rebuilt ahead while the
        server loaded (:mod:`sidecar.act.ahead`), or else rebuilt now into the slot dir under a fresh name,
        checked against its checksum either way; the caller gives it back with :meth:`_give_back`.
        """
        if self._snapshots.blocks is None:
            return candidate.file, False
        ready = self._ahead.take(candidate)
        if ready is not None:
            return ready, False
        self._acted += 1
        try:
            return await asyncio.to_thread(self._snapshots.stage, candidate), True
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
            await asyncio.to_thread(self._snapshots.quarantine, candidate.file, exc.reason, detail=str(exc))
            return None, False

    def _give_back(self, staged: str, candidate: manifest.Manifest) -> None:
        """Delete what :meth:`_stage` staged, off the restore's path: freeing a large file takes a while (a
        quarter of a second for 300 MB on tmpfs, on a busy machine), and the next slot or request waits."""
        if staged == candidate.file:
            return
        task = tasks.watch(
            asyncio.create_task(asyncio.to_thread(self._snapshots.unstage, staged, candidate), name="give-back"),
            effect="a staged rebuild stays in the slot dir until the sidecar's next start-up",
        )
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def _check(self, candidate: manifest.Manifest) -> bool:
        """Whether ``candidate`` passes its size and checksum check (cached while the file is unchanged)."""
        if self._checked_unchanged(candidate):
            return True
        try:
            return await self._hash_check(candidate)
        finally:
            self.checking = None
            self.checked_at = self._clock.monotonic()

    async def _hash_check(self, candidate: manifest.Manifest) -> bool:
        self._acted += 1
        self.checking = Check(candidate.file, self._clock.monotonic() + hashing.deadline_for(candidate.bytes))
        try:
            await asyncio.to_thread(self._snapshots.check, candidate)
            stamp = await asyncio.to_thread(self._stamp, candidate.file)
        except errors.SnapshotError as exc:
            if exc.reason not in outcomes.BAD_CONTENT:  # unreadable now, not proven bad: keep it
                log.warning("snapshot_unreadable", slot=candidate.slot, file=candidate.file, error=str(exc))
                return False
            log.error("snapshot_corrupt", slot=candidate.slot, file=candidate.file, reason=exc.reason, error=str(exc))
            await asyncio.to_thread(self._snapshots.quarantine, candidate.file, exc.reason, detail=str(exc))
            self._checked.pop(candidate.file, None)
            return False
        if stamp is not None:
            self._checked[candidate.file] = stamp
        return True

    def _checked_unchanged(self, candidate: manifest.Manifest) -> bool:
        stamp = self._checked.get(candidate.file)
        return stamp is not None and stamp == self._stamp(candidate.file)

    def _stamp(self, file: str) -> _Stamp | None:
        try:
            st = os.lstat(self._snapshots.dir / file)  # a file swapped for a link is a new file
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino

    def observe(self, obs: events.Observation, identity: events.Identity | None) -> None:
        """Follow the server's measured prefill rate (fresh counters only); price what waited for it."""
        for priced in self.savings.observe(obs.counters if obs.counters_fresh else None, identity):
            self._saved(priced)

    def _saved(self, priced: savings.Priced) -> None:
        self._stats.prefill_saved_seconds.labels(priced.by.value).inc(priced.seconds)
        self._stats.prefill_saved_tokens.labels(priced.by.value).inc(priced.tokens)

    def answered(self, slot: int, reused: int) -> None:
        """The slot's next task reused ``reused`` prompt tokens, as its own answer says: judge its restore."""
        pending = self.unverified.pop(slot, None)
        if pending is not None:
            self._verdict(slot, pending, reused)

    def judge(self, obs: events.Observation) -> None:
        """Judge the unverified restores whose slot has run a task that started after the restore."""
        tasks = {view.id: view.task for view in obs.slots or ()}
        if obs.identity is not None:
            self._memory = obs.identity.memory
        for view in obs.slots or ():
            pending = self.unverified.get(view.id)
            if pending is None or view.task is None or view.processing or obs.at <= pending.at:
                continue
            others = tuple(sorted((slot, task) for slot, task in tasks.items() if slot != view.id))
            if pending.others is None:
                pending = self.unverified[view.id] = dataclasses.replace(pending, others=others)
            if pending.task is not None and view.task <= pending.task:
                continue  # no task since the restore
            counters = obs.counters if obs.counters_fresh else None
            if counters is None and obs.counters is not None:
                continue  # counters carried over from an earlier poll: wait for fresh ones
            del self.unverified[view.id]
            if counters is None or pending.cached_before is None:
                self._decided(view.id, pending, Outcome.UNVERIFIED)
                if not self._verification_off_said:
                    log.warning(
                        "restore_verification_off",
                        reason="llama-server's /metrics is not readable",
                        hint="start llama-server with --metrics to check that restores save prefill",
                    )
                    self._verification_off_said = True
                continue
            if pending.others != others:
                self._stats.restore_verifications.labels(outcomes.Verification.UNVERIFIED.value).inc()
                self._decided(view.id, pending, Outcome.UNVERIFIED)
                log.info(
                    "restore_unverified",
                    slot=view.id,
                    restored_tokens=pending.tokens,
                    reason="other slots ran tasks too: the server-wide reuse counter mixes their reuse with this "
                    "slot's",
                    hint="send requests through the proxy (--proxy-listen): each answer's own reuse figure judges it",
                )
                continue
            self._verdict(view.id, pending, counters.cached_tokens - pending.cached_before)

    def _verdict(self, slot: int, pending: Unverified, reused: float) -> None:
        effective = reused >= EFFECTIVE_SHARE * pending.tokens
        priced = self._judged(pending, reused) if effective else None
        self._note(pending.serial, effective, reused, priced)
        self._decided(slot, pending, Outcome.OK if effective else Outcome.INEFFECTIVE)
        if effective:
            self._stats.restore_verifications.labels(outcomes.Verification.EFFECTIVE.value).inc()
            log.info(
                "restore_effective",
                slot=slot,
                by=pending.by.value,
                restored_tokens=pending.tokens,
                reused_tokens=reused,
                saved_seconds=round(priced.seconds, 3) if priced is not None else None,
            )
            return
        self._stats.restore_verifications.labels(outcomes.Verification.INEFFECTIVE.value).inc()
        log.warning(
            "restore_ineffective",
            slot=slot,
            restored_tokens=pending.tokens,
            reused_tokens=reused,
            memory=self._memory.value if self._memory is not None else events.Memory.UNKNOWN.value,
            hint=ineffective_hint(self._memory),
        )

    def forget_pending(self) -> None:
        """The restored slots are gone (a restart, a wake-up): count the restores nothing decided."""
        for slot, pending in sorted(self.unverified.items()):
            self._decided(slot, pending, Outcome.UNVERIFIED)
        self.unverified.clear()

    def _decided(self, slot: int, pending: Unverified, outcome: outcomes.RestoreOutcome) -> None:
        """Count a restore that waited for its verdict (``pending.uncounted``), and show it in /status."""
        if not pending.uncounted:
            return
        self._stats.restores.labels(str(slot), outcome.value).inc()
        self._stats.count_model(self._stats.model_restores, outcome.value)
        self.last = [
            dataclasses.replace(r, result=outcome, detail=_VERDICTS[outcome])
            if r.slot == slot and r.result is Outcome.UNVERIFIED
            else r
            for r in self.last
        ]

    def _judged(self, pending: Unverified, reused: float) -> savings.Priced | None:
        """Count the prefill an effective restore spared; None while no rate prices it."""
        priced = self.savings.reused(pending.by, savings.saved_tokens(restored=pending.tokens, reused=reused))
        if priced is not None:
            self._saved(priced)
        return priced

    def _note(self, serial: int, effective: bool, reused: float, priced: savings.Priced | None) -> None:
        verdict = outcomes.Verification.EFFECTIVE if effective else outcomes.Verification.INEFFECTIVE
        for i, done in enumerate(self.recent):
            if done.serial == serial:
                self.recent[i] = dataclasses.replace(
                    done,
                    verdict=verdict,
                    reused_tokens=max(0, int(reused)),
                    saved_seconds=priced.seconds if priced is not None else None,
                )
                return

    def _count(
        self,
        slot: int,
        outcome: outcomes.RestoreOutcome,
        detail: str,
        file: str | None = None,
        tokens: int = 0,
        seconds: float = 0.0,
        since: float | None = None,
    ) -> RestoreRecord:
        self._stats.restores.labels(str(slot), outcome.value).inc()
        self._stats.count_model(self._stats.model_restores, outcome.value)
        if outcome not in (Outcome.OK, Outcome.RACED):
            log.info(
                "restore_skipped" if outcome is not Outcome.FAILED else "restore_not_done",
                slot=slot,
                result=outcome.value,
                reason=detail,
            )
        return RestoreRecord(slot, outcome, detail, self._clock.wall(), file, tokens, seconds, since)


def ineffective_hint(kind: events.Memory | None) -> str:
    """What to do about a restore the server did not reuse, by the model's memory kind. Pure."""
    if kind in (events.Memory.RECURRENT, events.Memory.HYBRID):
        return (
            "the model's state cannot be cut back (recurrent or hybrid layers; --swa-full changes nothing on it): "
            "a restored snapshot serves only a request that holds every one of its tokens, and the next request "
            "diverged before the snapshot's end (a regenerate, an edited history, another conversation)"
        )
    if kind is events.Memory.SWA:
        return (
            "the server re-prefilled instead of reusing the restored KV: this sliding-window model needs "
            "llama-server started with --swa-full for a restore to be reused (unless the next request was "
            "a different conversation)"
        )
    return (
        "the server re-prefilled instead of reusing the restored KV: the next request shared few tokens with "
        "the snapshot (a different conversation); on a sliding-window model (Gemma 3, gpt-oss, ...) start "
        "llama-server with --swa-full"
    )
