"""Route each completion request through the proxy to the slot that holds its KV. I/O.

For each completion request the proxy hands over (once the restore gate is
open), the :class:`Placer`:

0. pins a request that continues the conversation an idle slot ran last
   (:mod:`.turns`: the same messages and more, from the body alone) to that
   slot, with no round trip to llama-server but a read of ``/slots``, sent
   as the request comes in so that the server answers it while the body is
   parsed (:meth:`Placer._read_early`); every other request goes on to

1. gets the prompt's token ids from llama-server (:mod:`.prompt` says how)
   and chains block hashes over them (``slotfile.prefix_hashes``);
2. describes each slot: what it holds as far as the sidecar knows (the
   prompts routed there, the snapshots restored into it), whether it is busy
   (processing, running a routed request that has not ended, or being
   swapped), when it was last used, whether it changed since its last
   snapshot;
3. asks :func:`.routing.route` where the request should run, and
4. pins it there with ``id_slot``. For a swap it first saves the slot's own
   content if it changed (nothing is lost to a swap), then restores the
   library snapshot into it, both through the engine's one road for slot
   actions. A new conversation's slot is saved first in the same way.

With a shared store, when the best local prefix (a slot's or the
library's) is shorter than one the store holds and fetching it beats
prefilling the difference (:mod:`.fetching`), the Placer downloads it into
the chosen idle slot's name while the request waits, then swaps it in like
a library snapshot; a store that is down, slow or wrong costs the request
at most the lookup's or the download's bound: it then runs cold.

What the Placer knows of each slot is a :class:`.slotstate.SlotState`; what
it asks of the engine, the tokenizer and the store is in :mod:`.seams`.

Swaps of different slots run side by side up to the slot action itself
(llama-server runs one at a time anyway); two requests never swap into one
slot at once: a slot being swapped or running a routed request counts as
busy. Only hashes are kept: the ids and the prompt never leave the request.
Any failure (tokenize, a swap, anything unexpected) forwards the request as
it came, unpinned: it is counted in ``conversation_unrouted_total`` and
logged once per reason, and the client never sees an error from routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import structlog

from sidecar.act import policy, savings
from sidecar.core import apikeys, config, errors, events, metrics, outcomes, protocols, tasks
from sidecar.library import fetching, prompt, ramtier, routing, seams, slotstate, turns, verdict
from sidecar.observe import memory
from sidecar.proxy import answer, tickets
from sidecar.shared import records
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.library")


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    planned: verdict.Planned
    chain: tuple[str, ...]
    turn: turns.Key | None
    body: bytes
    """The body to forward; b"": as it came (every slot busy, or a route that drops ``id_slot``)."""
    owner: str = apikeys.NOBODY
    """Whose request it is: the slot holds that owner's conversation once it ends."""
    placed: bool = False
    """Not pinned (``prompt.Pin.PLACED``): the server chose the slot, which is read back after the answer."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    """Where a request goes (:meth:`Placer._route`), and what its slot is filled from."""

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


@dataclasses.dataclass(slots=True)
class Placed:
    """One request's placement (``relay.Placement``): the body to forward, and its answer's verdict."""

    body: bytes
    header: str
    plan: _Plan | None
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
        self._ram = ram if ram is not None else ramtier.RamTier(0)
        self._max_unsaved = max_unsaved_seconds
        self._ram_said: set[ramtier.State] = set()
        self._engine = engine
        self._fetcher = (
            fetching.Fetcher(shared, snapshots=snapshots, stats=stats, hold_seconds=hold_seconds)
            if shared is not None
            else None
        )
        self._tokenizer = tokenizer
        self._snapshots = snapshots
        self._stats = stats
        self._clock = clock
        self._slots: dict[int, slotstate.SlotState] = {}
        self._said: set[str] = set()
        self._unrouted_counts = {
            reason: stats.conversation_unrouted.labels(reason.value) for reason in outcomes.Unrouted
        }
        self._reads: set[asyncio.Task[Any]] = set()
        """Reads of /slots running in the background (after a request ended, or sent early for one), held to their
        end: the event loop keeps no strong reference to a task."""
        self._live: set[tickets.Ticket] = set()
        """The requests inside :meth:`pin`: a slot is pinned while one of them reserves it (:meth:`_pinned`)."""
        self._loop = asyncio.get_running_loop()
        engine.follow(self)  # the engine tells the placer, which asks it: one of the two exists first
        snapshots.subscribe(self._committed)

    # ---- what the engine tells: listeners.SlotListener -----------------------------------

    def emptied(self) -> None:
        for state in self._slots.values():
            state.holds(())
            state.ended, state.seen, state.restored = 0.0, None, None
        self._ram.restarted()
        self._stats.ram_conversations.set(0)

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        state = self._slot(slot)
        state.holds(record.index.chain if record.index is not None else (), owner=record.owner)
        state.seen = None
        state.restored = record.index

    def owner(self, slot: int) -> str | None:
        state = self._slots.get(slot)
        return state.owner if state is not None else None

    def _committed(self, record: manifest.Manifest) -> None:
        """A save of a slot read idle: the slot holds what the snapshot holds (called from a worker thread)."""
        if record.index is not None:
            seen = (record.task, record.tokens) if record.task is not None else None
            self._loop.call_soon_threadsafe(self._holds, record.slot, record.index.chain, seen, record.owner)

    def _holds(
        self, slot: int, chain: tuple[str, ...], seen: tuple[int, int] | None = None, owner: str = apikeys.NOBODY
    ) -> None:
        state = self._slot(slot)
        if self._pinned(slot) or state.lock.locked():
            return
        shared = slotfile.shared_blocks(chain, state.chain)
        if shared == len(state.chain):
            state.holds(chain, state.turn, owner)  # the prompt routed there plus what the server generated after it
        elif shared == len(chain) and seen is not None:
            # Brought back to its prompt's boundary before the save (``act.boundary``): the engine's own
            # turn on the slot, not another client's.
            state.holds(chain, state.turn, owner)
        else:
            return
        if seen is not None:  # read idle after the routed request: a later change is another client's
            state.seen, state.routed_since = seen, False

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
                return self._awaited(slotfile.pack_ids(await self._ids(request, owner)), owner)
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
        self._live.add(ticket)
        try:
            async with self._placed(raw_path, body, owner, ticket) as placed:
                yield placed
        finally:
            self._live.discard(ticket)

    @contextlib.asynccontextmanager
    async def _placed(self, raw_path: str, body: bytes, owner: str, ticket: tickets.Ticket) -> AsyncIterator[Placed]:
        """:meth:`pin` for a ticket the placer counts live."""
        plan = await self._plan(raw_path, body, ticket, owner)
        if not isinstance(plan, _Plan):
            ticket.unreserve()  # not routed: no slot is held for it (a failed swap let its slot go)
        if ticket.within is not None and not isinstance(plan, _Plan):
            yield Placed(body, "", None, later=True)
            return
        if not isinstance(plan, _Plan):
            yield Placed(self._uncached(raw_path, body), verdict.header(None, plan), None)
            return
        forwarded = plan.body or body
        if plan.planned.source is outcomes.Source.COLD:
            forwarded = self._uncached(raw_path, forwarded)
        placed = Placed(forwarded, verdict.header(plan.planned), plan)
        try:
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
                ran_on = await self._ran_on(ran_on)
            self._ended(plan, placed.ended, ran_on)
            if ok:
                self._settle()

    def _uncached(self, raw_path: str, body: bytes) -> bytes:
        """``body`` with ``cache_prompt`` off where owners are kept apart: a request the library did not put on
        its owner's own KV must reuse nothing the slot, or llama-server's RAM cache, holds of another's."""
        if not self._isolated:
            return body
        return prompt.uncached(raw_path, body)

    async def _ran_on(self, planned: int) -> int:
        """The slot the server ran a placed request in: the idle one with the newest task (``planned`` if unknown).

        llama-server gives an unpinned request the idle slot with the longest
        common prefix, else its least recently used one, whose clock the sidecar
        cannot read: a new conversation may land beside the slot it was placed in.
        """
        try:
            views = await self._engine.fresh_slots()
        except errors.UpstreamError:
            return planned
        done = [v for v in views if v.task is not None and not v.processing]
        return max(done, key=lambda v: v.task or 0).id if done else planned

    def _settle(self) -> None:
        """Read the slots once a routed request ended, off its path: a change after this read is another client's.

        Without it, a turn another client runs in the slot before the next
        placement's read looks like the routed request's own change, and
        the slot would count as still holding the routed conversation.
        """
        polled, _ = self._engine.seen()
        if polled is None or polled.slots is None:
            return
        task = tasks.watch(
            self._loop.create_task(self._fresh(polled, quiet=True), name="placer-settle"),
            effect="the slots were not read after a routed request ended: the next placement reads them",
        )
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    def _ended(self, plan: _Plan, ended: answer.Ended | None, ran_on: int | None) -> None:
        """Count the request by its own answer, and record what the slot it ran in holds now."""
        slot = plan.planned.slot
        if slot is not None:
            self._slot(slot).used = self._clock.monotonic()
            slot = ran_on
        if ended is not None:
            found = verdict.judge(plan.planned, status=ended.status, outcome=ended.outcome, cached=ended.cached)
            if plan.planned.source is outcomes.Source.RAM and found.source is not None:
                self._ram_judged(found.source is outcomes.Source.RAM)
            if found.source is not None:
                self._stats.conversation_requests.labels(found.source.value).inc()
            if found.unserved is not None:
                self._stats.conversation_unserved.labels(found.unserved.value).inc()
            if found.library_tokens:
                self._stats.library_tokens.inc(found.library_tokens)
            if slot is not None and found.reused is not None:
                self._engine.answered(slot, found.reused)
        if slot is None:
            return
        state = self._slot(slot)
        state.used = self._clock.monotonic()
        state.routed_since = True  # its content changed by a routed request: see _fresh
        state.restored = None  # the server ran a prompt there: it holds its own checkpoints of it
        if ended is not None and ended.outcome is outcomes.ProxyOutcome.OK and ended.status < 400:
            state.holds(plan.chain, plan.turn, plan.owner)
            state.ended = self._clock.wall()
        elif ended is None or ended.outcome is not outcomes.ProxyOutcome.OK:
            state.holds(())  # cut, cancelled or sent again elsewhere: what the slot holds is unknown
            state.ended = self._clock.wall()

    async def _plan(
        self, raw_path: str, body: bytes, ticket: tickets.Ticket, owner: str
    ) -> _Plan | outcomes.Unrouted | None:
        started = time.perf_counter()
        within = ticket.within
        try:
            early = await self._read_early(raw_path, body) if within is None else None
            request = prompt.of(raw_path, body)
            if not isinstance(request, prompt.Prompt):
                self._unrouted(request, "")
                return request
            if prompt.shorter_than(request, slotfile.BLOCK_TOKENS):
                return None  # too short to fill a block: no call to the server
            turn = turns.of(request)
            if within is not None:
                pass  # a new process: no slot ran a routed turn in it yet
            elif (
                turn is not None
                and (went := await self._continue(request, turn, early, owner, started, ticket)) is not None
            ):
                if isinstance(went, _Plan):
                    self._stats.library_routes.labels(outcomes.RouteBy.TURN.value).inc()
                return went
            try:
                ids = await self._ids(request, owner)
            except errors.UpstreamError as exc:
                self._unrouted(outcomes.Unrouted.TOKENIZE, str(exc))
                return outcomes.Unrouted.TOKENIZE
            packed = slotfile.pack_ids(ids)
            chain = slotfile.prefix_hashes(packed)
            if not chain:
                return None  # shorter than one block: nothing worth routing, llama-server picks
            tokenized = time.perf_counter() - started
            placed = await self._place(request, chain, packed, turn, within, owner, (started, tokenized), ticket)
        except Exception as exc:  # routing must never fail the request: it goes as it came
            self._unrouted(outcomes.Unrouted.ERROR, f"{exc.__class__.__name__}: {exc}")
            return outcomes.Unrouted.ERROR
        if isinstance(placed, _Plan):
            self._stats.library_routes.labels(outcomes.RouteBy.TOKENS.value).inc()
        return placed

    async def _ids(self, request: prompt.Prompt, owner: str) -> list[int]:
        if request.kind is prompt.Kind.IDS:
            return list(request.ids)
        text = request.text
        if request.kind is prompt.Kind.CHAT:
            assert request.chat is not None
            text = await self._tokenizer.apply_template(request.chat)
        return await self._tokenizer.tokenize(text, owner=owner)

    async def _read_early(self, raw_path: str, body: bytes) -> asyncio.Task[tuple[events.SlotView, ...]] | None:
        """The fresh read of ``/slots`` that :meth:`_continue` needs, sent now: llama-server answers it while the
        body is parsed and its messages hashed, instead of after them.

        Sent only where the request may well continue a slot's conversation: some idle slot ran a routed
        turn, and the body looks routable from its bytes (:func:`prompt.may_route`). A request that turns
        out not to continue leaves the answer unread (the engine's policy still follows it), and is placed
        on a read of its own, made after its tokens.
        """
        if not prompt.may_route(raw_path, body, slotfile.BLOCK_TOKENS) or not any(
            state.turn is not None and not self._pinned(slot) and not state.lock.locked()
            for slot, state in self._slots.items()
        ):
            return None
        read = self._loop.create_task(self._engine.fresh_slots(), name="placer-early-read")
        self._reads.add(read)  # the loop keeps no strong reference: a read no request awaits would be collected
        read.add_done_callback(self._reads.discard)
        read.add_done_callback(_retrieved)
        await asyncio.sleep(0)  # the read goes out before the parse holds the loop
        return read

    async def _continue(
        self,
        request: prompt.Prompt,
        turn: turns.Key,
        early: asyncio.Task[tuple[events.SlotView, ...]] | None,
        owner: str,
        started: float,
        ticket: tickets.Ticket,
    ) -> _Plan | outcomes.Unrouted | None:
        """Pin a request that continues the conversation an idle slot ran last to that slot; None: route it by ids.

        No round trip but a fresh read of ``/slots`` (``early`` if it was sent when the request came in),
        which says whether another client's turn ran there since (the slot then holds another prompt, and
        its content must be saved before it is given away).
        """
        text = request.text.encode() if request.kind is prompt.Kind.TEXT else b""
        if self._continued(turn, text, owner) is None:
            return None
        polled, _ = self._engine.seen()
        if polled is None or polled.slots is None:
            return None
        obs = await self._fresh(polled, early=early)
        if obs is None or obs.slots is None:
            return outcomes.Unrouted.ERROR  # counted by _fresh
        slot = self._continued(turn, text, owner)  # the read may show another client's turn there, or a request came
        view = next((v for v in obs.slots if v.id == slot), None)
        if slot is None or view is None or view.processing:
            return None
        state = self._slot(slot)
        ticket.reserve(slot)
        state.used = self._clock.monotonic()
        planned = verdict.Planned(outcomes.Source.SLOT, slot, len(state.chain) * slotfile.BLOCK_TOKENS)
        placed = request.pin is prompt.Pin.PLACED
        if placed:
            await self._clear_for(owner, {v.id: v for v in obs.slots}, slot=slot, keep=True)
        log.debug(
            "request_routed",
            source=planned.source.value,
            slot=slot,
            blocks=len(state.chain),
            by="turn",
            seconds=round(time.perf_counter() - started, 4),
        )
        return _Plan(planned, state.chain, turn, prompt.pinned(request, slot) or b"", owner, placed)

    def _continued(self, turn: turns.Key, text: bytes, owner: str) -> int | None:
        """The idle slot whose last routed request, of ``owner``'s, ``turn`` continues (the longest such)."""
        best: tuple[int, int] | None = None
        for slot, state in self._slots.items():
            if self._pinned(slot) or state.lock.locked() or not state.continues(turn, text, owner):
                continue
            assert state.turn is not None
            if best is None or state.turn.length > best[1]:
                best = slot, state.turn.length
        return best[0] if best is not None else None

    async def _place(
        self,
        request: prompt.Prompt,
        chain: tuple[str, ...],
        packed: bytes,
        turn: turns.Key | None,
        within: frozenset[int] | None,
        owner: str,
        timing: tuple[float, float],
        ticket: tickets.Ticket,
    ) -> _Plan | outcomes.Unrouted | None:
        """Place a request by its ids; ``timing``: when its placement started, and the seconds its tokens took."""
        route = await self._route(request, chain, packed, turn, within, owner)
        if not isinstance(route, _Route):
            return route
        decision = route.decision
        if decision.slot is None:  # every slot busy: llama-server queues it as it would without the sidecar
            return _Plan(verdict.Planned(decision.source, None), chain, turn, b"", owner)  # b"": forwarded as it came
        state = self._slot(decision.slot)
        ticket.reserve(decision.slot)
        state.used = self._clock.monotonic()
        source = decision.source
        restored: int | None = None
        try:
            restored, source = await self._fill(request, route, state, owner)
        finally:
            if restored is None:
                ticket.unreserve()
                if decision.source is not outcomes.Source.COLD:
                    state.holds(())  # unknown now: the restore may or may not have run
        if restored is None:
            self._unrouted(
                outcomes.Unrouted.SWAP, "the slot could not be saved or restored (see the snapshot and restore logs)"
            )
            return outcomes.Unrouted.SWAP
        log.debug(
            "request_routed",
            source=source.value,
            slot=decision.slot,
            blocks=decision.blocks,
            by="tokens",
            seconds=round(time.perf_counter() - timing[0], 4),
            tokenize_seconds=round(timing[1], 4),
        )
        planned = verdict.Planned(source, decision.slot, decision.blocks * slotfile.BLOCK_TOKENS, restored)
        if source is outcomes.Source.COLD:
            planned = dataclasses.replace(planned, prefix_tokens=0)
        placed = request.pin is prompt.Pin.PLACED
        if placed:
            await self._clear_for(owner, route.views, slot=decision.slot, keep=source is not outcomes.Source.COLD)
        return _Plan(planned, chain, turn, prompt.pinned(request, decision.slot) or b"", owner, placed)

    async def _route(
        self,
        request: prompt.Prompt,
        chain: tuple[str, ...],
        packed: bytes,
        turn: turns.Key | None,
        within: frozenset[int] | None,
        owner: str,
    ) -> _Route | outcomes.Unrouted | None:
        """Where a request goes, by its ids, from fresh slots, the library, the RAM cache and the shared store."""
        polled, identity = self._engine.seen()
        if polled is None or polled.slots is None or identity is None:
            self._unrouted(outcomes.Unrouted.ERROR, "the sidecar has not read llama-server's slots and identity yet")
            return outcomes.Unrouted.ERROR
        obs = await self._fresh(polled)
        if obs is None or obs.slots is None:
            return outcomes.Unrouted.ERROR  # counted by _fresh
        exact = not memory.cuts_back(identity.memory)
        library = self._library(identity, obs.slots, owner)
        if exact:  # a snapshot serves only a request that holds every one of its tokens
            library = {f: v for f, v in library.items() if slotstate.exact_prefix(v[0].index, packed)}
        entries = [routing.Entry(f, c) for f, (_, c) in library.items()]
        text = request.text.encode() if request.kind is prompt.Kind.TEXT else b""
        going_on = {
            s for s, state in self._slots.items() if turn is not None and state.same_conversation(turn, text, owner)
        }
        held = [self._held(v, packed if exact else None, within, owner=owner, going_on=going_on) for v in obs.slots]
        in_ram = self._ram.best(owner, chain)[0] if within is None and not exact else None
        ram = routing.Entry("", in_ram.chain) if in_ram is not None else None
        decision = routing.route(chain, held, entries, ram=ram)
        if within is not None and (decision.source is not outcomes.Source.SLOT or decision.slot not in within):
            return None  # let through before the round ended: only a restored slot holding its prefix will do
        fetcher = self._fetcher if within is None else None
        found = await fetcher.find(identity, chain, decision, obs, owner) if fetcher is not None else None
        if found is not None:  # the slots may have changed while the store answered
            obs = await self._fresh(obs) or obs
            held = [self._held(v, packed if exact else None, owner=owner, going_on=going_on) for v in obs.slots or ()]
            decision = routing.route(chain, held, entries, shared=found[0], ram=ram)
        views = {v.id: v for v in obs.slots or ()}
        return _Route(decision, views, obs.counters, library, found[1] if found is not None else None, in_ram)

    async def _fill(
        self, request: prompt.Prompt, route: _Route, state: slotstate.SlotState, owner: str
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
            state.holds(decision.entry.prefix, owner=owner)  # its requests wait at the lock below
            async with state.lock:
                restored, source = await self._fetch_in(decision, route.shared, views[decision.slot], counters)
            if source is outcomes.Source.COLD:
                state.holds(())
            return restored, source
        if source is outcomes.Source.LIBRARY:
            assert decision.entry is not None
            record = route.library[decision.entry.file][0]
            state.holds(decision.entry.prefix, owner=owner)  # its requests wait at the lock below
            async with state.lock:
                restored = await self._swap(decision, record, views[decision.slot], counters)
            state.restored = record.index if restored is not None else None
            return restored, source
        async with state.lock:  # a swap into this slot in flight ends first
            restored = 0 if await self._save_for(request, decision, views, counters) else None
        if restored is not None and source is not outcomes.Source.SLOT:
            # A task of another conversation starts there: the server copies what the slot held into
            # its RAM prompt cache first.
            self._left(state, views[decision.slot].tokens)
            state.holds(())
            if source is outcomes.Source.RAM and route.in_ram is not None:
                self._ram.loaded(route.in_ram)  # and takes this one out of it, into the slot
                state.holds(route.in_ram.chain, owner=owner)
                self._stats.ram_conversations.set(len(self._ram))
        return restored, source

    async def _save_for(
        self,
        request: prompt.Prompt,
        decision: routing.Decision,
        views: dict[int, events.SlotView],
        counters: events.Counters | None,
    ) -> bool:
        """Save what the slot a request goes to holds, if it changed; True if nothing is lost.

        Not saved when it leaves for llama-server's RAM cache and what a crash would lose of it re-prefills
        within ``--max-unsaved-seconds`` (:meth:`_leaves_unsaved`). A request the route cannot pin
        (``Pin.PLACED``) that starts a new conversation may be given any idle slot by the server (its least
        recently used), so every idle slot's changed content is saved first.
        """
        assert decision.slot is not None
        view = views[decision.slot]
        leaves = decision.source is not outcomes.Source.SLOT and self._leaves_unsaved(view, counters)
        if decision.save_first and not leaves and not await self._save(view):
            return False
        if request.pin is not prompt.Pin.PLACED or decision.source is not outcomes.Source.COLD:
            return True
        others = [self._held(v) for v in views.values() if v.id != decision.slot]
        for held in others:
            if not held.busy and held.dirty and not await self._save(views[held.slot]):
                return False
        return True

    async def _clear_for(self, owner: str, views: dict[int, events.SlotView], *, slot: int, keep: bool) -> None:
        """Empty every idle slot that holds another owner's KV, for a request the server places itself.

        llama-server gives an unpinned request the idle slot with the longest common prefix and reuses
        it: with owners kept apart, no slot it could pick may hold what is not ``owner``'s. Each slot's
        content is saved first if it changed (nothing is lost), and comes back from the library for its
        owner's next request. ``slot``: the one the request was placed in (``keep``: it holds ``owner``'s KV).
        """
        if not self._isolated:
            return
        for view in views.values():
            state = self._slot(view.id)
            if view.id == slot and keep:
                continue
            if view.processing or (self._pinned(view.id) and view.id != slot) or state.lock.locked():
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

    def _left(self, state: slotstate.SlotState, tokens: int) -> None:
        """What ``state``'s slot held went to llama-server's RAM prompt cache, ``tokens`` of KV."""
        if not state.chain or state.owner is None or self._ram.state is ramtier.State.OFF:
            return
        newest = next(iter(self._snapshots.snapshots()), None)
        per_token = newest.bytes / newest.tokens if newest is not None and newest.tokens else 0.0
        self._ram.left(state.owner, state.chain, max(1, round(tokens * per_token)))
        self._stats.ram_conversations.set(len(self._ram))

    def _leaves_unsaved(self, view: events.SlotView, counters: events.Counters | None) -> bool:
        """Whether ``view``'s slot may go to another conversation with no save first: llama-server copies what it
        holds into its RAM cache (shown to work on this server), the conversation has a snapshot already, and
        what a crash would lose of it (the tokens past its newest snapshot) re-prefills within
        ``--max-unsaved-seconds`` at the server's measured rate."""
        state = self._slot(view.id)
        if self._ram.state is not ramtier.State.CONFIRMED or self._max_unsaved <= 0 or not state.chain:
            return False
        rate = savings.measured_rate(counters) if counters is not None else None
        if not rate:
            return False
        saved = max(
            (
                r.tokens
                for r in self._snapshots.library()
                if r.owner == state.owner
                and r.index is not None
                and slotfile.shared_blocks(r.index.chain, state.chain) == len(r.index.chain)
            ),
            default=0,
        )
        reprefill = max(view.tokens - saved, 0) / rate
        if not saved or reprefill > self._max_unsaved:  # one never saved is saved: a crash loses no whole one
            return False
        self._stats.left_unsaved.observe(reprefill)
        return True

    async def _fresh(
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
        ``early``: the read already sent for the request (:meth:`_read_early`).
        """
        try:
            slots = await (early if early is not None else self._engine.fresh_slots())
        except errors.UpstreamError as exc:
            if not quiet:
                self._unrouted(outcomes.Unrouted.ERROR, f"cannot read /slots before placing the request: {exc}")
            return None
        for view in slots:
            state = self._slot(view.id)
            if self._pinned(view.id) or state.lock.locked():
                continue  # a routed request or a swap is changing it: the placer knows what it holds
            if state.seen is not None and view.signature != state.seen and not state.routed_since:
                # Another client's turn ran there, or --cache-idle-slots emptied it: the server copied
                # what it held into its RAM prompt cache first.
                self._left(state, state.seen[1])
                state.holds(())
            state.seen, state.routed_since = view.signature, False
        return dataclasses.replace(obs, slots=slots)

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
        download.add_done_callback(_retrieved)  # cancelled unawaited when the save fails
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
        return restored, outcomes.Source.SHARED

    async def _swap(
        self,
        decision: routing.Decision,
        record: manifest.Manifest,
        view: events.SlotView,
        counters: events.Counters | None,
        *,
        checked: bool = False,
    ) -> int | None:
        """Save the slot's own content if it changed, then restore ``record`` into it: the tokens restored, or None.

        ``checked``: ``record`` was committed just now (fetched from the shared store), not hashed again."""
        assert decision.slot is not None
        started = time.perf_counter()
        with self._snapshots.using(record.file):
            if decision.save_first and not await self._save(view):
                return None
            result = await self._engine.swap_in(decision.slot, record, counters=counters, checked=checked)
        if not result.restored:
            return None
        seconds = time.perf_counter() - started
        self._slot(decision.slot).seen = None  # restored: its (task, tokens) are read afresh next time
        self._snapshots.touch(record.file)
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
        if (view.signature is None or view.tokens == 0) and not self._ended_unsaved(view.id, self._slot(view.id)):
            return True
        if view.tokens > 0 and not self._engine.worth_saving(view.tokens):
            return True  # not worth a file (--min-tokens): the policy would not save it either
        # The poll's view may be older than a routed request that ended there: the engine reads the slot
        # afresh before it saves, and saves what it holds then.
        signature = view.signature if view.signature is not None else events.UNREAD
        return await self._engine.save(policy.Save(view.id, signature, view.tokens, policy.SaveReason.SWAP))

    def _held(
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
        state = self._slot(view.id)
        prefix = state.holds_for(owner)
        if (
            exact_for is not None
            and state.restored is not None
            and not slotstate.exact_prefix(state.restored, exact_for)
        ):
            prefix = ()
        return routing.Held(
            slot=view.id,
            prefix=prefix,
            busy=view.processing
            or self._pinned(view.id) > 0
            or state.lock.locked()
            or (within is not None and view.id not in within),
            last_used=state.used,
            dirty=self._dirty(view, state),
            continued=view.id in going_on,
        )

    def _ended_unsaved(self, slot: int, state: slotstate.SlotState) -> bool:
        """Whether a routed request ended in ``slot`` after its newest snapshot was made."""
        newest = next(iter(self._snapshots.snapshots(slot)), None)
        return state.ended > (newest.created if newest is not None else 0.0)

    def _dirty(self, view: events.SlotView, state: slotstate.SlotState) -> bool:
        """Whether the slot holds content no snapshot has: a routed request ended after its newest snapshot."""
        if self._ended_unsaved(view.id, state):
            return True  # whatever the poll's view says: it may predate that request
        if view.signature is None or view.tokens == 0:
            return False  # empty, or holds only what a restore round put there
        return self._engine.unsaved(view.id)

    def _library(
        self, identity: events.Identity, slots: Sequence[events.SlotView], owner: str
    ) -> dict[str, tuple[manifest.Manifest, tuple[str, ...]]]:
        """The library's snapshots of ``owner``'s this server can restore, by file."""
        n_ctx = min((v.n_ctx for v in slots), default=0)
        found: dict[str, tuple[manifest.Manifest, tuple[str, ...]]] = {}
        for record in self._snapshots.library():
            if record.owner != owner or record.index is None:
                continue
            if not manifest.incompatibilities(record, identity, slot_n_ctx=n_ctx):
                found[record.file] = (record, record.index.chain)
        return found

    def _ram_judged(self, served: bool) -> None:
        """A request placed on what the RAM cache was said to hold: its answer shows whether it was there."""
        if served:
            self._ram.served()
        else:
            self._ram.missed()
            self._stats.ram_conversations.set(0)
        state = self._ram.state
        if state in self._ram_said or state is ramtier.State.TRYING:
            return
        self._ram_said.add(state)
        if state is ramtier.State.CONFIRMED:
            leaving = (
                f"one leaves its slot unsaved while a crash would lose at most {self._max_unsaved:g} s of "
                "re-prefill of it (--max-unsaved-seconds)"
                if self._max_unsaved > 0
                else "each is still saved before it leaves its slot (--max-unsaved-seconds 0)"
            )
            log.info(
                "server_ram_cache_serves",
                effect="conversations that left their slot come back from llama-server's RAM prompt cache, "
                f"nothing restored; {leaving}",
            )
        else:
            log.warning(
                "server_ram_cache_missed",
                effect="a conversation the library counted on llama-server's RAM prompt cache to hold was "
                "re-prefilled: conversations are swapped in from disk until the server restarts",
                hint="llama-server runs with --cache-ram 0, or one smaller than --server-cache-ram-bytes: set "
                "--server-cache-ram-bytes to its --cache-ram in bytes (0 for none)",
            )

    def _pinned(self, slot: int) -> int:
        """Routed requests on ``slot`` that have not ended: the live tickets that reserve it."""
        return sum(1 for ticket in self._live if ticket.slot == slot)

    def _slot(self, slot: int) -> slotstate.SlotState:
        return self._slots.setdefault(slot, slotstate.SlotState())

    def _unrouted(self, reason: outcomes.Unrouted, detail: str) -> None:
        self._unrouted_counts[reason].inc()
        if reason in self._said:
            return
        self._said.add(reason)
        log.warning(
            "request_not_routed",
            reason=reason.value,
            error=detail,
            effect="forwarded as it came: llama-server picks its slot (logged once per reason; counted in "
            "llama_sidecar_conversation_unrouted_total)",
        )


def _retrieved(read: asyncio.Task[Any]) -> None:
    """An early read (or a fetch) no request awaited: its error was the placement's to count, had it needed it."""
    if not read.cancelled():
        read.exception()
