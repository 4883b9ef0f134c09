"""Where a request through the proxy goes: by its turn, or by its ids. I/O.

A request that continues the conversation an idle slot ran last (:mod:`.turns`) is pinned to that slot
with no round trip but a read of ``/slots``; every other one is tokenized (:mod:`.prompt` says how), its
block hashes chained, and :func:`.routing.route` chooses among the slots, the library, llama-server's
RAM cache and the shared store; :class:`.filling.Filler` then fills the slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Sequence

import structlog

from sidecar.core import apikeys, errors, events, metrics, outcomes, protocols
from sidecar.library import (
    fetching,
    filling,
    holding,
    prompt,
    ramtier,
    ramuse,
    routing,
    seams,
    slotbook,
    slotstate,
    tally,
    turns,
    verdict,
)
from sidecar.observe import memory
from sidecar.proxy import tickets
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.library")

PLACE_TRIES = 3
"""Placements of one request when the slot it was given is taken before its content is saved (a request
llama-server had queued started there): past them it goes as it came (``Unrouted.SWAP``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    planned: verdict.Planned
    chain: tuple[str, ...]
    turn: turns.Key | None
    body: bytes
    """The body to forward; b"": as it came (every slot busy, or a route that drops ``id_slot``)."""
    owner: str = apikeys.NOBODY
    """Whose request it is: the slot holds that owner's conversation once it ends."""
    placed: bool = False
    """Not pinned (``prompt.Pin.PLACED``): the server chose the slot, which is read back after the answer."""


class Chooser:
    def __init__(
        self,
        *,
        engine: seams.Slots,
        tokenizer: seams.Tokenizer,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        book: slotbook.SlotBook,
        filler: filling.Filler,
        tally: tally.Tally,
        ram: ramuse.RamUse,
        fetcher: fetching.Fetcher | None,
        hold_seconds: float = 120.0,
    ) -> None:
        """``hold_seconds``: the longest a request waits for a slot while every one reads busy (:mod:`.holding`)."""
        self._holding = holding.Holding(engine=engine, book=book, clock=clock, hold_seconds=hold_seconds)
        self._engine = engine
        self._tokenizer = tokenizer
        self._snapshots = snapshots
        self._stats = stats
        self._clock = clock
        self._book = book
        self._filler = filler
        self._tally = tally
        self._ram = ram
        self._fetcher = fetcher

    async def plan(
        self, raw_path: str, body: bytes, ticket: tickets.Ticket, owner: str
    ) -> Plan | outcomes.Unrouted | None:
        """Where a request goes, its slot filled and reserved on ``ticket``; the reason it is not routed (counted);
        None: not routed nor counted (too short to fill a block, or let through early with no restored slot
        holding its prefix)."""
        started = time.perf_counter()
        within = ticket.within
        try:
            early = await self._book.read_early(raw_path, body) if within is None else None
            request = prompt.of(raw_path, body)
            if not isinstance(request, prompt.Prompt):
                self._tally.unrouted(request, "")
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
                if isinstance(went, Plan):
                    self._stats.library_routes.labels(outcomes.RouteBy.TURN.value).inc()
                return went
            back = self._back_from_ram(request, turn, owner) if within is None else None
            if back is not None:  # no round trip: the chain it left with (its slot's next save tells the rest)
                chain, packed, by = back.chain, b"", outcomes.RouteBy.RAM_TURN
            else:
                try:
                    ids = await self.ids(request, owner)
                except errors.UpstreamError as exc:
                    self._tally.unrouted(outcomes.Unrouted.TOKENIZE, str(exc))
                    return outcomes.Unrouted.TOKENIZE
                packed = slotfile.pack_ids(ids)
                chain, by = slotfile.prefix_hashes(packed), outcomes.RouteBy.TOKENS
                if not chain:
                    return None  # shorter than one block: nothing worth routing, llama-server picks
            tokenized = time.perf_counter() - started
            placed = await self._place(
                request, chain, packed, turn, within, owner, (started, tokenized, by), ticket, early=early
            )
        except Exception as exc:  # routing must never fail the request: it goes as it came
            self._tally.unrouted(outcomes.Unrouted.ERROR, f"{exc.__class__.__name__}: {exc}")
            return outcomes.Unrouted.ERROR
        if isinstance(placed, Plan):
            self._stats.library_routes.labels(by.value).inc()
        return placed

    def _back_from_ram(self, request: prompt.Prompt, turn: turns.Key | None, owner: str) -> ramtier.Held | None:
        """What llama-server's RAM cache holds of the conversation ``request`` continues, if the placer may route
        it by that copy's chain instead of its own tokens (only where the model's state cuts back to any prefix: on
        one that cannot, a snapshot serves only a request holding all its tokens, which takes the ids).

        The copy is the conversation's newest state (it left its slot after its last turn), so no other source
        holds more of it. The request is not tokenized at all: its slot is said to hold the chain it came back
        by until the slot's next save (idle after the turn) reads the file's own, as a request routed by its
        turn leaves it. The ids would cost two round trips to llama-server before the forward (8-10 ms a turn
        here, 5-8% of a 0.17 s turn), or, learned beside the run, CPU the server's threads wait for.
        """
        if turn is None:
            return None
        _, identity = self._engine.seen()
        if identity is None or not memory.cuts_back(identity.memory):
            return None
        text = request.text.encode() if request.kind is prompt.Kind.TEXT else b""
        return self._ram.tier.continued(owner, turn, text)

    async def ids(self, request: prompt.Prompt, owner: str) -> list[int]:
        if request.kind is prompt.Kind.IDS:
            return list(request.ids)
        text = request.text
        if request.kind is prompt.Kind.CHAT:
            assert request.chat is not None
            text = await self._tokenizer.apply_template(request.chat)
        return await self._tokenizer.tokenize(text, owner=owner)

    async def _continue(
        self,
        request: prompt.Prompt,
        turn: turns.Key,
        early: asyncio.Task[tuple[events.SlotView, ...]] | None,
        owner: str,
        started: float,
        ticket: tickets.Ticket,
    ) -> Plan | outcomes.Unrouted | None:
        """Pin a request that continues the conversation an idle slot ran last to that slot; None: route it by ids.

        No round trip but a fresh read of ``/slots`` (``early`` if it was sent when the request came in),
        which says whether another client's turn ran there since (the slot then holds another prompt, and
        its content must be saved before it is given away).
        """
        if self._book.queue.locked():
            return None  # requests are held for a slot: it takes its turn behind them, as llama-server would queue it
        text = request.text.encode() if request.kind is prompt.Kind.TEXT else b""
        if self._continued(turn, text, owner) is None:
            return None
        polled, _ = self._engine.seen()
        if polled is None or polled.slots is None:
            return None
        obs = await self._book.fresh(polled, early=early)
        if obs is None or obs.slots is None:
            return outcomes.Unrouted.ERROR  # counted by the fresh read
        slot = self._continued(turn, text, owner)  # the read may show another client's turn there, or a request came
        view = next((v for v in obs.slots if v.id == slot), None)
        if slot is None or view is None or view.processing:
            return None
        state = self._book.slot(slot)
        ticket.reserve(slot)
        state.used = self._clock.monotonic()
        planned = verdict.Planned(outcomes.Source.SLOT, slot, len(state.chain) * slotfile.BLOCK_TOKENS)
        placed = request.pin is prompt.Pin.PLACED
        if placed:
            await self._filler.clear_for(owner, {v.id: v for v in obs.slots}, slot=slot, keep=True)
        log.debug(
            "request_routed",
            source=planned.source.value,
            slot=slot,
            blocks=len(state.chain),
            by="turn",
            seconds=round(time.perf_counter() - started, 4),
        )
        return Plan(planned, state.chain, turn, prompt.pinned(request, slot) or b"", owner, placed)

    def _continued(self, turn: turns.Key, text: bytes, owner: str) -> int | None:
        """The idle slot whose last routed request, of ``owner``'s, ``turn`` continues (the longest such)."""
        best: tuple[int, int] | None = None
        for slot, state in self._book.states.items():
            if self._book.pinned(slot) or state.lock.locked() or not state.continues(turn, text, owner):
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
        timing: tuple[float, float, outcomes.RouteBy],
        ticket: tickets.Ticket,
        *,
        early: asyncio.Task[tuple[events.SlotView, ...]] | None = None,
    ) -> Plan | outcomes.Unrouted | None:
        """Place a request by its ids; ``timing``: when its placement started, the seconds its tokens took, and
        how its chain was found; ``early``: the read of ``/slots`` sent when the request came in."""
        by_ram = timing[2] is outcomes.RouteBy.RAM_TURN
        again = functools.partial(self._route, request, chain, packed, turn, within, owner, by_ram=by_ram)
        for attempt in range(PLACE_TRIES):
            since = self._book.ends
            route = await again(early=early if by_ram and attempt == 0 else None)
            if isinstance(route, filling.Route) and (route.decision.slot is None or self._book.queue.locked()):
                # No slot now, or requests held before it: it waits its turn.
                route = await self._holding.until_free(again, since)
            if not isinstance(route, filling.Route):
                return route
            decision = route.decision
            if decision.slot is None:  # held past the bound: llama-server queues it (see holding.Holding)
                return Plan(verdict.Planned(decision.source, None), chain, turn, b"", owner)  # b"": as it came
            state = self._book.slot(decision.slot)
            ticket.reserve(decision.slot)
            state.used = self._clock.monotonic()
            source = decision.source
            restored: int | None = None
            try:
                restored, source = await self._filler.fill(request, route, state, owner)
            finally:
                if restored is None:
                    ticket.unreserve()
                    if decision.source is not outcomes.Source.COLD:
                        state.holds(())  # unknown now: the restore may or may not have run
            if restored is not None:
                break
            if attempt + 1 < PLACE_TRIES and await self._holding.taken(decision.slot):
                continue  # a request llama-server queued took the slot between its read and its save: placed again
            self._tally.unrouted(
                outcomes.Unrouted.SWAP, "the slot could not be saved or restored (see the snapshot and restore logs)"
            )
            return outcomes.Unrouted.SWAP
        else:  # pragma: no cover - the loop returns or breaks on its last attempt
            return outcomes.Unrouted.SWAP
        log.debug(
            "request_routed",
            source=source.value,
            slot=decision.slot,
            blocks=decision.blocks,
            by=timing[2].value,
            seconds=round(time.perf_counter() - timing[0], 4),
            tokenize_seconds=round(timing[1], 4),
        )
        planned = verdict.Planned(source, decision.slot, decision.blocks * slotfile.BLOCK_TOKENS, restored)
        if source is outcomes.Source.COLD:
            planned = dataclasses.replace(planned, prefix_tokens=0)
        placed = request.pin is prompt.Pin.PLACED
        if placed:
            await self._filler.clear_for(
                owner, route.views, slot=decision.slot, keep=source is not outcomes.Source.COLD
            )
        return Plan(planned, chain, turn, prompt.pinned(request, decision.slot) or b"", owner, placed)

    async def _route(
        self,
        request: prompt.Prompt,
        chain: tuple[str, ...],
        packed: bytes,
        turn: turns.Key | None,
        within: frozenset[int] | None,
        owner: str,
        *,
        by_ram: bool = False,
        early: asyncio.Task[tuple[events.SlotView, ...]] | None = None,
    ) -> filling.Route | outcomes.Unrouted | None:
        """Where a request goes, by its ids, from fresh slots, the library, the RAM cache and the shared store.

        ``by_ram``: ``chain`` is that of the RAM cache's copy of the conversation the request continues, its newest
        state: neither the library nor the shared store is looked at (a look at every snapshot per request).
        ``early``: the read of ``/slots`` sent when the request came in, fresh enough where nothing was asked of
        llama-server since (a request placed by the RAM cache's copy is not tokenized); else one is read now."""
        polled, identity = self._engine.seen()
        if polled is None or polled.slots is None or identity is None:
            self._tally.unrouted(
                outcomes.Unrouted.ERROR, "the sidecar has not read llama-server's slots and identity yet"
            )
            return outcomes.Unrouted.ERROR
        obs = await self._book.fresh(polled, early=early)
        if obs is None or obs.slots is None:
            return outcomes.Unrouted.ERROR  # counted by the fresh read
        exact = not memory.cuts_back(identity.memory)
        library = {} if by_ram else self._library(identity, obs.slots, owner)
        if exact:  # a snapshot serves only a request that holds every one of its tokens
            library = {f: v for f, v in library.items() if slotstate.exact_prefix(v[0].index, packed)}
        entries = [routing.Entry(f, c, v.index.tokens if exact and v.index else 0) for f, (v, c) in library.items()]
        text = request.text.encode() if request.kind is prompt.Kind.TEXT else b""
        going_on = {
            s
            for s, state in self._book.states.items()
            if turn is not None and state.same_conversation(turn, text, owner)
        }
        held = [
            self._book.held(v, packed if exact else None, within, owner=owner, going_on=going_on) for v in obs.slots
        ]
        in_ram = self._ram.tier.best(owner, chain)[0] if within is None and not exact else None
        ram = routing.Entry("", in_ram.chain) if in_ram is not None else None
        decision = routing.route(chain, held, entries, ram=ram)
        if within is not None and (decision.source is not outcomes.Source.SLOT or decision.slot not in within):
            return None  # let through before the round ended: only a restored slot holding its prefix will do
        fetcher = self._fetcher if within is None and not by_ram else None
        found = await fetcher.find(identity, chain, decision, obs, owner) if fetcher is not None else None
        if found is not None and exact and not slotstate.exact_prefix(found[1].snapshot.index, packed):
            # A windowed or recurrent state serves only a request that holds all its tokens: another
            # conversation's snapshot that shares the request's first blocks would be fetched and restored for
            # nothing (the server re-prefills the whole prompt).
            found = None
        if found is not None:  # the slots may have changed while the store answered
            obs = await self._book.fresh(obs) or obs
        if fetcher is not None:
            # Chosen again after the store's answer (up to its lookup bound), with no wait until the slot is
            # reserved: a request placed meanwhile holds a slot this one chose, or swapped another conversation in.
            held = [
                self._book.held(v, packed if exact else None, owner=owner, going_on=going_on) for v in obs.slots or ()
            ]
            decision = routing.route(chain, held, entries, shared=found[0] if found is not None else None, ram=ram)
        views = {v.id: v for v in obs.slots or ()}
        shared = found[1] if found is not None else None
        return filling.Route(decision, views, obs.counters, library, shared, in_ram, chain)

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
