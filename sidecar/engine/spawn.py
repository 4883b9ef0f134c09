"""The one way to watch a llama-server: its poller, its restore gate and the engine that consumes both.

``llama-kv-sidecar run`` watches one server this way; in router mode the
fleet watches each model's server the same way, over a client and a store
view bound to that model. The poller hands every observation to
:meth:`Engine.handle`; the gate asks the poller to poll at once when the
proxy suspects a crash (see :mod:`sidecar.engine.gate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from sidecar.core import config, metrics, protocols
from sidecar.engine import engine, gate, listeners, runner, slotservice
from sidecar.observe import poller
from sidecar.save import boundary
from sidecar.snapshots import store


@dataclasses.dataclass(frozen=True, slots=True)
class Watch:
    """One watched server: what runs it, and the gate the proxy waits at for it."""

    engine: engine.Engine
    poller: poller.Poller
    gate: gate.Gate

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The two tasks that run it, by name: ``poller`` (observations) and ``actions`` (the action runner)."""
        return {"poller": self.poller.run(self.engine.handle), "actions": self.engine.run()}


def watch(
    *,
    client: protocols.Upstream,
    snapshots: store.SnapshotStore,
    stats: metrics.Metrics,
    settings: config.Settings,
    clock: protocols.Clock,
    weights: poller.Weights | None = None,
    before_restore: runner.BeforeRestore | None = None,
    detect_router: bool = False,
    prompts: boundary.Prompts | None = None,
    starting: Callable[[], bool] | None = None,
    read_fresh: slotservice.ReadSlots | None = None,
    told: Iterable[listeners.SlotListener] = (),
) -> Watch:
    """Wire a poller, a gate and an engine for the server ``client`` talks to.

    ``detect_router``: the poller raises ``errors.RouterDetected`` if the server says it is a router
    (a plain server's watch when neither --router nor --no-router was given). ``prompts``: how the
    engine brings a slot of a recurrent or hybrid model back to its prompt's boundary (see ``boundary``).
    ``starting``: True while the sidecar's launcher brings the server up (launcher mode): a server down or
    loading is then polled as often as for a request waiting at the gate, so its restore round starts at once.
    ``read_fresh`` and ``told``: see ``engine.Engine``.
    """

    def hurry() -> bool:
        # The poller and the gate know each other: the gate, made just below, asks the poller to poll now.
        return restore_gate.waiting > 0 or (starting is not None and starting())

    poll = poller.Poller(client, settings.poll, clock=clock, weights=weights, detect_router=detect_router, hurry=hurry)
    restore_gate = gate.Gate(clock=clock, on_suspect=poll.poll_soon, on_wait=poll.poll_soon)
    watched = engine.Engine(
        client=client,
        snapshots=snapshots,
        stats=stats,
        settings=settings,
        clock=clock,
        restore_gate=restore_gate,
        before_restore=before_restore,
        prompts=prompts,
        read_fresh=read_fresh,
        told=told,
    )
    return Watch(watched, poll, restore_gate)
