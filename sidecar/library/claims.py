"""The slots a request llama-server places itself may be given, kept from other requests until it started.

llama-server drops ``id_slot`` on Anthropic Messages and gives such a request the idle slot of its own
choice (the longest common prefix, else its least recently used). The library reserves the slot it placed
the request in, but the server may pick another idle one. A request the library pinned to that other slot
meanwhile is queued by the server behind it and starts there the moment it ends, over its turn, with no save
between (the soak, seed 7: 0 of 831 tokens reused after the next kill). So from the moment such a request is
sent until a read of ``/slots`` shows a task started since, the other idle slots count busy too: a request
routed then is held, and placed once the claim ends. I/O (the reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

from sidecar.core import errors, tasks
from sidecar.library import seams

READ_EVERY = 0.1
"""Seconds between two reads of ``/slots`` while a claim holds."""
BOUND = 5.0
"""Seconds a claim holds at most: a request llama-server queued (every slot busy) claims nothing it needs."""


class Claims:
    def __init__(self, engine: seams.Slots) -> None:
        self._engine = engine
        self._released: Callable[[], None] = lambda: None
        self._held: dict[int, frozenset[int]] = {}
        self._ids = itertools.count()

    def on_release(self, released: Callable[[], None]) -> None:
        """Call ``released`` when a claim ends (requests held for a slot look again)."""
        self._released = released

    def count(self, slot: int) -> int:
        """Claims that hold ``slot`` now."""
        return sum(1 for slots in self._held.values() if slot in slots)

    @contextlib.asynccontextmanager
    async def holding(self, slots: frozenset[int], before: dict[int, int | None]) -> AsyncIterator[None]:
        """Hold ``slots`` from other requests until a task started since ``before`` (each slot's task as the
        request was sent), :data:`BOUND` seconds went by, or the request ended."""
        if not slots or not before:
            yield
            return
        key = next(self._ids)
        self._held[key] = slots
        watch = tasks.watch(
            asyncio.create_task(self._until_started(key, before), name="placer-claim"),
            effect="a claim on the slots a placed request may take ends with the request instead",
        )
        try:
            yield
        finally:
            watch.cancel()
            self._release(key)

    async def _until_started(self, key: int, before: dict[int, int | None]) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + BOUND
        try:
            while loop.time() < until:
                await asyncio.sleep(READ_EVERY)
                try:
                    views = await self._engine.fresh_slots()
                except errors.UpstreamError:
                    continue
                if any(v.task is not None and v.task != before.get(v.id) for v in views):
                    return  # the server took a request since: most likely this one, in the slot it chose
        finally:
            self._release(key)

    def _release(self, key: int) -> None:
        if self._held.pop(key, None) is not None:
            self._released()
