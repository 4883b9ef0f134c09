"""Fill the slot a request was routed to: save what it held first, then swap from the library or fetch. I/O.

Nothing is lost to a swap: a slot's changed content is saved first, through the engine's one road for
slot actions, unless it leaves for llama-server's RAM cache within ``--max-unsaved-seconds``
(:mod:`.ramuse`). A shared store's snapshot downloads while the slot is saved (:mod:`.fetching`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import structlog

from sidecar.core import errors, events, metrics, outcomes
from sidecar.library import fetching, prompt, ramtier, ramuse, routing, seams, slotbook, slotstate
from sidecar.save import policy
from sidecar.shared import records
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.library")
IDLE_READS = 3
"""Reads of the slots before a request llama-server places itself is sent: each saves what the one before found."""


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes (``Chooser``'s route), and what its slot is filled from."""

    decision: routing.Decision
    views: dict[int, events.SlotView]
    """The slots as last read, by id."""
    counters: events.Counters | None
    library: dict[str, tuple[manifest.Manifest, tuple[str, ...]]]
    """The snapshots the request may be swapped from, by file."""
    shared: records.SharedRecord | None
    """The shared store's snapshot fetched for it, if any."""
    in_ram: ramtier.Held | None
    """The conversation llama-server's RAM prompt cache holds for it, if any."""
    chain: tuple[str, ...] = ()
    """The request's hash chain (the RAM copy's, for a turn placed by it)."""


class Filler:
    def __init__(
        self,
        *,
        engine: seams.Slots,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        book: slotbook.SlotBook,
        ram: ramuse.RamUse,
        fetcher: fetching.Fetcher | None,
        isolated: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._engine = engine
        self._snapshots = snapshots
        self._stats = stats
        self._book = book
        self._ram = ram
        self._fetcher = fetcher
        self._isolated = isolated
        self._loop = loop

    async def fill(
        self, request: prompt.Prompt, route: Route, state: slotstate.SlotState, owner: str
    ) -> tuple[int | None, outcomes.Source]:
        """Put the request's prefix into its slot, saving what the slot held first if it changed.

        Returns the tokens restored (0: none needed) and where the prefix came from; None: the slot could
        not be saved or restored.
        """
        decision, views, counters = route.decision, route.views, route.counters
        assert decision.slot is not None
        source = decision.source
        if source is outcomes.Source.SHARED:
            assert decision.entry is not None
            assert route.shared is not None
            async with self._leaving(state, decision, owner):
                restored, source = await self._fetch_in(decision, route.shared, views[decision.slot], counters)
            if source is outcomes.Source.COLD:
                state.holds(())
            return restored, source
        if source is outcomes.Source.LIBRARY:
            assert decision.entry is not None
            record = route.library[decision.entry.file][0]
            async with self._leaving(state, decision, owner):
                restored = await self._swap(decision, record, views[decision.slot], counters)
            state.restored = record.index if restored else None
            if restored == 0:  # the snapshot did not go in, the slot's own content is saved: it runs cold there
                state.holds(())
                return 0, outcomes.Source.COLD
            return restored, source
        async with state.lock:  # a swap into this slot in flight ends first
            restored = 0 if await self._save_for(request, route) else None
        if restored is not None and source is not outcomes.Source.SLOT:
            # A task of another conversation starts there: the server copies what the slot held into
            # its RAM prompt cache first.
            self._ram.left(state, views[decision.slot].tokens)
            state.holds(())
            if source is outcomes.Source.RAM and route.in_ram is not None:
                self._ram.loaded(route.in_ram)  # and takes this one out of it, into the slot
                state.holds(route.in_ram.chain, owner=owner)
        return restored, source

    @contextlib.asynccontextmanager
    async def _leaving(self, state: slotstate.SlotState, decision: routing.Decision, owner: str) -> AsyncIterator[None]:
        """Hold the slot's lock for a swap of ``decision.entry`` (of ``owner``'s) into it; while the swap saves what
        the slot held first, that conversation is said to be leaving it (:attr:`.slotstate.SlotState.leaving`):
        its next request, routed meanwhile, waits for the save instead of taking an older snapshot of it."""
        assert decision.entry is not None
        previous = (state.chain, state.owner) if decision.save_first and state.chain else None
        state.holds(decision.entry.prefix, owner=owner)  # its requests wait at the lock
        async with state.lock:
            state.leaving = previous
            try:
                yield
            finally:
                state.leaving = None

    async def _fetch_in(
        self,
        decision: routing.Decision,
        shared: records.SharedRecord,
        view: events.SlotView,
        counters: events.Counters | None,
    ) -> tuple[int | None, outcomes.Source]:
        """Fetch ``shared`` and swap it into the decision's slot: (tokens restored, None if something would be
        lost; where the prefix came from).

        The download runs while the slot's own content is saved (a call to llama-server, the download a
        transfer from the store into a file of its own): the request waits for the longer of the two, not
        for both. The restore waits for both.
        """
        assert decision.slot is not None
        assert self._fetcher is not None
        download = self._loop.create_task(self._fetcher.download(shared, slot=decision.slot), name="placer-fetch")
        download.add_done_callback(slotbook.retrieved)  # cancelled unawaited when the save fails
        try:
            if decision.save_first and not await self._save(view):
                return None, outcomes.Source.SHARED
            record = await download
        finally:
            download.cancel()  # no-op once it is done: the request goes on without it only when the save failed
        if record is None:
            return 0, outcomes.Source.COLD  # the slot's own content is saved: it runs cold there
        later = dataclasses.replace(decision, save_first=False)
        restored = await self._swap(later, record, view, counters, checked=True)
        return restored, outcomes.Source.SHARED if restored != 0 else outcomes.Source.COLD

    async def _swap(
        self,
        decision: routing.Decision,
        record: manifest.Manifest,
        view: events.SlotView,
        counters: events.Counters | None,
        *,
        checked: bool = False,
    ) -> int | None:
        """Save the slot's own content if it changed, then restore ``record`` into it: the tokens restored; 0: the
        restore failed with the slot's content saved (the request runs cold there, pinned); None: the save failed,
        or a request took the slot meanwhile (it is placed again).

        A failed restore used to send the request as it came: llama-server then gave it the idle slot of its
        choice, and another conversation's newest turn there, not saved yet, was lost.

        ``checked``: ``record`` was committed just now (fetched from the shared store), not hashed again."""
        assert decision.slot is not None
        started = time.perf_counter()
        # With a block store the snapshot is rebuilt while the slot's own content is saved: the swap waits
        # for the longer of the two, not for both.
        ahead = decision.save_first and self._engine.rebuild_ahead(record)
        try:
            with self._snapshots.recency.using(record.file):
                if decision.save_first and not await self._save(view):
                    return None
                result = await self._engine.swap_in(decision.slot, record, counters=counters, checked=checked)
        finally:
            if ahead:
                self._engine.rebuilt_ahead_done(record)
        if not result.restored:
            if result.result in (outcomes.RestoreOutcome.SLOT_BUSY, outcomes.RestoreOutcome.RACED):
                return None
            log.warning(
                "swap_failed_runs_cold",
                slot=decision.slot,
                file=record.file,
                result=result.result.value,
                reason=result.detail,
                effect="the request goes to that slot without the snapshot, prefilled by llama-server (if llama-server "
                "is down, it waits for the restart and is placed again); what the slot held was saved first",
            )
            return 0
        seconds = time.perf_counter() - started
        self._book.slot(decision.slot).seen = None  # restored: its (task, tokens) are read afresh next time
        self._snapshots.recency.touch(record.file)
        self._stats.swap_duration.observe(seconds)  # its tokens count as served once the answer shows them reused
        log.info(
            "conversation_swapped_in",
            slot=decision.slot,
            conversation=record.index.key if record.index is not None else "",
            file=record.file,
            tokens=result.tokens,
            saved_first=decision.save_first,
            seconds=round(seconds, 4),
        )
        return result.tokens

    async def _save(self, view: events.SlotView) -> bool:
        """Save what ``view``'s slot holds before it is given another conversation; True if nothing is lost."""
        if (view.signature is None or view.tokens == 0) and not self._book.ended_unsaved(
            view.id, self._book.slot(view.id)
        ):
            return True
        if view.tokens > 0 and not self._engine.worth_saving(view.tokens):
            return True  # not worth a file (--min-tokens): the policy would not save it either
        # The poll's view may be older than a routed request that ended there: the engine reads the slot
        # afresh before it saves, and saves what it holds then.
        signature = view.signature if view.signature is not None else events.UNREAD
        return await self._engine.save(policy.Save(view.id, signature, view.tokens, policy.SaveReason.SWAP))

    async def _save_for(self, request: prompt.Prompt, route: Route) -> bool:
        """Save what the slot a request goes to holds, if it changed; True if nothing is lost.

        Not saved when it leaves for llama-server's RAM cache and what a crash would lose of it re-prefills
        within ``--max-unsaved-seconds`` (:meth:`.ramuse.RamUse.leaves_unsaved`). A request the route cannot pin
        (``Pin.PLACED``) goes to the idle slot of the server's choice: the one with the longest common prefix,
        else its least recently used. Unless the slot it was placed in holds more of it than any other idle
        slot, every idle slot's changed content is saved first (:meth:`_contested`).
        """
        decision, views = route.decision, route.views
        assert decision.slot is not None
        view = views[decision.slot]
        _, identity = self._engine.seen()
        leaves = decision.source is not outcomes.Source.SLOT and self._ram.leaves_unsaved(
            self._book.slot(view.id), view, route.counters, identity.memory if identity is not None else None
        )
        if decision.save_first and not leaves and not await self._save(view):
            return False
        if request.pin is not prompt.Pin.PLACED or not self._contested(decision, views, route.chain):
            return True
        return await self._save_idle(views, but=decision.slot)

    def _contested(self, decision: routing.Decision, views: dict[int, events.SlotView], chain: tuple[str, ...]) -> bool:
        """Whether llama-server may give a request it places itself another idle slot than ``decision.slot``.

        It gives the idle slot whose tokens share the longest prefix with the request's. The slot the request was
        placed in wins only if it holds more whole blocks of it than any other idle slot, whose content is known:
        a new conversation that shares only the common system prompt with both slots may go to either (the soak,
        seed 7: it went to the other one, over a turn that had just ended there, in no snapshot). A slot busy when
        the route read the slots counts too: its turn may end before the request reaches the server (the soak,
        seed 7, 60 minutes: it ended during the planned slot's save, and the server gave the request that slot).
        """
        if decision.source is not outcomes.Source.SLOT:
            return True
        for view in views.values():
            if view.id == decision.slot:
                continue
            if view.processing:
                return True
            if view.tokens == 0:
                continue
            held = self._book.slot(view.id).chain
            if not held or slotfile.shared_blocks(chain, held) >= decision.blocks:
                return True
        return False

    async def _save_idle(self, views: dict[int, events.SlotView], *, but: int) -> bool:
        """Save every slot but ``but`` that is idle with changed content, read afresh until a read finds none; True
        if nothing is lost.

        llama-server gives a request it places itself the idle slot of its choice when the request reaches it. A
        routed turn may end on another slot meanwhile (during the save above, under load for a second): that slot
        is idle by then, its turn unsaved, though its request is still relayed (its ticket is live). The route's
        views predate that, so each pass reads the slots again. A slot a swap is filling is left to the swap; one
        that turned busy before its save is not saved (the server cannot give it away), the next read says so.
        """
        for _ in range(IDLE_READS):
            views = await self._read(views)
            unsaved = self._unsaved_idle(views, but)
            if not unsaved:
                return True
            for view in unsaved:
                await self._save(view)
        return not self._unsaved_idle(await self._read(views), but)

    async def _read(self, views: dict[int, events.SlotView]) -> dict[int, events.SlotView]:
        """The slots read afresh; ``views`` if they cannot be read (what was last read is all there is)."""
        try:
            return {v.id: v for v in await self._engine.fresh_slots()}
        except errors.UpstreamError:
            return views

    def _unsaved_idle(self, views: dict[int, events.SlotView], but: int) -> list[events.SlotView]:
        return [
            v
            for v in views.values()
            if v.id != but and not v.processing and not self._book.slot(v.id).lock.locked() and self._book.held(v).dirty
        ]

    async def clear_for(self, owner: str, views: dict[int, events.SlotView], *, slot: int, keep: bool) -> None:
        """Empty every idle slot that holds another owner's KV, for a request the server places itself.

        llama-server gives an unpinned request the idle slot with the longest common prefix and reuses
        it: with owners kept apart, no slot it could pick may hold what is not ``owner``'s. Each slot's
        content is saved first if it changed (nothing is lost), and comes back from the library for its
        owner's next request. ``slot``: the one the request was placed in (``keep``: it holds ``owner``'s KV).
        """
        if not self._isolated:
            return
        for view in views.values():
            state = self._book.slot(view.id)
            if view.id == slot and keep:
                continue
            if view.processing or (self._book.pinned(view.id) and view.id != slot) or state.lock.locked():
                continue
            if view.signature is None or view.tokens == 0 or state.owner == owner:
                continue
            async with state.lock:
                if await self._save(view) and await self._engine.erase(view.id):
                    state.holds(())
                    state.seen = None
                    continue
            log.warning(
                "slot_not_cleared",
                slot=view.id,
                effect="another owner's conversation stays in a slot llama-server may give this request (it could "
                "not be saved, or the slot was taken meanwhile)",
            )
