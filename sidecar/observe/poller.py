"""Polls llama-server and turns what it sees into observations and events.

Invariants and trade-offs: docs/modules.md, `sidecar/observe/poller.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from sidecar.core import config, errors, events, protocols
from sidecar.observe import memory

log = structlog.get_logger("sidecar.poller")

HURRIED = 0.02
"""Seconds between polls of a server down or loading while requests wait for it: what a held request waits,
after the server answers /health, before its restore round starts (a /health is a few hundred µs)."""

BUSY_REFRESH = 5.0
"""Seconds between /slots reads while the same number of slots stays busy."""
ROUNDED_FROM = 1e6
"""llama-server prints counters with 6 significant digits: from here on a small change may not show."""
Sink = Callable[[events.Observation, list[events.Event]], Awaitable[None]]
Weights = Callable[[str], Awaitable[str | None]]
"""Model path → checksum of the model file, or None if unreadable (``weights.WeightsIdentifier.identify``)."""


class Poller:
    def __init__(
        self,
        client: protocols.Upstream,
        settings: config.PollSettings,
        *,
        clock: protocols.Clock | None = None,
        weights: Weights | None = None,
        detect_router: bool = False,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """``hurry``: True while a request waits for the server to come back (the proxy's held completions):
        while it is down or loading, polls are then :data:`HURRIED` apart rather than ``down_interval``."""
        self._client = client
        self._detect_router = detect_router
        """Raise ``errors.RouterDetected`` when /props says the server is a router (``--router`` unset)."""
        self._router_said = False
        self._weights = weights
        self._settings = settings
        self._clock = clock or protocols.SystemClock()
        self.prev: events.Observation | None = None
        self.last_up: events.Observation | None = None
        self._identity: tuple[events.Identity, bool] | None = None
        self._model: tuple[str, dict[str, Any]] | None = None
        self._adapters: tuple[events.Adapter, ...] | None = None
        self._adapters_due = True
        self._counters: events.Counters | None = None
        self._slots: tuple[events.SlotView, ...] | None = None
        self._down_since_up = False
        self._slots_activity: tuple[float, ...] | None = None
        self._metrics_off = False
        self._problem = ""
        self._rounded_said = False
        self._slots_read_at = 0.0
        self._denied: list[str] = []
        """This poll's refusals (401/403): said once when they start and once when they end."""
        self._was_denied = False
        self._soon = asyncio.Event()
        self._quiet_until = 0.0
        self._hurry = hurry

    def quiet(self, seconds: float) -> None:
        """No poll for ``seconds`` from now, unless one is asked for (:meth:`poll_soon`).

        Every /slots and /metrics read is a task whose result wakes each of llama-server's request
        threads; a thread checks whether its client is still there only after a whole second with no
        result (``HTTP_POLLING_SECONDS``), so polls a second apart keep it from ever seeing that a client
        left: the task runs on to its end. The proxy asks for this quiet when a client leaves a request
        llama-server is running, so that llama-server sees it and stops the task.
        """
        self._quiet_until = max(self._quiet_until, asyncio.get_running_loop().time() + seconds)

    def poll_soon(self) -> None:
        """Poll now rather than after the interval (a poll under way is followed at once by another)."""
        self._soon.set()

    async def run(self, sink: Sink) -> None:
        while True:
            obs, evts = await self.step()
            await sink(obs, evts)
            up = obs.health is events.Health.OK
            pause = self._settings.interval if up else self._settings.down_interval
            if not up and self._hurry():
                pause = min(pause, HURRIED)
            try:
                async with asyncio.timeout(pause):
                    await self._soon.wait()
            except TimeoutError:
                pass
            while not self._soon.is_set() and (rest := self._quiet_until - asyncio.get_running_loop().time()) > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(rest):
                        await self._soon.wait()
            self._soon.clear()

    async def step(self) -> tuple[events.Observation, list[events.Event]]:
        """One poll, and the transitions it shows."""
        came_up = self.prev is None or self.prev.health is not events.Health.OK
        obs = await self.poll_once()
        if obs.health is not events.Health.OK:
            self._down_since_up = True
        evts = events.detect(self.prev, obs, last_up=self.last_up, was_down=self._down_since_up)
        if not came_up and any(e.transition is events.Transition.RESTARTED for e in evts):
            # Seen up all along, yet a new process: this poll read its identity as the old one's. A poll that
            # saw the server come up has just read it afresh (model facts included): not read twice.
            obs = await self._refresh_after_restart(obs)
        self.prev = obs
        if obs.health is events.Health.OK and obs.slots is not None:
            self.last_up = obs
            self._down_since_up = False
        return obs, evts

    async def poll_once(self) -> events.Observation:
        at = self._clock.monotonic()
        self._denied = []
        health, problem = await self._client.health()
        if health is not events.Health.OK:
            self._identity, self._counters, self._slots = None, None, None
            return events.Observation(at=at, health=health, problem=problem)
        came_up = self.prev is None or self.prev.health is not events.Health.OK
        if came_up:
            self._metrics_off = False
        fresh = await self._read_identity_and_counters(refresh_model=came_up)
        await self._read_adapters(fresh)
        identity, sleeping = self._identity if self._identity else (None, False)
        slots: tuple[events.SlotView, ...] | None = None
        if sleeping:
            # Reading /slots would wake it. Its KV is gone: forget the slots read before, so the
            # first read after it wakes is a fresh one. The baseline for restart detection
            # (last_up) stays the last awake observation.
            self._slots, self._slots_activity = None, None
        elif came_up or not fresh or self._slots_stale(at):
            read_at = self._clock.monotonic()  # after /health, /props and /metrics: ordered against a save's read
            try:
                slots = await self._client.slots()
            except errors.UpstreamError as exc:
                problem = str(exc)
                self._unreadable("slots_unreadable", exc, quiet=True)
            self._slots = slots
            self._slots_activity = self._counters.activity if fresh and self._counters else None
            self._slots_read_at = read_at
        else:
            slots = self._slots  # /metrics shows no activity since /slots was read: nothing changed
        if problem != self._problem and problem and not self._denied:
            log.warning("slots_unreadable", error=problem)
        self._problem = problem
        self._say_denied()
        return events.Observation(
            at=at,
            health=health,
            slots=slots,
            slots_at=self._slots_read_at if slots is not None else None,
            identity=identity,
            counters=self._counters,
            counters_fresh=fresh,
            sleeping=sleeping,
            problem=problem,
            denied=tuple(self._denied),
        )

    def _slots_stale(self, now: float) -> bool:
        """Whether /slots must be read again: the server did work since the last read, or may have.

        Every /slots read is a task that resets llama-server's ``--sleep-idle-seconds``
        timer; /metrics is not. Reading /slots only when /metrics shows activity lets an
        idle server fall asleep while the sidecar watches it. But llama-server prints its
        counters with 6 significant digits: from 1e6 on (``1.00003e+08``) a turn can end
        without moving them, so unchanged rounded counters prove nothing; and a slot last
        seen busy while the server reports none processing has finished its turn.
        """
        counters = self._counters
        if self._slots is None or counters is None:
            return True
        if counters.processing > 0:
            # A busy slot is never saved, and each read costs the server time on the loop that
            # generates: read only when the number of busy slots differs from the cached view's,
            # and at least every BUSY_REFRESH seconds.
            busy = sum(view.processing for view in self._slots)
            return busy != counters.processing or now - self._slots_read_at >= BUSY_REFRESH
        if counters.activity != self._slots_activity:
            return True
        if any(view.processing for view in self._slots):
            return True  # the turn seen running has ended (processing is 0): see how it ended
        rounded = any(value >= ROUNDED_FROM for value in counters.activity)
        if rounded and not self._rounded_said:
            self._rounded_said = True
            log.info(
                "server_counters_rounded",
                reason="llama-server's /metrics counters passed 1e6 and print rounded to 6 digits",
                effect="/slots is read every poll, so no turn goes unseen; with --sleep-idle-seconds that "
                "read keeps llama-server awake while the sidecar watches it",
            )
        return rounded

    async def _refresh_after_restart(self, obs: events.Observation) -> events.Observation:
        """Re-read identity and counters so the old process's values are not carried on."""
        fresh = await self._read_identity_and_counters(refresh_model=True)
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
            denied=obs.denied,
        )

    async def _read_identity_and_counters(self, *, refresh_model: bool) -> bool:
        """Read /props (and /v1/models) and /metrics side by side; True if fresh counters were read.

        While the server's role is unknown (``--router`` unset, first poll of a
        process) /props goes first: a router is recognised before its /metrics,
        which wants ``?model=``, is read and logged as unreadable.
        """
        if self._detect_router and refresh_model:
            await self._read_identity(refresh_model=refresh_model)
            return False if self._metrics_off else await self._read_counters()
        if self._metrics_off:
            await self._read_identity(refresh_model=refresh_model)
            return False
        _, fresh = await asyncio.gather(self._read_identity(refresh_model=refresh_model), self._read_counters())
        return fresh

    async def _read_identity(self, *, refresh_model: bool) -> None:
        try:
            identity, sleeping = await self._client.props()
            if refresh_model or self._model is None or self._model[0] != identity.model_path:
                self._model = (identity.model_path, await self._model_facts(identity.model_path))
                # The facts take a while (the weights' checksum, the GGUF header): with a short
                # --sleep-idle-seconds the server may have fallen asleep since, and the /slots read
                # that follows would wake it. /props never wakes it: ask again.
                identity, sleeping = await self._client.props()
            facts = {**self._model[1], "adapters": self._adapters}
            self._identity = (dataclasses.replace(identity, **facts), sleeping)
        except errors.UpstreamIsRouter as exc:
            if self._detect_router:
                raise errors.RouterDetected(str(exc)) from exc
            if not self._router_said:
                self._router_said = True
                log.error(
                    "server_is_router",
                    error=str(exc),
                    effect="nothing is saved or restored: --router is off (forced), and a router has no slots "
                    "of its own",
                    hint="leave --router unset (or LLAMA_SIDECAR_ROUTER empty) to follow what the server says, "
                    "or set it",
                )
        except errors.UpstreamError as exc:
            self._unreadable("props_unreadable", exc)

    async def _model_facts(self, model_path: str) -> dict[str, Any]:
        """Size, parameter count and weights checksum: read once per server process."""
        size, params = await self._client.model_meta()
        self._adapters, self._adapters_due = None, True
        weights = await self._weights(model_path) if self._weights is not None else None
        kind = await asyncio.to_thread(memory.of_server, model_path, self._client.url)
        return {"model_size": size, "model_params": params, "weights": weights, "memory": kind}

    async def _read_adapters(self, fresh: bool) -> None:
        """LoRA adapters, once per server process, read only while the server is awake and idle.

        /lora-adapters is a task on the server's loop: it waits behind a prefill
        (and would hold this poll, and a restore round, as long) and wakes a
        sleeping server. Until it is read the identity says None (not compared).
        """
        if not self._adapters_due or self._identity is None or self._identity[1]:
            return
        if fresh and self._counters is not None and self._counters.processing > 0:
            return
        try:
            self._adapters = await self._client.adapters()
        except errors.UpstreamError as exc:
            log.warning("lora_adapters_unreadable", error=str(exc), effect="tried again at the next idle poll")
            return
        self._adapters_due = False
        self._identity = (dataclasses.replace(self._identity[0], adapters=self._adapters), self._identity[1])

    async def _read_counters(self) -> bool:
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
            self._unreadable("metrics_unreadable", exc)
        else:
            return True
        return False

    def _unreadable(self, event: str, exc: errors.UpstreamError, *, quiet: bool = False) -> None:
        """Note a refusal (401/403) for :meth:`_say_denied`; log any other error as ``event``."""
        if isinstance(exc, errors.UpstreamDenied):
            self._denied.append(str(exc))
        elif not quiet:
            log.warning(event, error=str(exc))

    def _say_denied(self) -> None:
        """One line when the server starts refusing the sidecar, one when it stops: not one per poll."""
        if bool(self._denied) == self._was_denied:
            return
        self._was_denied = bool(self._denied)
        if self._denied:
            log.error(
                "server_refuses_sidecar",
                refused=list(self._denied),
                effect="no snapshots and no restores while llama-server refuses to show its slots; "
                "/readyz answers 503 and llama_sidecar_server_readable is 0",
                hint="give the sidecar one of llama-server's API keys: --api-key-file / LLAMA_API_KEY_FILE "
                "(or --api-key / LLAMA_API_KEY); of a comma-separated list it sends the first key",
            )
        else:
            log.info("server_readable", server=self._client.url)
