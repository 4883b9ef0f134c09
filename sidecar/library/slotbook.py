"""What the placer knows each slot holds: what the engine tells it, its reads of ``/slots``. I/O.

Each slot's state is a :class:`.slotstate.SlotState`; a slot is busy while a live request reserves it
(:meth:`SlotBook.pinned`) or a swap holds its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Collection
from typing import Any

from sidecar.core import apikeys, errors, events, outcomes, tasks
from sidecar.library import claims, prompt, ramuse, routing, seams, slotstate, tally
from sidecar.proxy import tickets
from sidecar.snapshots import manifest, slotfile, store


class SlotBook:
    def __init__(
        self,
        *,
        engine: seams.Slots,
        snapshots: store.SnapshotStore,
        ram: ramuse.RamUse,
        tally: tally.Tally,
        loop: asyncio.AbstractEventLoop,
        claim_book: claims.Claims,
    ) -> None:
        self._engine = engine
        self._snapshots = snapshots
        self._ram = ram
        self._tally = tally
        self._loop = loop
        self.states: dict[int, slotstate.SlotState] = {}
        """Each slot's state, by id."""
        self._reads: set[asyncio.Task[Any]] = set()
        """Reads of /slots running in the background (after a request ended, or sent early for one), held to their
        end: the event loop keeps no strong reference to a task."""
        self.live: set[tickets.Ticket] = set()
        """The requests inside ``Placer.pin``: a slot is pinned while one of them reserves it (:meth:`pinned`)."""
        self.queue = asyncio.Lock()
        """Held by the request placed next among those no slot could take (every one busy): they are placed in the
        order they came (an ``asyncio.Lock`` wakes its waiters first in, first out), as llama-server queues them."""
        self.ends = 0
        """Requests inside ``Placer.pin`` that ended so far: a held request waits for the next (:meth:`freed`)."""
        self._freed = asyncio.Event()
        """Set when a request the placer knew of ended: a slot may have freed."""
        self._claims = claim_book
        """The slots a request llama-server places itself may be given, until it started: pinned meanwhile."""
        claim_book.on_release(self._wake)
        snapshots.subscribe(self._committed)

    # ---- what the engine tells: listeners.SlotListener -----------------------------------

    def emptied(self) -> None:
        for state in self.states.values():
            state.holds(())
            state.ended, state.seen, state.restored = 0.0, None, None
        self._ram.restarted()

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        state = self.slot(slot)
        state.holds(record.index.chain if record.index is not None else (), owner=record.owner)
        state.seen = None
        state.restored = record.index

    def owner(self, slot: int) -> str | None:
        state = self.states.get(slot)
        return state.owner if state is not None else None

    def _committed(self, record: manifest.Manifest) -> None:
        """A save of a slot read idle: the slot holds what the snapshot holds (called from a worker thread)."""
        if record.index is not None:
            seen = (record.task, record.tokens) if record.task is not None else None
            self._loop.call_soon_threadsafe(self._holds, record.slot, record.index.chain, seen, record.owner)

    def _holds(
        self, slot: int, chain: tuple[str, ...], seen: tuple[int, int] | None = None, owner: str = apikeys.NOBODY
    ) -> None:
        state = self.slot(slot)
        if self.pinned(slot) or state.lock.locked():
            return
        shared = slotfile.shared_blocks(chain, state.chain)
        if shared == len(state.chain):
            state.holds(chain, state.turn, owner)  # the prompt routed there plus what the server generated after it
        elif shared == len(chain) and seen is not None:
            # Brought back to its prompt's boundary before the save (``save.boundary``): the engine's own
            # turn on the slot, not another client's.
            state.holds(chain, state.turn, owner)
        else:
            return
        if seen is not None:  # read idle after the routed request: a later change is another client's
            state.seen, state.routed_since = seen, False

    # ---- requests held for a slot -------------------------------------------------------

    def ended(self, ticket: tickets.Ticket) -> None:
        """A request inside ``Placer.pin`` ended: the slot it held may be free, a held request is placed again."""
        self.live.discard(ticket)
        self._wake()

    def _wake(self) -> None:
        self.ends += 1
        self._freed.set()

    async def freed(self, since: int, within: float) -> None:
        """Return once a request the placer knew of ended after :attr:`ends` was ``since``, or after ``within``
        seconds (a slot a client of llama-server's own ran in frees with no word to the placer: the next read of
        ``/slots`` shows it)."""
        if self.ends != since:
            return
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._freed.wait()

    # ---- reads of /slots ------------------------------------------------------------------

    def settle(self) -> None:
        """Read the slots once a routed request ended, off its path: a change after this read is another client's.

        Without it, a turn another client runs in the slot before the next
        placement's read looks like the routed request's own change, and
        the slot would count as still holding the routed conversation.
        """
        polled, _ = self._engine.seen()
        if polled is None or polled.slots is None:
            return
        task = tasks.watch(
            self._loop.create_task(self.fresh(polled, quiet=True), name="placer-settle"),
            effect="the slots were not read after a routed request ended: the next placement reads them",
        )
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def read_early(self, raw_path: str, body: bytes) -> asyncio.Task[tuple[events.SlotView, ...]] | None:
        """The fresh read of ``/slots`` that a request continuing a slot's conversation needs, sent now:
        llama-server answers it while the body is parsed and its messages hashed, instead of after them.

        Sent only where the request may well continue a slot's conversation: some idle slot ran a routed
        turn, and the body looks routable from its bytes (:func:`.prompt.may_route`). A request
        that turns out not to continue leaves the answer unread (the engine's policy still follows
        it), and is placed on a read of its own, made after its tokens.
        """
        if not prompt.may_route(raw_path, body, slotfile.BLOCK_TOKENS) or not any(
            state.turn is not None and not self.pinned(slot) and not state.lock.locked()
            for slot, state in self.states.items()
        ):
            return None
        read = self._loop.create_task(self._engine.fresh_slots(), name="placer-early-read")
        self._reads.add(read)  # the loop keeps no strong reference: a read no request awaits would be collected
        read.add_done_callback(self._reads.discard)
        read.add_done_callback(retrieved)
        await asyncio.sleep(0)  # the read goes out before the parse holds the loop
        return read

    async def fresh(
        self,
        obs: events.Observation,
        *,
        quiet: bool = False,
        early: asyncio.Task[tuple[events.SlotView, ...]] | None = None,
    ) -> events.Observation | None:
        """``obs`` with the slots as llama-server shows them now; None (request unrouted) if it cannot say.

        The poll's view may predate a turn that ended since (sent straight to
        llama-server, or through the proxy unrouted): read afresh, that turn
        counts as unsaved (the engine's policy follows this read), so a slot
        is never given away without saving it, and a slot whose content
        changed by a turn the placer did not route no longer counts as
        holding the prefix the placer routed there. ``quiet``: a read after a
        request ended, with no request to count as unrouted if it fails.
        ``early``: the read already sent for the request (:meth:`read_early`).
        """
        try:
            slots = await (early if early is not None else self._engine.fresh_slots())
        except errors.UpstreamError as exc:
            if not quiet:
                self._tally.unrouted(outcomes.Unrouted.ERROR, f"cannot read /slots before placing the request: {exc}")
            return None
        for view in slots:
            state = self.slot(view.id)
            if self.pinned(view.id) or state.lock.locked():
                continue  # a routed request or a swap is changing it: the placer knows what it holds
            if state.seen is not None and view.signature != state.seen and not state.routed_since:
                # Another client's turn ran there, or --cache-idle-slots emptied it: the server copied
                # what it held into its RAM prompt cache first.
                self._ram.left(state, state.seen[1])
                state.holds(())
            state.seen, state.routed_since = view.signature, False
        return dataclasses.replace(obs, slots=slots)

    # ---- what a slot holds for routing ----------------------------------------------------

    def held(
        self,
        view: events.SlotView,
        exact_for: bytes | None = None,
        within: frozenset[int] | None = None,
        *,
        owner: str = apikeys.NOBODY,
        going_on: Collection[int] = (),
    ) -> routing.Held:
        """What ``view``'s slot holds for routing a request of ``owner``; ``exact_for``: the request's ids, on a
        model that cannot cut a state back (a slot holding only a restored snapshot then counts only if it is
        an exact prefix); ``within``: the only slots the request may go to (any other counts busy); ``going_on``:
        the slots whose conversation the request is (:meth:`slotstate.SlotState.same_conversation`)."""
        state = self.slot(view.id)
        prefix = state.holds_for(owner)
        if state.lock.locked() and state.leaving_for(owner):
            prefix = state.leaving_for(owner)  # busy: its request waits for the save under way, not an older one
        elif (
            exact_for is not None
            and state.restored is not None
            and not slotstate.exact_prefix(state.restored, exact_for)
        ):
            prefix = ()
        return routing.Held(
            slot=view.id,
            prefix=prefix,
            busy=view.processing
            or self.pinned(view.id) > 0
            or state.lock.locked()
            or (within is not None and view.id not in within),
            last_used=state.used,
            dirty=self._dirty(view, state),
            continued=view.id in going_on,
        )

    def ended_unsaved(self, slot: int, state: slotstate.SlotState) -> bool:
        """Whether a routed request ended in ``slot`` after its newest snapshot was made."""
        newest = next(iter(self._snapshots.snapshots(slot)), None)
        return state.ended > (newest.created if newest is not None else 0.0)

    def _dirty(self, view: events.SlotView, state: slotstate.SlotState) -> bool:
        """Whether the slot holds content no snapshot has: a routed request ended after its newest snapshot."""
        if self.ended_unsaved(view.id, state):
            return True  # whatever the poll's view says: it may predate that request
        if view.signature is None or view.tokens == 0:
            return False  # empty, or holds only what a restore round put there
        return self._engine.unsaved(view.id)

    def pinned(self, slot: int) -> int:
        """Requests that hold ``slot`` now: the live tickets that reserve it, and the claims of requests llama-server
        places itself (:mod:`.claims`)."""
        return sum(1 for ticket in self.live if ticket.slot == slot) + self._claims.count(slot)

    def slot(self, slot: int) -> slotstate.SlotState:
        return self.states.setdefault(slot, slotstate.SlotState())


def retrieved(read: asyncio.Task[Any]) -> None:
    """An early read (or a fetch) no request awaited: its error was the placement's to count, had it needed it."""
    if not read.cancelled():
        read.exception()
