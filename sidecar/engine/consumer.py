"""The engine's consumer of observations: what each poll means, in the poll loop, never waiting for the server.

:meth:`Consumer.handle` runs for every observation the poller hands over: it
logs and counts transitions, closes and opens the restore gate, feeds the
pure policy, judges restores, and wakes the action runner (:mod:`.runner`).
It is the one place what the engine knows of the server process
(``process.ServerProcess``) is renewed (a restart, a wake-up).
"""

from __future__ import annotations

import asyncio

import structlog

from sidecar.core import events
from sidecar.engine import lifecycle, part, saves

log = structlog.get_logger("sidecar.engine")


class Consumer(part.Part):
    def __init__(
        self,
        wiring: part.Wiring,
        *,
        down_interval: float,
        wake: asyncio.Event,
        saving: saves.Saves,
    ) -> None:
        """``wake`` is set whenever an observation makes the action runner's work due."""
        super().__init__(wiring)
        self._down_interval = down_interval
        self._wake = wake
        self._saves = saving
        self.handled_at = wiring.clock.monotonic()
        """When the last observation was handled (its start before the first): see ``report.Liveness``."""

    async def handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        try:
            await self._handle(obs, evts)
        finally:
            self.handled_at = self._clock.monotonic()  # the loop made progress: see report.Liveness

    async def _handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        if self._sight.latest is None or obs.health is not self._sight.latest.health:
            self._say_state(obs)
        self._stats.server_readable.set(0 if obs.denied else 1)
        if obs.health is not events.Health.OK:
            self._gate.see(lifecycle.Unhealthy(obs.health))
        for event in evts:
            self._on_event(event)
        self._sight.latest = obs
        if obs.identity is not None:
            kind = obs.identity.memory
            if kind is not None and (self._sight.identity is None or self._sight.identity.memory != kind):
                self._stats.memory_is(kind)
            self._sight.identity = obs.identity
        if not self._sight.ready(obs):
            unloaded = obs.health is events.Health.UNLOADED
            if (
                (obs.health is not events.Health.OK and not self._sight.server.prechecked)
                or self._saves.saver.pending
                or (unloaded and self._restorer.ahead)
            ):
                # check the files the restore round will need; commit the saves that wait; give back what was
                # rebuilt ahead for a model the router has unloaded
                self._wake.set()
            elif obs.health is events.Health.OK:
                self._gate.see(lifecycle.Up(obs.at, ready=False))  # up, but nothing the sidecar can restore now
            return
        assert obs.slots is not None
        if len(obs.slots) != self._sight.slot_count:
            self._sight.slot_count = len(obs.slots)
            self._stats.init_slots(range(self._sight.slot_count))
        if not self._sight.server.adopted:
            self._sight.server.adopted = True
            self._adopt_existing(obs.slots)
        self._policy.observe(obs.slots, obs.at, read_at=obs.slots_at)
        self._restorer.verifier.observe(obs, self._sight.identity)
        self._saves.export_unsaved()
        if self._restorer.verifier.unverified:
            self._restorer.verifier.judge(obs)
        self._gate.see(lifecycle.Up(obs.at, ready=True))  # opens unless a round is owed (the runner opens it then)
        self._wake.set()

    def _on_event(self, event: events.Event) -> None:
        kind = event.transition
        if kind is events.Transition.CAME_UP:
            self._stats.server_up.set(1)
            self._sight.server.healthy_at = event.at
        elif kind is events.Transition.WENT_DOWN:
            self._stats.server_up.set(0)
            self._sight.server.prechecked = False  # it may come back as a new process: have the files checked by then
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
        restart-to-restore latency starts. The one place the server process's record is renewed.
        """
        self._policy.reset()
        self._sight.server = self._sight.server.renewed(at=at, new_process=new_process)
        self._listeners.emptied()
        self._restorer.verifier.forget_pending()
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
