"""A request no slot can take now, held until one frees: first in first out, as llama-server queues it. I/O.

It is not sent unpinned: llama-server would give it the first slot to free, and run it over what the
request that ran there left, which no snapshot may hold yet. Held instead, and placed again once a
request ends (or at the next read of ``/slots``, :data:`RECHECK`): the slot it then takes has its content
saved first if it changed. A streamed request gets its keep-alives meanwhile (``proxy.keepalive``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from sidecar.core import outcomes, protocols
from sidecar.library import filling, seams, slotbook

log = structlog.get_logger("sidecar.library")

RECHECK = 0.5
"""Seconds between two reads of ``/slots`` for a request held while every slot is busy: a slot a client of
llama-server's own ran in frees with no word to the placer (one that a routed request held frees at once)."""

Again = Callable[[], Awaitable[filling.Route | outcomes.Unrouted | None]]
"""The request's placement, asked again."""


class Holding:
    """Where requests wait for a slot while every slot they could go to is busy."""

    def __init__(
        self, *, engine: seams.Slots, book: slotbook.SlotBook, clock: protocols.Clock, hold_seconds: float
    ) -> None:
        """``hold_seconds``: the longest a request waits; past it (the slots read busy all along) it goes as it
        came, which llama-server queues."""
        self._engine = engine
        self._book = book
        self._clock = clock
        self._hold = hold_seconds

    async def until_free(self, again: Again, since: int) -> filling.Route | outcomes.Unrouted | None:
        """Place a request again, in its turn, until a slot can take it (or past the bound); ``since``: the
        requests ended when it was first placed (:attr:`.slotbook.SlotBook.ends`)."""
        started = self._clock.monotonic()
        async with self._book.queue:
            while True:
                route = await again()
                if not isinstance(route, filling.Route) or route.decision.slot is not None:
                    if self._clock.monotonic() - started >= RECHECK:
                        log.debug("request_held_for_a_slot", seconds=round(self._clock.monotonic() - started, 3))
                    return route
                if self._clock.monotonic() - started >= self._hold:
                    log.warning(
                        "request_held_for_a_slot_too_long",
                        seconds=round(self._clock.monotonic() - started, 1),
                        effect="every slot read busy all along: the request goes to llama-server unpinned, which "
                        "may give it a slot whose conversation is not saved yet",
                        hint="see /status for the slots' requests; raise --proxy-hold-seconds for long generations",
                    )
                    return route
                await self._book.freed(since, RECHECK)
                since = self._book.ends

    async def taken(self, slot: int) -> bool:
        """Whether ``slot`` runs a request now (its save was skipped as busy: another request took it)."""
        polled, _ = self._engine.seen()
        if polled is None:
            return False
        obs = await self._book.fresh(polled)
        return obs is not None and any(v.id == slot and v.processing for v in obs.slots or ())
