"""One engine per model of a router-mode llama-server, started and stopped as the router's list changes.

Each model gets its own poller and engine, over a client and a view of the snapshot store bound to
that model; the fleet is also what the HTTP layer reads: the router's status merged with every
engine's.

Invariants and trade-offs: docs/modules.md, `sidecar/router/fleet.py`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Sequence

import structlog

from sidecar.core import config, errors, events, metrics, protocols, redact
from sidecar.engine import engine, gate, lifecycle, report, spawn
from sidecar.observe import poller, upstream
from sidecar.restore import restorer, savings
from sidecar.router import plan
from sidecar.snapshots import store

log = structlog.get_logger("sidecar.router")

MAX_MODELS = 32
"""Most models watched at once: bounds the engines, the polls and the ``model`` label's values."""


@dataclasses.dataclass(slots=True)
class Member:
    """One model's engine and the tasks that run it."""

    model: str
    engine: engine.Engine
    gate: gate.Gate
    """The model's restore gate, driven by its engine: requests for the model wait at it (see admission)."""
    tasks: tuple[asyncio.Task[None], ...] = ()


class Fleet:
    def __init__(
        self,
        *,
        client: upstream.LlamaClient,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.Settings,
        clock: protocols.Clock,
        weights: poller.Weights | None = None,
    ) -> None:
        self._client = client
        self._snapshots = snapshots
        self._stats = stats
        self._settings = settings
        self._clock = clock
        self._weights = weights
        self.members: dict[str, Member] = {}
        self._router: events.Observation | None = None
        self._listed_at = clock.monotonic()
        self._left_out: tuple[str, ...] = ()
        self._group: asyncio.TaskGroup | None = None
        self.gate = gate.Gate(clock=clock)
        """The proxy's gate for the router itself: open while its /health answers ok (each model has its own)."""

    # ---- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Follow the router's model list until cancelled; engines run in a task group of their own."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            while True:
                await self.step()
                await asyncio.sleep(self._settings.poll.interval)

    async def step(self) -> None:
        """Read the router's health and model list once, and start or stop engines to match."""
        at = self._clock.monotonic()
        health, problem = await self._client.health()
        self._router = events.Observation(at=at, health=health, problem=problem)
        self._listed_at = at
        self._stats.server_up.set(1 if health is events.Health.OK else 0)
        if health is not events.Health.OK:
            self.gate.see(lifecycle.Unhealthy(health, f"the router is {health.value}: {problem}"))
            return
        # The engines see their models down on their own; the list is kept as it was.
        self.gate.see(lifecycle.Up(at, ready=False))
        try:
            listed = await self._client.router.models()
        except errors.UpstreamError as exc:
            log.warning("router_models_unreadable", error=str(exc), effect="the engines running stay as they are")
            return
        decided = plan.decide(listed, self.members, limit=MAX_MODELS)
        for model in decided.stop:
            await self._stop(model)
        for model in decided.start:
            self._start(model)
        if decided.left_out != self._left_out:
            self._left_out = decided.left_out
            if decided.left_out:
                log.warning(
                    "router_models_left_out",
                    models=list(decided.left_out),
                    effect=f"the sidecar watches at most {MAX_MODELS} models; these get no snapshots",
                    hint="list fewer models in the router's --models-dir or --models-preset",
                )

    def _start(self, model: str) -> None:
        assert self._group is not None
        client = self._client.for_model(model, self._settings.upstream)
        snapshots = self._snapshots.for_model(model)
        watched = spawn.watch(
            client=client,
            snapshots=snapshots,
            stats=self._stats.for_model(model),
            settings=self._settings,
            clock=self._clock,
            weights=self._weights,
            prompts=client.prompts,  # a windowed, hybrid or recurrent model: saved at the prompt's boundary
        )
        member = Member(model, watched.engine, watched.gate)
        context = contextvars.copy_context()
        context.run(structlog.contextvars.bind_contextvars, model=model)  # every log line of its engine names it
        member.tasks = tuple(
            self._group.create_task(loop, name=f"{name} {model}", context=context)
            for name, loop in watched.loops().items()
        )
        self.members[model] = member
        log.info("model_watched", model=model, snapshots=len(snapshots.snapshots()))

    async def _stop(self, model: str) -> None:
        member = self.members.pop(model)
        for task in member.tasks:
            task.cancel()
        await asyncio.gather(*member.tasks, return_exceptions=True)
        self._stats.forget_model(model)
        log.info("model_unwatched", model=model, reason="the router no longer lists it; its snapshots stay on disk")

    async def final_snapshots(self) -> None:
        """Each model's final snapshots, one model after the other (they share the disk)."""
        for member in list(self.members.values()):
            await member.engine.final_snapshots()

    # ---- what the HTTP layer reads ---------------------------------------------------------

    def status(self) -> report.Status:
        """The router's health, with the slowest engine's progress and every engine's last actions."""
        models = tuple((name, m.engine.status()) for name, m in self.members.items())
        statuses = [status for _, status in models]
        saves = [s.last_snapshot for s in statuses if s.last_snapshot is not None]
        links = [s.link_ok for s in statuses if s.link_ok is not None]
        return report.Status(
            server_url=redact.url(self._client.url),
            observation=self._router,
            identity=None,
            link_ok=None if not links else all(links),
            link_problem="; ".join(s.link_problem for s in statuses if s.link_ok is False),
            last_snapshot=max(saves, key=lambda r: r.at, default=None),
            last_restore=tuple(r for s in statuses for r in s.last_restore),
            progress_at=min([self._listed_at, *(s.progress_at for s in statuses)]),
            acting=any(s.acting for s in statuses),
            saved=savings.merge([s.saved for s in statuses]),
            recent=tuple(sorted((d for s in statuses for d in s.recent), key=lambda d: d.at)),
            low_disk=any(s.low_disk for s in statuses),
            models=models,
        )

    async def save_now(self, slot: int) -> report.SaveReply | None:
        """Not offered in router mode: a slot number does not say which model's slot."""
        del slot
        return None

    async def restore_now(self) -> Sequence[restorer.RestoreRecord]:
        """A restore round into the empty slots of every loaded model."""
        done: list[restorer.RestoreRecord] = []
        for member in list(self.members.values()):
            done.extend(await member.engine.restore_now())
        return done
