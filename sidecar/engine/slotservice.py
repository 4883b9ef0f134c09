"""The proxy's slot questions, answered by the engine that owns the slots (``library.seams.Slots``).

The library's placer asks here what a slot holds and whether it is saved,
reads the slots afresh on a request's path, and has a slot saved, swapped
in or emptied for a request; the engine's policy follows every answer, so
the saves it plans stay true whatever route a turn came by.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from sidecar.core import errors, events
from sidecar.engine import listeners, part, saves
from sidecar.observe import upstream
from sidecar.restore import restorer
from sidecar.save import policy
from sidecar.snapshots import manifest

log = structlog.get_logger("sidecar.engine")

ReadSlots = Callable[[], Awaitable[tuple[events.SlotView, ...]]]
"""A read of every slot as the server shows it now; raises ``errors.UpstreamError``."""


class SlotService(part.Part):
    def __init__(
        self,
        wiring: part.Wiring,
        *,
        saving: saves.Saves,
        read_fresh: ReadSlots | None = None,
    ) -> None:
        """``read_fresh``: how :meth:`fresh_slots` reads the slots (the request path's own client, so a read
        never waits behind the poller's); None: with the slot actions' client."""
        super().__init__(wiring)
        self._saves = saving
        self._read_fresh: ReadSlots = read_fresh or wiring.slot_actions.slots

    def seen(self) -> tuple[events.Observation | None, events.Identity | None]:
        """The newest observation handled, and the newest identity the server gave (None before the first)."""
        return self._sight.latest, self._sight.identity

    def unsaved(self, slot: int) -> bool:
        """Whether ``slot`` holds content, as polled, that no snapshot of the engine holds."""
        track = self._policy.tracks.get(slot)
        return track is not None and track.signature is not None and track.signature != track.settled

    def worth_saving(self, tokens: int) -> bool:
        """Whether a slot holding ``tokens`` is worth a snapshot (at least ``--min-tokens``)."""
        return tokens >= self._policy.settings.min_tokens

    def rebuild_ahead(self, record: manifest.Manifest) -> bool:
        """Begin rebuilding ``record`` from the block store while the slot it goes to is saved; False if not
        begun (no block store, or a rebuilt file waits already). Call :meth:`rebuilt_ahead_done` after the swap."""
        return self._restorer.rebuild_ahead(record)

    def rebuilt_ahead_done(self, record: manifest.Manifest) -> None:
        """The swap :meth:`rebuild_ahead` began for is over (restored or not)."""
        self._restorer.rebuilt_ahead_done(record)

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
        self._restorer.verifier.answered(slot, reused)

    def follow(self, listener: listeners.SlotListener) -> None:
        """Tell ``listener`` each time the engine changes what the slots hold (a restart, a restore round)."""
        self._listeners.follow(listener)

    async def fresh_slots(self) -> tuple[events.SlotView, ...]:
        """Every slot as the server shows it now, not as the last poll saw it; the policy follows it.

        A turn that ended since that poll (sent straight to llama-server, or
        through the proxy unrouted) then counts as unsaved, whatever route it
        came by. Raises ``errors.UpstreamError``.
        """
        read_at = self._clock.monotonic()
        fresh = await self._read_fresh()
        if self._sight.identity is not None:  # the request path's reader does not know what /props announced
            upstream.announced(fresh, self._sight.identity.total_slots)
        self._policy.observe(fresh, self._clock.monotonic(), read_at=read_at)
        self._saves.export_unsaved()
        return fresh

    def restore_owed(self) -> bool:
        """Whether a restore round is owed or running: requests that reach the server now may race it."""
        return self._gate.life.restore_owed

    async def save(self, action: policy.Save) -> bool:
        """Save one slot if it is idle right now; True if its content is in a snapshot (see ``Saves.save``)."""
        return await self._saves.save(action)
