"""Polls llama-server and turns what it sees into observations and events.

/health every poll (every ``down_interval`` while the server is down or
loading, so a restart is seen within a quarter second); /slots whenever the
server is up; /props when the server comes up and every ``IDENTITY_EVERY``
seconds; /metrics when the server comes up, every ``metrics_interval``, and
on every poll while the consumer waits on it (restore verification).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from sidecar import config, errors, events, upstream

log = structlog.get_logger("sidecar.poller")
IDENTITY_EVERY = 30.0

Sink = Callable[[events.Observation, list[events.Event]], Awaitable[None]]


class Poller:
    def __init__(
        self,
        client: upstream.LlamaClient,
        settings: config.PollSettings,
        *,
        wants_counters: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._settings = settings
        self._wants_counters = wants_counters
        self._clock = clock
        self.prev: events.Observation | None = None
        self.last_up: events.Observation | None = None
        self._identity: tuple[events.Identity, bool] | None = None
        self._identity_at = float("-inf")
        self._counters: events.Counters | None = None
        self._counters_at = float("-inf")
        self._metrics_off = False
        self._problem = ""

    async def run(self, sink: Sink) -> None:
        while True:
            obs = await self.poll_once()
            evts = events.detect(self.prev, obs, last_up=self.last_up)
            if any(e.transition is events.Transition.RESTARTED for e in evts):
                obs = await self._refresh_after_restart(obs)
            self.prev = obs
            if obs.health is events.Health.OK and obs.slots is not None:
                self.last_up = obs
            await sink(obs, evts)
            up = obs.health is events.Health.OK
            await asyncio.sleep(self._settings.interval if up else self._settings.down_interval)

    async def poll_once(self) -> events.Observation:
        at = self._clock()
        health, problem = await self._client.health(), ""
        if health is not events.Health.OK:
            problem = "loading the model (HTTP 503)" if health is events.Health.LOADING else "unreachable"
            self._identity, self._counters = None, None
            return events.Observation(at=at, health=health, problem=problem)
        came_up = self.prev is None or self.prev.health is not events.Health.OK
        if came_up:
            self._metrics_off = False
        slots: tuple[events.SlotView, ...] | None = None
        try:
            slots = await self._client.slots()
        except errors.UpstreamError as exc:
            problem = str(exc)
        if came_up or at - self._identity_at >= IDENTITY_EVERY or self._identity is None:
            await self._read_identity(at)
        fresh = False
        if not self._metrics_off and (
            came_up or at - self._counters_at >= self._settings.metrics_interval or self._wants_counters()
        ):
            fresh = await self._read_counters(at)
        if problem != self._problem and problem:
            log.warning("slots_unreadable", error=problem)
        self._problem = problem
        identity, sleeping = self._identity if self._identity else (None, False)
        return events.Observation(
            at=at,
            health=health,
            slots=slots,
            identity=identity,
            counters=self._counters,
            counters_fresh=fresh,
            sleeping=sleeping,
            problem=problem,
        )

    async def _refresh_after_restart(self, obs: events.Observation) -> events.Observation:
        """Re-read identity and counters so the old process's values are not carried on."""
        await self._read_identity(obs.at)
        fresh = not self._metrics_off and await self._read_counters(obs.at)
        identity, sleeping = self._identity if self._identity else (None, False)
        return events.Observation(
            at=obs.at,
            health=obs.health,
            slots=obs.slots,
            identity=identity,
            counters=self._counters,
            counters_fresh=fresh,
            sleeping=sleeping,
            problem=obs.problem,
        )

    async def _read_identity(self, at: float) -> None:
        try:
            self._identity = await self._client.identity()
            self._identity_at = at
        except errors.UpstreamError as exc:
            log.warning("props_unreadable", error=str(exc))

    async def _read_counters(self, at: float) -> bool:
        """Read /metrics; True if fresh counters were read."""
        try:
            self._counters = await self._client.counters()
        except errors.UpstreamNotSupported:
            self._metrics_off = True
            self._counters = None
            log.warning(
                "server_metrics_off",
                reason="llama-server answered 501 on /metrics",
                effect="restart detection uses /health, /props and /slots only; restore verification is off",
                hint="start llama-server with --metrics",
            )
        except errors.UpstreamError as exc:
            log.warning("metrics_unreadable", error=str(exc))
        else:
            self._counters_at = at
            return True
        return False
