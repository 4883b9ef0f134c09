"""What the sidecar does with each observation: log, count, restore, save.

The :class:`Engine` is the consumer of the poller and the only holder of
the state of the current server process (its identity, the slots restored
into it, whether its slot dir link has been proven). It is split in two so
that a slot action never stops the sidecar from watching:

* :meth:`Engine.handle` runs in the poll loop for every observation: it
  logs and counts transitions, feeds the pure policy, judges restores, and
  wakes the action runner. It never waits for the server.
* :meth:`Engine.run` is the action runner, a task of its own: it checks
  snapshot files while the server loads, then runs the restore round, the
  slot-dir probe and the saves that are due, one action at a time, each
  right after reading its slot (see :mod:`sidecar.act.actions`). A save the
  server holds behind a busy slot then delays other actions, never the polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from sidecar.act import (
    actions,
    boundary,
    gate,
    lifecycle,
    memory,
    policy,
    probe,
    report,
    restoreplan,
    restorer,
    savings,
    snapshotter,
)
from sidecar.core import apikeys, config, errors, events, hashing, metrics, outcomes, protocols, redact
from sidecar.observe import upstream
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.engine")
AGE_CHECK_EVERY = 30.0
"""Seconds between --max-age checks while no save runs retention (at most a quarter of --max-age)."""
RETRY_AFTER = 30.0
"""Seconds before a slot whose save failed, or was skipped for lack of disk, is tried again."""
Cause = outcomes.SaveCause
ASLEEP = "llama-server is asleep (--sleep-idle-seconds): a save would wake it"


class SlotContent(Protocol):
    """Told what the slots hold when the engine changes it (the library's routing listens)."""

    def emptied(self) -> None:
        """The server lost every slot's KV (a restart or a wake-up)."""

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """The restore round put ``record`` into ``slot``."""

    def owner(self, slot: int) -> str | None:
        """Whose conversation ``slot`` holds (``apikeys.owner_of``), recorded in its next snapshot; None: unknown."""


BeforeRestore = Callable[[events.Identity, tuple[events.SlotView, ...]], Awaitable[object]]
"""Awaited with the server's identity and slots at the start of each restore round."""


class Engine:
    def __init__(
        self,
        *,
        client: protocols.Upstream,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.Settings,
        clock: protocols.Clock | None = None,
        restore_gate: gate.Gate | None = None,
        before_restore: BeforeRestore | None = None,
        prompts: boundary.Prompts | None = None,
    ) -> None:
        """``before_restore`` is awaited at the start of each restore round (the shared store fetches
        snapshots for the empty slots then)."""
        s = settings.snapshots
        self._prompts = prompts
        """How the engine brings a slot back to its prompt's boundary (None: it saves slots as they are)."""
        self._marker: list[int] | None = None
        self._marker_read = False
        self._client = client
        self._snapshots = snapshots
        self._stats = stats
        self._clock = clock or protocols.SystemClock()
        self._down_interval = settings.poll.down_interval
        self._max_age = s.max_age
        self._next_age_check = 0.0
        self._actions = actions.SlotActions(client=client, snapshots=snapshots)
        self._read_fresh: Callable[[], Awaitable[tuple[events.SlotView, ...]]] = self._actions.slots
        """How :meth:`fresh_slots` reads the slots (:meth:`read_fresh_by` puts it on the request path's client)."""
        self._policy = policy.Policy(s)
        self._saver = snapshotter.Snapshotter(
            slot_actions=self._actions,
            snapshots=snapshots,
            stats=stats,
            settings=s,
            clock=self._clock,
            committed_later=self._committed_later,
        )
        self._restorer = restorer.Restorer(
            slot_actions=self._actions,
            snapshots=snapshots,
            stats=stats,
            clock=self._clock,
            identity=lambda: self._identity,
        )
        self._latest: events.Observation | None = None
        self._identity: events.Identity | None = None
        self._server = memory.ServerMemory()
        """What the engine knows of the server process it watches now (renewed in :meth:`_slots_emptied`)."""
        self._slot_count = 0
        self._held: dict[int, events.SlotContent] = {}
        """The content of each slot whose save was last held (logged once per content)."""
        self._wake = asyncio.Event()
        self._handled_at = self._clock.monotonic()
        self._working_since: float | None = None
        """When the action runner's current pass began; None between passes."""
        self._gate = restore_gate or gate.Gate(clock=self._clock)
        """Closed while the server is down or loading and while a restore round is owed or running."""
        self._listeners: list[SlotContent] = []
        self._before_restore = before_restore

    def status(self) -> report.Status:
        """What the engine knows now, for the HTTP layer."""
        latest = self._latest
        return report.Status(
            server_url=redact.url(self._client.url),
            observation=latest,
            identity=self._identity,
            link_ok=self._server.link.ok,
            link_problem=self._server.link.problem,
            last_snapshot=self._saver.last,
            last_restore=tuple(self._restorer.last),
            # The older of the two: the last poll handled, and the start of the action runner's
            # current pass or the end of its last file check (a hung disk or call stops the runner,
            # not the polls).
            progress_at=min(self._handled_at, self._runner_progress() or self._handled_at),
            acting=self._working_since is not None or self.acting(),
            restore_gate=self._gate.life.closed_because,
            saved=self._restorer.savings.totals(),
            recent=tuple(self._restorer.recent),
            slot_since=self._slot_since(),
            check=self._restorer.checking,
            low_disk=self._saver.low_disk,
        )

    def _slot_since(self) -> tuple[tuple[int, float], ...]:
        """When each slot's content last changed, in Unix time (the policy keeps monotonic time)."""
        offset = self._clock.wall() - self._clock.monotonic()
        return tuple((slot, track.changed_at + offset) for slot, track in sorted(self._policy.tracks.items()))

    def seen(self) -> tuple[events.Observation | None, events.Identity | None]:
        """The newest observation handled, and the newest identity the server gave (None before the first)."""
        return self._latest, self._identity

    def unsaved(self, slot: int) -> bool:
        """Whether ``slot`` holds content, as polled, that no snapshot of the engine holds."""
        track = self._policy.tracks.get(slot)
        return track is not None and track.signature is not None and track.signature != track.settled

    def worth_saving(self, tokens: int) -> bool:
        """Whether a slot holding ``tokens`` is worth a snapshot (at least ``--min-tokens``)."""
        return tokens >= self._policy.settings.min_tokens

    async def swap_in(
        self, slot: int, record: manifest.Manifest, *, counters: events.Counters | None, checked: bool = False
    ) -> restorer.RestoreRecord:
        """Restore ``record`` into ``slot`` for a request, replacing what it holds (the caller saved that first).

        The slot then holds a snapshot's content: the engine takes it as saved. ``checked``: the caller
        committed ``record`` just now (see ``Restorer.swap_in``).
        """
        result, after = await self._restorer.swap_in(slot, record, counters=counters, checked=checked)
        if result.restored and after is not None and after.signature is not None:
            self._policy.settle(slot, after.signature)
        return result

    async def erase(self, slot: int) -> bool:
        """Empty ``slot`` for a request of another owner (the caller saved what it holds first, if it mattered).

        False, and nothing sent, if the slot is processing now; False if the call failed.
        """
        async with self._actions.lock:
            try:
                view = await self._actions.view(slot)
                if view is None or view.processing:
                    return False
                if view.signature is None or view.tokens == 0:
                    return True
                erased = await self._actions.erase(slot)
            except errors.UpstreamError as exc:
                log.warning(
                    "slot_erase_failed",
                    slot=slot,
                    error=str(exc),
                    effect="the request goes on, with what the slot holds: llama-server may pick that slot",
                )
                return False
        log.info("slot_erased", slot=slot, tokens=erased, reason="another owner's request, llama-server picks its slot")
        return True

    def answered(self, slot: int, reused: int) -> None:
        """A routed request's own answer says the server reused ``reused`` prompt tokens in ``slot``.

        That is the slot's next task: it judges the restore or swap that put tokens there, if one waits.
        """
        self._restorer.answered(slot, reused)

    def follow(self, listener: SlotContent) -> None:
        """Tell ``listener`` each time the engine changes what the slots hold (a restart, a restore round)."""
        self._listeners.append(listener)

    def _owner(self, slot: int) -> str:
        """Whose conversation ``slot`` holds, as the listeners know it; ``apikeys.NOBODY`` if none knows."""
        return next(
            (o for o in (listener.owner(slot) for listener in self._listeners) if o is not None), apikeys.NOBODY
        )

    async def save_now(self, slot: int) -> report.SaveReply | None:
        """An admin's save of ``slot``; None when the newest poll shows no such slot holding tokens."""
        view = self._latest.slot(slot) if self._latest is not None else None
        if view is None or view.signature is None:
            return None
        ok = await self.save(policy.Save(view.id, view.signature, view.tokens, policy.SaveReason.MANUAL))
        return report.SaveReply(ok, self._saver.last)

    def read_fresh_by(self, read: Callable[[], Awaitable[tuple[events.SlotView, ...]]]) -> None:
        """Have :meth:`fresh_slots` read the slots with ``read`` (the proxy's client), not the poller's."""
        self._read_fresh = read

    async def fresh_slots(self) -> tuple[events.SlotView, ...]:
        """Every slot as the server shows it now, not as the last poll saw it; the policy follows it.

        A turn that ended since that poll (sent straight to llama-server, or
        through the proxy unrouted) then counts as unsaved, whatever route it
        came by. Raises ``errors.UpstreamError``.
        """
        read_at = self._clock.monotonic()
        fresh = await self._read_fresh()
        if self._identity is not None:  # the request path's reader does not know what /props announced
            upstream.announced(fresh, self._identity.total_slots)
        self._policy.observe(fresh, self._clock.monotonic(), read_at=read_at)
        self._export_unsaved()
        return fresh

    def restore_owed(self) -> bool:
        """Whether a restore round is owed or running: requests that reach the server now may race it."""
        return self._gate.life.restore_owed

    def acting(self) -> bool:
        """Whether a slot action (save, restore, probe) is in flight or about to be sent."""
        return self._actions.lock.locked()

    # ---- the poll loop's side: never waits for the server ------------------------------

    async def handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        try:
            await self._handle(obs, evts)
        finally:
            self._handled_at = self._clock.monotonic()  # the loop made progress: see report.Liveness

    async def _handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        if self._latest is None or obs.health is not self._latest.health:
            self._say_state(obs)
        self._stats.server_readable.set(0 if obs.denied else 1)
        if obs.health is not events.Health.OK:
            self._gate.see(lifecycle.Unhealthy(obs.health))
        for event in evts:
            self._on_event(event)
        self._latest = obs
        if obs.identity is not None:
            kind = obs.identity.memory
            if kind is not None and (self._identity is None or self._identity.memory != kind):
                self._stats.memory_is(kind)
            self._identity = obs.identity
        if not self._ready(obs):
            if (obs.health is not events.Health.OK and not self._server.prechecked) or self._saver.pending:
                self._wake.set()  # check the files the restore round will need; commit the saves that wait
            elif obs.health is events.Health.OK:
                self._gate.see(lifecycle.Up(obs.at, ready=False))  # up, but nothing the sidecar can restore now
            return
        assert obs.slots is not None
        if len(obs.slots) != self._slot_count:
            self._slot_count = len(obs.slots)
            self._stats.init_slots(range(self._slot_count))
        if not self._server.adopted:
            self._server.adopted = True
            self._adopt_existing(obs.slots)
        self._policy.observe(obs.slots, obs.at, read_at=obs.slots_at)
        self._restorer.observe(obs, self._identity)
        self._export_unsaved()
        if self._restorer.unverified:
            self._restorer.judge(obs)
        self._gate.see(lifecycle.Up(obs.at, ready=True))  # opens unless a round is owed (the runner opens it then)
        self._wake.set()

    def _export_unsaved(self) -> None:
        """Each slot's oldest unsaved change as Unix time (0: none), from the policy's monotonic one."""
        now_mono, now_wall = self._clock.monotonic(), self._clock.wall()
        for slot in range(self._slot_count):
            since = self._policy.unsaved_since(slot)
            self._stats.unsaved_since.labels(str(slot)).set(0 if since is None else now_wall - (now_mono - since))

    def _ready(self, obs: events.Observation) -> bool:
        """Whether slot actions may be sent: up, slots and identity read, awake (an action would wake it)."""
        return (
            obs.health is events.Health.OK and obs.slots is not None and self._identity is not None and not obs.sleeping
        )

    def _on_event(self, event: events.Event) -> None:
        kind = event.transition
        if kind is events.Transition.CAME_UP:
            self._stats.server_up.set(1)
            self._server.healthy_at = event.at
        elif kind is events.Transition.WENT_DOWN:
            self._stats.server_up.set(0)
            self._server.prechecked = False  # it may come back as a new process: have the files checked by then
        elif kind is events.Transition.RESTARTED:
            self._stats.server_restarts.inc()
            log.warning("server_restarted", reasons=list(event.reasons))
            self._slots_emptied(event.at, new_process=True)
        elif kind is events.Transition.SLEPT:
            log.info(
                "server_sleeping",
                effect="llama-server unloaded the model and the KV (--sleep-idle-seconds); the sidecar "
                "leaves it asleep and restores idle slots once a request wakes it",
            )
        elif kind is events.Transition.WOKE:
            log.info("server_woke", effect="its slots start empty: restoring the idle ones")
            self._slots_emptied(event.at, new_process=False)
        elif kind is events.Transition.BECAME_BUSY:
            log.debug("slot_busy", slot=event.slot)
        elif kind is events.Transition.BECAME_IDLE:
            log.debug("slot_idle", slot=event.slot, changed=event.changed)

    def _slots_emptied(self, at: float, *, new_process: bool) -> None:
        """The server lost every slot's KV (a new process, or a wake-up): start over and restore.

        ``at`` is the poll that first saw the server healthy again, where the
        restart-to-restore latency starts. The one place the server's memory is renewed.
        """
        self._policy.reset()
        self._server = self._server.renewed(at=at, new_process=new_process)
        for listener in self._listeners:
            listener.emptied()
        self._restorer.forget_pending()
        self._gate.see(lifecycle.Emptied())

    def _say_state(self, obs: events.Observation) -> None:
        """Log the server's state once per change, not on every poll."""
        if obs.health is events.Health.OK:
            log.info("server_up", server=self._client.url)
        elif obs.health is events.Health.LOADING:
            log.info("server_loading", server=self._client.url, problem=obs.problem)
        elif obs.health is events.Health.UNLOADED:
            log.info(
                "model_unloaded",
                problem=obs.problem,
                effect="its snapshots stay on disk; they are restored when the router loads the model again",
            )
        else:
            log.warning(
                "server_unreachable",
                server=self._client.url,
                problem=obs.problem,
                effect=f"no snapshots or restores until it answers; retrying every {self._down_interval} s",
                hint="check --server / LLAMA_SIDECAR_SERVER and that llama-server is running",
            )

    def _adopt_existing(self, slots: tuple[events.SlotView, ...]) -> None:
        """At start-up, treat slots whose content matches their newest snapshot as saved."""
        for view in slots:
            newest = next(iter(self._snapshots.snapshots(view.id)), None)
            if newest is None or view.task is None:
                continue
            if newest.task == view.task and newest.tokens == view.tokens:
                self._policy.settle(view.id, view.signature)
                log.info("slot_already_saved", slot=view.id, file=newest.file)

    # ---- the action runner ------------------------------------------------------------------

    def _runner_progress(self) -> float | None:
        if self._working_since is None:
            return None
        return max(self._working_since, self._restorer.checked_at)

    async def run(self) -> None:
        """The action runner: check files first, then act whenever an observation asks for it."""
        self._working_since = self._clock.monotonic()
        try:
            await self._precheck()
        finally:
            self._working_since = None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._working_since = self._clock.monotonic()
            try:
                await self.work()
            finally:
                self._working_since = None

    async def work(self) -> None:
        """Run what the newest observation makes due: file checks, the restore round, the probe, saves."""
        obs = self._latest
        if obs is None or obs.health is not events.Health.OK:
            await self._commit_written(quiet=True)  # nothing generates: the restore round will want them
            if obs is not None and obs.health is events.Health.UNLOADED and self._restorer.ahead:
                await self._restorer.drop_ahead()  # router mode: no server runs the model, none loads it (yet)
            if not self._server.prechecked:
                await self._precheck()
            return
        if not self._ready(obs):
            await self._commit_written(quiet=obs.sleeping or not self._processing(obs.slots or (), obs.counters))
            return
        if self._gate.life.round is lifecycle.Round.OWED:
            await self._commit_written(quiet=True)  # the newest snapshots are restored, not those before
            self._gate.see(lifecycle.RoundStarted())
            answered = True
            try:
                answered = await self._restore(obs)
            finally:
                self._gate.see(lifecycle.RoundEnded(answered))  # stays owed if the server lost its slots meanwhile
            self._gate.see(lifecycle.Up(obs.at, ready=True))  # the poll the round started from: open once done
        if self._restorer.ahead and not self.restore_owed():
            await self._restorer.drop_ahead()  # the server came back without a restore round, or it had none
        if self._server.link.ok is None:
            await self._probe()
        await self._expire()
        for action in self._policy.due(self._clock.monotonic()):
            if self.restore_owed() or self._latest is None or not self._ready(self._latest):
                return  # the server restarted, slept or went away meanwhile
            if isinstance(action, policy.Skip):
                self._saver.skip(action)
                self._policy.settle(action.slot, action.signature)
            elif not self._hold(action, self._latest.slots or (), self._latest.counters):
                await self.save(action)
        latest = self._latest
        if latest is not None:
            await self._commit_written(quiet=not self._processing(latest.slots or (), latest.counters))

    async def _commit_written(self, *, quiet: bool) -> None:
        """Commit the saves whose commit waits (see :mod:`sidecar.act.snapshotter`) once due.

        ``quiet``: no slot is processing: commit them all now. Otherwise commit
        only those that have waited ``snapshotter.COMMIT_WAIT``, paced.
        """
        before = self._saver.commit_due(quiet=quiet)
        if before is None:
            return
        async with self._actions.lock:
            await self._saver.commit_pending(pause=0.0 if quiet else hashing.PACE, written_before=before)

    def _committed_later(self, written: snapshotter.Written, record: snapshotter.SaveRecord) -> None:
        """A save whose commit waited: it was taken as saved; if the commit failed, the slot is due again."""
        if written.epoch != self._server.epoch:
            return  # a save of an earlier server process: its slots are gone
        if record.cause is None:
            self._set_link(probe.Link(True))
        else:
            self._policy.unsettle(written.action.slot, written.action.signature, self._clock.monotonic())
            self._saved(written.action, record)

    async def _expire(self) -> None:
        """Apply --max-age on an idle server too: retention otherwise runs only after a commit."""
        now = self._clock.monotonic()
        if self._max_age <= 0 or now < self._next_age_check:
            return
        self._next_age_check = now + min(AGE_CHECK_EVERY, self._max_age / 4)
        async with self._actions.lock:
            await self._saver.collect_garbage()

    async def _precheck(self) -> None:
        self._server.prechecked = True
        health = None if self._latest is None else self._latest.health
        down = health is not None and health is not events.Health.OK
        if self.restore_owed() or self._latest is None or down:
            # Rebuilt ahead only while the server is seen down or loading: a round follows its return. Not for
            # a model the router runs no server for (unloaded): it may not load for hours, and RAM holds them.
            await self._restorer.precheck(rebuild=health in (events.Health.DOWN, events.Health.LOADING))

    async def _restore(self, obs: events.Observation) -> bool:
        """The restore round; False if the server did not answer /slots (the next poll tries again)."""
        assert self._identity is not None
        if self._before_restore is not None and obs.slots:
            await self._before_restore(self._identity, obs.slots)
        if not self._snapshots.snapshots():
            return True
        done = await self._restorer.restore_all(
            self._identity, healthy_at=self._server.healthy_at, counters=obs.counters, order=self
        )
        if done:
            self._set_link(probe.Link(True))
        return done is not None

    # ---- the restore round's order: restorer.Order ------------------------------------------

    async def next_step(self, pending: tuple[int, ...]) -> restoreplan.Step:
        """What a request held at the gate waits for first, and where (see :mod:`sidecar.act.early`)."""
        return await self._gate.next_step(pending, self._snapshots.snapshots)

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """Tell the listeners what ``slot`` holds now, then let the requests waiting for it go on."""
        for listener in self._listeners:
            listener.restored(slot, record)
        self._gate.restored(slot, record.file)

    async def restore_now(self) -> list[restorer.RestoreRecord]:
        """An admin's restore round into the slots that are empty now."""
        obs = self._latest
        if obs is None or not self._ready(obs) or self._identity is None:
            return []
        await self._restorer.restore_all(self._identity, healthy_at=None, counters=obs.counters)
        return self._restorer.last

    async def _probe(self) -> None:
        """Prove once per server process that the server writes into our slot dir."""
        obs = self._latest
        slots = obs.slots if obs is not None else None
        target = next(
            (v for v in slots or () if v.virgin and not v.processing and v.id not in self._restorer.unverified), None
        )
        if target is None:
            return  # the first real save will prove or disprove the link
        async with self._actions.lock:
            try:
                view = await self._actions.view(target.id)
            except errors.UpstreamError:
                return
            if view is None or not view.virgin or view.processing:
                return
            self._set_link(await probe.probe(self._actions, self._snapshots, target.id))

    def _set_link(self, link: probe.Link) -> None:
        if link == self._server.link:
            return
        self._server.link = link
        if link.ok:
            log.info("slot_dir_linked", slot_dir=str(self._snapshots.staging))
        elif link.ok is False:
            log.error("slot_dir_not_linked", problem=link.problem)

    async def save(self, action: policy.Save) -> bool:
        """Save one slot if it is idle right now; True if its content is in a snapshot (committed now or before)."""
        if self._identity is None or self._latest is None:
            log.warning("snapshot_postponed", slot=action.slot, reason="server identity (/props) not read yet")
            return False
        async with self._actions.lock:
            read_at = self._clock.monotonic()
            try:
                fresh = await self._actions.slots()
            except errors.UpstreamError as exc:
                log.warning("snapshot_postponed", slot=action.slot, reason=f"cannot read /slots: {exc}")
                self._policy.defer(action.slot, self._clock.monotonic() + RETRY_AFTER)
                return False
            view = next((v for v in fresh if v.id == action.slot), None)
            if view is None or view.signature is None:
                log.info("snapshot_postponed", slot=action.slot, reason="the slot holds nothing (any more)")
                return False
            # Newer than the poll's listing (carried over while other slots generate): the policy follows it.
            self._policy.observe([view], self._clock.monotonic(), read_at=read_at)
            if view.processing:
                self._saver.busy(action)
                return False
            if self._hold(action, fresh, None):
                return False
            if action.reason not in snapshotter.BACKGROUND and self._saver.pending:
                await self._saver.commit_pending()  # someone waits on this save: a content that waits is committed
            track = self._policy.tracks.get(view.id)
            if action.reason is not policy.SaveReason.MANUAL and track is not None and track.settled == view.signature:
                return True  # saved already (an earlier save found this content): nothing to lose
            if view.signature != action.signature:  # it ran a turn since: save what it holds now
                action = dataclasses.replace(action, signature=view.signature, tokens=view.tokens)
            if self._identity.memory in (events.Memory.RECURRENT, events.Memory.HYBRID):
                rewound = await self._to_boundary(view)  # the state the next turn can use
                if rewound.signature is not None and rewound.signature != action.signature:
                    action = dataclasses.replace(action, signature=rewound.signature, tokens=rewound.tokens)
            others_busy = self._processing(fresh, None, besides=action.slot)
            counters = self._latest.counters if self._latest is not None else None
            record = await self._saver.save(
                action,
                identity=self._identity,
                slot_n_ctx=view.n_ctx,
                others_busy=others_busy,
                epoch=self._server.epoch,
                prefill_rate=savings.measured_rate(counters) if counters is not None else None,
                owner=self._owner(action.slot),
            )
        if isinstance(record, snapshotter.Written):
            self._policy.settle(action.slot, action.signature)  # its commit waits; undone if that fails
            self._export_unsaved()
            return True
        self._saved(action, record)
        self._export_unsaved()
        return record.result is outcomes.SaveResult.OK

    async def _to_boundary(self, view: events.SlotView) -> events.SlotView:
        """Bring ``view``'s slot back to its prompt's boundary (see :mod:`.boundary`); the slot as it is then.

        Holds the action lock. Anything that goes wrong leaves the slot as it was, saved as it is.
        """
        if self._prompts is None or view.signature is None:
            return view
        started = time.perf_counter()
        temp = self._snapshots.temp_name(view.id)
        try:
            marker = await self._generation_marker()
            if not marker:
                return view
            await self._actions.save(view.id, temp)
            held = await asyncio.to_thread(slotfile.read_tokens, self._snapshots.staging / temp)
        except (errors.UpstreamError, slotfile.SlotFileError, OSError) as exc:
            log.warning(
                "boundary_not_found",
                slot=view.id,
                error=str(exc),
                effect="the slot is saved as it is, reply included: on this model the next turn of its "
                "conversation may not reuse that snapshot",
            )
            return view
        finally:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._snapshots.remove, temp)
        ids = slotfile.unpack_ids(held.data)
        keep = boundary.target(boundary.prompt_end(ids, marker), len(ids))
        if keep is None:
            return view
        try:
            processed, reused = await self._prompts.complete_ids(view.id, ids[:keep])
            after = await self._actions.view(view.id)
        except errors.UpstreamError as exc:
            log.warning("boundary_rewind_failed", slot=view.id, error=str(exc), effect="the slot is saved as it is")
            return view
        if after is None or after.processing or after.tokens != keep:
            log.warning(
                "boundary_rewind_raced",
                slot=view.id,
                effect="a request ran on the slot meanwhile: it is saved as it holds it now",
            )
            return after if after is not None and not after.processing else view
        log.info(
            "slot_rewound_to_boundary",
            slot=view.id,
            held_tokens=len(ids),
            boundary_tokens=keep,
            processed_tokens=processed,
            reused_tokens=reused,
            seconds=round(time.perf_counter() - started, 4),
            effect="the snapshot ends where the next request of this conversation still agrees",
        )
        return after

    async def _generation_marker(self) -> list[int] | None:
        """The token ids of the chat template's generation prompt (read once; None: no chat template)."""
        if self._marker_read or self._prompts is None:
            return self._marker
        rendered = await self._prompts.apply_template({"messages": [{"role": "user", "content": boundary.SENTINEL}]})
        text = boundary.marker_text(rendered)
        self._marker = await self._prompts.tokenize(text, add_special=False) if text else None
        self._marker_read = True
        if not self._marker:
            log.warning(
                "boundary_marker_missing",
                effect="llama-server's chat template shows no generation prompt: slots of this recurrent or "
                "hybrid model are saved as they are, reply included",
            )
        return self._marker

    @staticmethod
    def _processing(
        slots: tuple[events.SlotView, ...], counters: events.Counters | None, *, besides: int | None = None
    ) -> bool:
        """Whether a slot other than ``besides`` is processing, as the listing or the counters say."""
        return any(v.processing for v in slots if v.id != besides) or (counters is not None and counters.processing > 0)

    def _hold(self, action: policy.Save, slots: tuple[events.SlotView, ...], counters: events.Counters | None) -> bool:
        """Whether to hold a due save because another slot is processing (see ``Policy.may_hold``)."""
        if action.reason not in snapshotter.BACKGROUND:
            return False  # a swap, an admin's or the final save is taken now
        if not self._processing(slots, counters, besides=action.slot):
            return False
        if not self._policy.may_hold(action.slot, self._clock.monotonic()):
            return False
        if self._held.get(action.slot) != action.signature:
            self._held[action.slot] = action.signature
            log.info(
                "snapshot_held",
                slot=action.slot,
                reason="another slot is processing: a save would stall its generation",
                effect="saved once no slot is processing, or when --snapshot-interval runs out",
            )
        return True

    def _saved(self, action: policy.Save, record: snapshotter.SaveRecord) -> None:
        """What the outcome of a save means for the slot and the link."""
        if record.cause is None:
            self._set_link(probe.Link(True))
            self._policy.settle(action.slot, action.signature)
        elif record.cause in (Cause.EMPTY, Cause.BELOW_MIN_TOKENS):
            self._policy.settle(action.slot, action.signature)
        elif record.cause is not Cause.SLOT_BUSY:  # busy: the policy proposes it again once idle
            self._policy.defer(action.slot, self._clock.monotonic() + RETRY_AFTER)
            if record.cause is Cause.NOT_LINKED:
                self._set_link(probe.Link(False, record.detail))
            elif record.cause is Cause.NOT_SUPPORTED:
                self._set_link(probe.not_supported(str(self._snapshots.staging)))

    async def final_snapshots(self) -> None:
        """Save every changed, idle slot once more before the process exits; never wake a sleeping server.

        Saves whose commit waits are committed too, whatever the server's state.
        """
        try:
            await self._final_snapshots()
            await self._commit_written(quiet=True)
        finally:
            self._actions.sweep()  # files of actions cut short now; the next start-up cleans later ones

    async def _final_snapshots(self) -> None:
        obs = self._latest
        if obs is not None and obs.sleeping:
            log.info("final_snapshot_skipped", reason=ASLEEP)
            return
        if obs is None or not self._ready(obs):
            log.info("final_snapshot_skipped", reason="llama-server is not up, or its slots were not read")
            return
        try:
            _, sleeping = await self._client.props()  # /props does not wake a sleeping server; /slots would
            if sleeping:
                log.info("final_snapshot_skipped", reason=ASLEEP)
                return
            fresh = await self._actions.slots()
        except errors.UpstreamError as exc:
            log.warning("final_snapshot_skipped", reason=f"cannot read the server's state: {exc}")
            return
        self._policy.observe(fresh, self._clock.monotonic())
        todo = self._policy.final()
        if not todo:
            log.info("final_snapshot_nothing_to_save")
        for action in todo:
            await self.save(action)
