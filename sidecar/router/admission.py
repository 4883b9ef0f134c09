"""The proxy's door in router mode: a completion reaches a model only once that model's KV is back.

Invariants and trade-offs: docs/modules.md, `sidecar/router/admission.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import structlog

from sidecar.core import config, errors, events, metrics, outcomes, protocols, tasks
from sidecar.engine import lifecycle
from sidecar.observe import upstream
from sidecar.proxy import refusals, relay
from sidecar.router import fleet

log = structlog.get_logger("sidecar.router")
LOAD_RETRY = 0.2
"""Seconds between two asks of a load the router refused for lack of room (see ``Admission._load``)."""


def named_model(body: bytes) -> str | None:
    """The ``"model"`` a JSON request body names; None if it names none (or is not JSON)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model else None


class Admission:
    def __init__(
        self,
        *,
        models: fleet.Fleet,
        client: upstream.LlamaClient,
        stats: metrics.Metrics,
        settings: config.Settings,
        clock: protocols.Clock | None = None,
    ) -> None:
        self._fleet = models
        self._client = client
        self._stats = stats
        self._settings = settings
        self._clock = clock or protocols.SystemClock()
        self._loading: dict[str, asyncio.Task[None]] = {}
        """One load (with its saves before it) per model, shared by the requests that wait for it."""

    async def admit(self, route: outcomes.Route, body: bytes) -> relay.Refusal | None:
        """None once the request may go on; else the answer to give instead (held too long)."""
        if route is not outcomes.Route.COMPLETION:
            return None
        model = named_model(body)
        member = self._fleet.members.get(model) if model is not None else None
        if model is None or member is None:
            return None
        try:
            states = await self._client.router.models()  # now, not as of the last poll: it may have been unloaded since
        except errors.UpstreamError:
            return None  # the router does not answer: the request gets its own answer from it
        running = {name for name, state in states.items() if state.running}
        if model in running and member.gate.is_open:
            return None
        hold = self._settings.proxy.hold_seconds
        with member.gate.hold(self._stats) as held:
            load = None
            if model not in running:
                member.gate.see(
                    lifecycle.Unhealthy(events.Health.LOADING, f"the router is loading model {model!r} for a request")
                )
                load = self._loading.get(model)
                if load is None or load.done():
                    others = {name: m for name, m in self._fleet.members.items() if name in running}
                    load = tasks.watch(
                        asyncio.create_task(self._load(model, others), name=f"load {model}"),
                        effect=f"model {model!r} was not loaded for the held requests: they get 503 when "
                        "their hold ends",
                    )
                    self._loading[model] = load
            ok = await held.wait(hold, after=load)  # a client leaving does not stop the load
        if ok:
            return None
        reason = member.gate.reason or "the model's restore gate kept closing"
        log.warning(
            "proxy_request_held_too_long",
            model=model,
            seconds=hold,
            reason=reason,
            effect="answered 503 with Retry-After",
            hint="see the router's log for the model's load; raise --proxy-hold-seconds for slow loads",
        )
        return refusals.error(
            503,
            f"model {model!r} is not ready after {hold:g} s: {reason}. Retry later.",
            "unavailable_error",
            headers={"Retry-After": str(self._settings.proxy.retry_after)},
        ), outcomes.ProxyOutcome.HELD_TIMEOUT

    async def _load(self, model: str, others: Mapping[str, fleet.Member]) -> None:
        """Save the running models' changed slots, then have the router load ``model``.

        The router refuses a load (500 "model limit reached") while every model
        that would have to make room is in the middle of a call, the sidecar's
        own polls included: the load is asked again every :data:`LOAD_RETRY`
        seconds until ``--proxy-hold-seconds`` have passed.
        """
        await self._save_before_swap(model, others)
        deadline = self._clock.monotonic() + self._settings.proxy.hold_seconds
        said = False
        while True:
            try:
                await self._client.router.load_model(model)
            except errors.UpstreamRejected as exc:
                log.info("model_load_not_needed", model=model, answer=str(exc))  # loaded by someone else meanwhile
                return
            except errors.UpstreamError as exc:
                if (
                    isinstance(exc, errors.UpstreamUnavailable)
                    and exc.status is not None
                    and self._clock.monotonic() < deadline
                ):
                    if not said:
                        said = True
                        log.info("model_load_deferred", model=model, answer=str(exc), effect="asked again shortly")
                    await asyncio.sleep(LOAD_RETRY)
                    continue
                log.warning("model_load_failed", model=model, error=str(exc), effect="the request waits at the gate")
                return
            log.info("model_load_asked", model=model, reason="a completion for it reached the proxy")
            return

    async def _save_before_swap(self, model: str, others: Mapping[str, fleet.Member]) -> None:
        for name, member in others.items():
            log.info(
                "model_saving_before_swap",
                model=name,
                loading=model,
                reason="loading a model may make the router unload this one (--models-max): its KV would be lost",
            )
            try:
                async with asyncio.timeout(self._settings.snapshots.final_timeout):
                    await member.engine.final_snapshots()
            except TimeoutError:
                log.warning(
                    "model_save_before_swap_timeout", model=name, seconds=self._settings.snapshots.final_timeout
                )
