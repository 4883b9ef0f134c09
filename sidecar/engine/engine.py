"""What the sidecar does with each observation: log, count, restore, save; one engine per watched server.

The ``Engine`` holds the state of the current server process and wires its parts, split by job: the
consumer (every observation, in the poll loop), the runner (restores and saves, one at a time), the
slot service (the proxy's questions) and the status view.

Invariants and trade-offs: docs/modules.md, `sidecar/engine/engine.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from sidecar.core import config, events, metrics, protocols
from sidecar.engine import consumer, gate, listeners, part, report, runner, saves, sight, slotservice, statusview
from sidecar.restore import restorer
from sidecar.save import boundary, policy, rewind
from sidecar.slots import actions
from sidecar.snapshots import store


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
        before_restore: runner.BeforeRestore | None = None,
        prompts: boundary.Prompts | None = None,
        read_fresh: slotservice.ReadSlots | None = None,
        told: Iterable[listeners.SlotListener] = (),
    ) -> None:
        """``before_restore`` is awaited at the start of each restore round (the shared store fetches
        snapshots for the empty slots then); ``prompts``: how a slot of a recurrent or hybrid model is brought
        back to its prompt's boundary (None: slots are saved as they are); ``read_fresh``: how the proxy's
        fresh reads of the slots are made (see ``SlotService``); ``told``: who is told when the engine changes
        what the slots hold."""
        clock = clock or protocols.SystemClock()
        slot_actions = actions.SlotActions(client=client, snapshots=snapshots)
        seen = sight.Sight(snapshots.staging)
        wiring = part.Wiring(
            client=client,
            slot_actions=slot_actions,
            snapshots=snapshots,
            stats=stats,
            clock=clock,
            decider=policy.Policy(settings.snapshots),
            seen=seen,
            told=listeners.Listeners(told),
            restore_gate=restore_gate or gate.Gate(clock=clock),
            restoring=restorer.Restorer(
                slot_actions=slot_actions, snapshots=snapshots, stats=stats, clock=clock, identity=lambda: seen.identity
            ),
        )
        wake = asyncio.Event()
        """Set by the consumer when an observation makes the action runner's work due."""
        self._saves = saves.Saves(
            wiring,
            settings=settings.snapshots,
            rewinder=rewind.Rewinder(
                prompts=prompts, slot_actions=slot_actions, snapshots=snapshots, rewound=wiring.told.rewound
            ),
        )
        self._runner = runner.Runner(wiring, wake=wake, saving=self._saves, before_restore=before_restore)
        self._consumer = consumer.Consumer(
            wiring, down_interval=settings.poll.down_interval, wake=wake, saving=self._saves
        )
        self.slots = slotservice.SlotService(wiring, saving=self._saves, read_fresh=read_fresh)
        """The proxy's slot questions (the library's ``seams.Slots``)."""
        self._view = statusview.StatusView(wiring, saving=self._saves, consuming=self._consumer, running=self._runner)

    async def handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        """The poller's sink: what one observation means (see ``Consumer.handle``)."""
        await self._consumer.handle(obs, evts)

    async def run(self) -> None:
        """The action runner's task (see ``Runner.run``)."""
        await self._runner.run()

    async def work(self) -> None:
        """One pass of the action runner: what the newest observation makes due."""
        await self._runner.work()

    def status(self) -> report.Status:
        """What the engine knows now, for the HTTP layer."""
        return self._view.status()

    async def save_now(self, slot: int) -> report.SaveReply | None:
        """An admin's save of ``slot``; None when the newest poll shows no such slot holding tokens."""
        return await self._view.save_now(slot)

    async def restore_now(self) -> Sequence[restorer.RestoreRecord]:
        """An admin's restore round into the slots that are empty now."""
        return await self._view.restore_now()

    async def final_snapshots(self) -> None:
        """Save every changed, idle slot once more before the process exits (see ``Saves.final_snapshots``)."""
        await self._saves.final_snapshots()
