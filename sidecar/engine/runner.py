"""The engine's action runner: a task of its own that acts whenever an observation asks for it.

It checks snapshot files while the server loads, then runs the restore round,
the slot-dir probe and the saves that are due (:mod:`.saves`), one action at
a time, each right after reading its slot (see :mod:`sidecar.slots.actions`).
A save the server holds behind a busy slot then delays other actions, never
the polls. It is also the restore round's :class:`restorer.Order`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from sidecar.core import errors, events
from sidecar.engine import lifecycle, part, probe, saves
from sidecar.restore import plan, restorer
from sidecar.save import policy
from sidecar.snapshots import manifest

BeforeRestore = Callable[[events.Identity, tuple[events.SlotView, ...]], Awaitable[object]]
"""Awaited with the server's identity and slots at the start of each restore round."""


class Runner(part.Part):
    def __init__(
        self,
        wiring: part.Wiring,
        *,
        wake: asyncio.Event,
        saving: saves.Saves,
        before_restore: BeforeRestore | None = None,
    ) -> None:
        """``wake`` is set by the consumer when an observation makes something due; ``before_restore`` is
        awaited at the start of each restore round (the shared store fetches snapshots for the empty slots then)."""
        super().__init__(wiring)
        self._wake = wake
        self._saves = saving
        self._before_restore = before_restore
        self._working_since: float | None = None
        """When the action runner's current pass began; None between passes."""

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
        obs = self._sight.latest
        if obs is None or obs.health is not events.Health.OK:
            await self._saves.commit_written(quiet=True)  # nothing generates: the restore round will want them
            if obs is not None and obs.health is events.Health.UNLOADED and self._restorer.ahead:
                await self._restorer.drop_ahead()  # router mode: no server runs the model, none loads it (yet)
            if not self._sight.server.prechecked:
                await self._precheck()
            return
        if not self._sight.ready(obs):
            await self._saves.commit_written(quiet=obs.sleeping or not saves.processing(obs.slots or (), obs.counters))
            return
        if self._gate.life.round is lifecycle.Round.OWED:
            await self._round(obs)
        if self._restorer.ahead and not self._gate.life.restore_owed:
            await self._restorer.drop_ahead()  # the server came back without a restore round, or it had none
        if self._sight.server.link.ok is None:
            await self._probe()
        await self._saves.expire()
        for action in self._policy.due(self._clock.monotonic()):
            latest = self._sight.latest
            if self._gate.life.restore_owed or latest is None or not self._sight.ready(latest):
                return  # the server restarted, slept or went away meanwhile
            if isinstance(action, policy.Skip):
                self._saves.saver.records.skip(action)
                self._policy.settle(action.slot, action.signature, kept=False)
            elif not self._saves.hold(action, latest.slots or (), latest.counters):
                await self._saves.save(action)
        latest = self._sight.latest
        if latest is not None:
            await self._saves.commit_written(quiet=not saves.processing(latest.slots or (), latest.counters))

    async def _round(self, obs: events.Observation) -> None:
        """The owed restore round, from the poll ``obs``; the gate opens once it is done."""
        await self._saves.commit_written(quiet=True)  # the newest snapshots are restored, not those before
        self._gate.see(lifecycle.RoundStarted())
        answered = True
        try:
            answered = await self._restore(obs)
        finally:
            self._gate.see(lifecycle.RoundEnded(answered))  # stays owed if the server lost its slots meanwhile
        self._gate.see(lifecycle.Up(obs.at, ready=True))  # the poll the round started from: open once done

    async def _precheck(self) -> None:
        self._sight.server.prechecked = True
        health = None if self._sight.latest is None else self._sight.latest.health
        down = health is not None and health is not events.Health.OK
        if self._gate.life.restore_owed or self._sight.latest is None or down:
            # Rebuilt ahead only while the server is seen down or loading: a round follows its return. Not for
            # a model the router runs no server for (unloaded): it may not load for hours, and RAM holds them.
            await self._restorer.checks.precheck(rebuild=health in (events.Health.DOWN, events.Health.LOADING))

    async def _restore(self, obs: events.Observation) -> bool:
        """The restore round; False if the server did not answer /slots (the next poll tries again)."""
        assert self._sight.identity is not None
        if self._before_restore is not None and obs.slots:
            await self._before_restore(self._sight.identity, obs.slots)
        if not self._snapshots.snapshots():
            return True
        done = await self._restorer.restore_all(
            self._sight.identity, healthy_at=self._sight.server.healthy_at, counters=obs.counters, order=self
        )
        if done:
            self._sight.set_link(probe.Link(True))
        return done is not None

    # ---- the restore round's order: restorer.Order ------------------------------------------

    async def next_step(self, pending: tuple[int, ...]) -> plan.Step:
        """What a request held at the gate waits for first, and where (see :mod:`sidecar.restore.early`)."""
        return await self._gate.next_step(pending, self._snapshots.snapshots)

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """Tell the listeners what ``slot`` holds now, then let the requests waiting for it go on."""
        self._listeners.restored(slot, record)
        self._gate.restored(slot, record.file)

    async def restore_now(self) -> list[restorer.RestoreRecord]:
        """An admin's restore round into the slots that are empty now."""
        obs = self._sight.latest
        if obs is None or not self._sight.ready(obs) or self._sight.identity is None:
            return []
        await self._restorer.restore_all(self._sight.identity, healthy_at=None, counters=obs.counters)
        return self._restorer.verifier.last

    async def _probe(self) -> None:
        """Prove once per server process that the server writes into our slot dir."""
        obs = self._sight.latest
        slots = obs.slots if obs is not None else None
        target = next(
            (
                v
                for v in slots or ()
                if v.virgin and not v.processing and v.id not in self._restorer.verifier.unverified
            ),
            None,
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
            self._sight.set_link(await probe.probe(self._actions, self._snapshots, target.id))

    def acting(self) -> bool:
        """Whether a slot action (save, restore, probe) is in flight or about to be sent."""
        return self._actions.lock.locked()

    def progress(self) -> float | None:
        """When the current pass began, or its newest file check ended; None between passes."""
        if self._working_since is None:
            return None
        return max(self._working_since, self._restorer.checks.checked_at)
