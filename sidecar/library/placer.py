"""Route each completion request through the proxy to the slot that holds its KV. I/O.

:class:`Placer` is the proxy's hook: it places each request (:mod:`.choosing`), fills its slot
(:mod:`.filling`), keeps what each slot holds (:mod:`.slotbook`) and counts the answer (:mod:`.tally`).
Any failure forwards the request as it came, unpinned. Invariants and trade-offs: docs/modules.md,
`sidecar/library/placer.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from sidecar.core import apikeys, config, errors, events, metrics, outcomes, protocols
from sidecar.library import (
    choosing,
    claims,
    fetching,
    filling,
    prompt,
    ramtier,
    ramuse,
    seams,
    slotbook,
    slotstate,
    tally,
    verdict,
)
from sidecar.observe import memory
from sidecar.proxy import answer, tickets
from sidecar.snapshots import manifest, slotfile, store


@dataclasses.dataclass(slots=True)
class Placed:
    """One request's placement (``relay.Placement``): the body to forward, and its answer's verdict."""

    body: bytes
    header: str
    plan: choosing.Plan | None
    ended: answer.Ended | None = None
    """How its answer ended, once the relay said."""
    later: bool = False
    """Not placed: the request waits for the whole restore round first (see :meth:`Placer.pin`)."""

    @property
    def counted(self) -> bool:
        """Whether the library counts the request by its answer's reuse figure: not one it did not route."""
        return self.plan is not None

    def answered(self, ended: answer.Ended) -> None:
        self.ended = ended


class Placer:
    def __init__(
        self,
        *,
        engine: seams.Slots,
        tokenizer: seams.Tokenizer,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        shared: seams.Shared | None = None,
        hold_seconds: float = 120.0,
        isolated: bool = False,
        ram: ramtier.RamTier | None = None,
        max_unsaved_seconds: float = config.MAX_UNSAVED_SECONDS,
    ) -> None:
        """``isolated``: llama-server has API keys, and each owner's conversations are kept from the others'
        (a request the library does not put on its own KV is sent with ``cache_prompt`` off). ``ram``: what
        llama-server's RAM prompt cache holds (none: the library swaps every returning conversation from disk).
        ``max_unsaved_seconds``: once that cache has shown itself, a conversation leaves its slot for it with no
        save first while what a crash would lose of it re-prefills within this many seconds (0: always saved)."""
        self._isolated = isolated
        self._engine = engine
        self._snapshots = snapshots
        self._clock = clock
        loop = asyncio.get_running_loop()
        fetcher = (
            fetching.Fetcher(shared, snapshots=snapshots, stats=stats, hold_seconds=hold_seconds)
            if shared is not None
            else None
        )
        use = ramuse.RamUse(
            tier=ram if ram is not None else ramtier.RamTier(0),
            snapshots=snapshots,
            stats=stats,
            max_unsaved=max_unsaved_seconds,
        )
        self._tally = tally.Tally(stats=stats, engine=engine, ram=use)
        self._claims = claims.Claims(engine)
        self._book = slotbook.SlotBook(
            engine=engine, snapshots=snapshots, ram=use, tally=self._tally, loop=loop, claim_book=self._claims
        )
        filler = filling.Filler(
            engine=engine,
            snapshots=snapshots,
            stats=stats,
            book=self._book,
            ram=use,
            fetcher=fetcher,
            isolated=isolated,
            loop=loop,
        )
        self._chooser = choosing.Chooser(
            engine=engine,
            tokenizer=tokenizer,
            snapshots=snapshots,
            stats=stats,
            clock=clock,
            book=self._book,
            filler=filler,
            tally=self._tally,
            ram=use,
            fetcher=fetcher,
            hold_seconds=hold_seconds,
        )
        engine.follow(self)  # the engine tells the placer, which asks it: one of the two exists first

    # ---- what the engine tells: listeners.SlotListener -----------------------------------

    def emptied(self) -> None:
        self._book.emptied()

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        self._book.restored(slot, record)

    def rewound(self, slot: int, before: events.SlotContent, after: events.SlotContent) -> None:
        self._book.slot(slot).rewound(before, after)

    def owner(self, slot: int) -> str | None:
        return self._book.owner(slot)

    # ---- the proxy's hook -----------------------------------------------------------------

    async def prepare(self, raw_path: str, body: bytes, *, owner: str = apikeys.NOBODY) -> str | None:
        """Have the token ids of a request held at the restore gate read while the server restores its slots.

        Ids depend on no slot: the tokenizer remembers them, and the request's
        placement finds them there instead of asking the server. Returns the
        snapshot file that holds the longest prefix of them, a slot's newest
        or an older one (the restore round restores it first, into the slot
        the request then runs in: the request waits for it only), None if none
        does. Never raises: on any error the placement asks, as it would have.
        """
        try:
            request = prompt.of(raw_path, body)
            if isinstance(request, prompt.Prompt) and not prompt.shorter_than(request, slotfile.BLOCK_TOKENS):
                return self._awaited(slotfile.pack_ids(await self._chooser.ids(request, owner)), owner)
        except Exception:  # noqa: S110 - the placement tokenizes it again and says what failed
            pass
        return None

    def _awaited(self, packed: bytes, owner: str) -> str | None:
        """The snapshot of ``owner``'s that shares the most blocks with the ids ``packed`` (an exact prefix of
        them on a model that cannot cut a state back); the newest among equals."""
        _, identity = self._engine.seen()
        exact = identity is not None and not memory.cuts_back(identity.memory)
        chain = slotfile.prefix_hashes(packed)
        best: tuple[str, int] | None = None
        for record in self._snapshots.snapshots():  # newest first
            if (
                record.owner != owner
                or record.index is None
                or (exact and not slotstate.exact_prefix(record.index, packed))
            ):
                continue
            shared = slotfile.shared_blocks(chain, record.index.chain)
            if shared and (best is None or shared > best[1]):
                best = record.file, shared
        return best[0] if best is not None else None

    @contextlib.asynccontextmanager
    async def pin(
        self, raw_path: str, body: bytes, *, owner: str = apikeys.NOBODY, ticket: tickets.Ticket | None = None
    ) -> AsyncIterator[Placed]:
        """The placement (pinned with ``id_slot``, or as it came); the slot counts busy inside.

        ``owner``: whose request it is; only that owner's conversations serve it. ``ticket``: the request's
        admission, let through by the gate (none: one let through by an open gate); the slot it is pinned to
        is reserved there. ``ticket.within``: the slots a restore round still running has restored (a request
        it let through early): the request is pinned to one of them holding its prefix, or it is ``later``
        (it waits for the whole round), as any other slot may still be restored into.
        """
        if ticket is None:
            ticket = tickets.Ticket()
            ticket.let_through(None)
        self._book.live.add(ticket)
        try:
            async with self._placed(raw_path, body, owner, ticket) as placed:
                yield placed
        finally:
            self._book.ended(ticket)

    @contextlib.asynccontextmanager
    async def _placed(self, raw_path: str, body: bytes, owner: str, ticket: tickets.Ticket) -> AsyncIterator[Placed]:
        """:meth:`pin` for a ticket the placer counts live."""
        plan = await self._chooser.plan(raw_path, body, ticket, owner)
        if not isinstance(plan, choosing.Plan):
            ticket.unreserve()  # not routed: no slot is held for it (a failed swap let its slot go)
        if ticket.within is not None and not isinstance(plan, choosing.Plan):
            yield Placed(body, "", None, later=True)
            return
        if not isinstance(plan, choosing.Plan):
            yield Placed(self._uncached(raw_path, body), verdict.header(None, plan), None)
            return
        forwarded = plan.body or body
        if plan.planned.source is outcomes.Source.COLD:
            forwarded = self._uncached(raw_path, forwarded)
        placed = Placed(forwarded, verdict.header(plan.planned), plan)
        tasks_before: dict[int, int | None] = {}
        try:
            if plan.placed:  # which slot the server gives it is read back after: see _ran_on
                tasks_before = await self._tasks()
            others = frozenset(s for s in tasks_before if s != plan.planned.slot)
            async with self._claims.holding(others, tasks_before):  # see claims: until the server took it
                yield placed
        except asyncio.CancelledError:
            if placed.ended is None:
                placed.ended = answer.Ended(0, outcomes.ProxyOutcome.CANCELLED, None)
            raise
        finally:
            ran_on = plan.planned.slot
            ended = placed.ended
            ok = ran_on is not None and ended is not None and ended.outcome is outcomes.ProxyOutcome.OK
            if plan.placed and ok:
                assert ran_on is not None
                ran_on = await self._ran_on(ran_on, tasks_before)
            self._ended(plan, placed.ended, ran_on)
            if ok:
                self._book.settle()

    def _uncached(self, raw_path: str, body: bytes) -> bytes:
        """``body`` with ``cache_prompt`` off where owners are kept apart: a request the library did not put on
        its owner's own KV must reuse nothing the slot, or llama-server's RAM cache, holds of another's."""
        if not self._isolated:
            return body
        return prompt.uncached(raw_path, body)

    async def _tasks(self) -> dict[int, int | None]:
        """Each slot's last task as llama-server shows it now (empty if it cannot be read)."""
        try:
            return {v.id: v.task for v in await self._engine.fresh_slots()}
        except errors.UpstreamError:
            return {}

    async def _ran_on(self, planned: int, before: dict[int, int | None]) -> int:
        """The slot the server ran a placed request in (``planned`` if unknown).

        llama-server gives an unpinned request the idle slot with the longest
        common prefix, else its least recently used one, whose clock the sidecar
        cannot read: a new conversation may land beside the slot it was placed in.
        It ran in a slot that ran a task since ``before`` (each slot's task
        as the request was sent): ``planned`` if it did, else an idle one with
        the newest task, else one busy again with the next request. The newest
        task alone misled when another slot's turn ended at the same time: the
        conversation was recorded in the other slot, and its next turn was
        swapped in from an older snapshot over its own newest.
        """
        try:
            views = await self._engine.fresh_slots()
        except errors.UpstreamError:
            return planned
        if not before:
            done = [v for v in views if v.task is not None and not v.processing]
            return max(done, key=lambda v: v.task or 0).id if done else planned
        ran = [v for v in views if v.task is not None and v.task != before.get(v.id)]
        if any(v.id == planned for v in ran):
            return planned
        # Idle first, the newest task first; a slot busy again ran it and took the request llama-server had
        # queued behind it (read back as "planned", the turn was recorded in a slot it never ran in).
        ran.sort(key=lambda v: (not v.processing, v.task or 0))
        return ran[-1].id if ran else planned

    def _ended(self, plan: choosing.Plan, ended: answer.Ended | None, ran_on: int | None) -> None:
        """Count the request by its own answer, and record what the slot it ran in holds now."""
        slot = plan.planned.slot
        if slot is not None:
            self._book.slot(slot).used = self._clock.monotonic()
            slot = ran_on
        if ended is not None:
            self._tally.answered(plan.planned, ended, slot)
        if slot is None:
            return
        state = self._book.slot(slot)
        state.used = self._clock.monotonic()
        state.routed_since = True  # its content changed by a routed request: see SlotBook.fresh
        state.restored = None  # the server ran a prompt there: it holds its own checkpoints of it
        if ended is not None and ended.outcome is outcomes.ProxyOutcome.OK and ended.status < 400:
            state.holds(plan.chain, plan.turn, plan.owner)
            state.ended = self._clock.wall()
        elif ended is None or ended.outcome is not outcomes.ProxyOutcome.OK:
            state.holds(())  # cut, cancelled or sent again elsewhere: what the slot holds is unknown
            state.ended = self._clock.wall()
