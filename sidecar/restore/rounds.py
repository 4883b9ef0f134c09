"""A restore round over the slots, and a swap into one slot: which snapshot goes where, read right before."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from sidecar.core import errors, events, outcomes
from sidecar.restore import ahead, filechecks, plan, records, send, verify
from sidecar.slots import actions
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.restore")
Outcome = outcomes.RestoreOutcome
_DETAILS = {
    Outcome.SLOT_BUSY: "slot already holds a request's tokens or is processing",
    Outcome.NO_SNAPSHOT: "no snapshot of this slot",
    Outcome.INCOMPATIBLE: "no snapshot of this slot fits this server",
}


class Round:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        identity: Callable[[], events.Identity | None],
        checks: filechecks.FileChecks,
        rebuilt_ahead: ahead.Ahead,
        acts: records.Acts,
        tally: records.Tally,
        sender: send.Sender,
        verifier: verify.Verifier,
    ) -> None:
        """``identity``: the running server's identity as last read (what every snapshot must match)."""
        self._actions = slot_actions
        self._snapshots = snapshots
        self._identity = identity
        self._checks = checks
        self._ahead = rebuilt_ahead
        self._acts = acts
        self._tally = tally
        self._sender = sender
        self._verifier = verifier

    async def restore_all(
        self,
        identity: events.Identity,
        *,
        healthy_at: float | None,
        counters: events.Counters | None,
        order: records.Order | None = None,
    ) -> dict[int, manifest.Manifest] | None:
        """One restore round into every idle, empty slot; returns the manifest restored into each slot.

        ``order``: what goes next and where, and who is told of each restore as it lands (else each slot's
        own snapshots in slot order, told of none). None if the round could not start (/slots unreadable):
        try again at the next poll.
        """
        done: dict[int, manifest.Manifest] = {}
        tried: list[records.RestoreRecord] = []
        async with self._actions.lock:
            listed_at = time.perf_counter()
            try:
                listing = await self._actions.slots()
            except errors.UpstreamError as exc:
                log.warning("restore_round_postponed", error=str(exc), effect="tried again at the next poll")
                return None
            acted = self._acts.count
            pending = {view.id: view for view in listing}
            while pending:
                slots = tuple(pending)
                step = (
                    await order.next_step(slots)
                    if order is not None
                    else plan.plan(slots, (), self._snapshots.snapshots())[0]
                )
                view = pending.pop(step.slot)
                fresh = (view, listed_at) if self._acts.count == acted else None  # nothing has run since the listing
                record, restored = await self._restore_slot(step, fresh, identity, healthy_at, counters)
                tried.append(record)
                if restored is not None:
                    done[view.id] = restored
                    if order is not None:
                        order.restored(view.id, restored)
            await self._ahead.discard()  # a newer snapshot won, or the slot was not empty
        self._checks.clear()
        self._verifier.last = sorted(tried, key=lambda record: record.slot)
        return done

    async def swap_in(
        self, slot: int, candidate: manifest.Manifest, *, counters: events.Counters | None, checked: bool = False
    ) -> tuple[records.RestoreRecord, events.SlotView | None]:
        """Restore ``candidate`` into ``slot``, replacing what it holds (its owner saved it first).

        For the library's swaps and the shared store's fetches: the snapshot
        must fit the running server (:func:`manifest.incompatibilities`, the
        check of a restore round: weights, adapters, build, slot count, the
        slot's context) and pass its size and checksum check; the slot is
        read right before the call and never restored into while it is
        processing, and read again after it to catch a racing request, as in a
        restore round. Returns the record and the slot as read after a
        successful restore. ``checked``: the caller committed ``candidate``
        just now (a fetch from the shared store, hashed as it was downloaded
        and again by its commit): it is not hashed a third time.
        """
        async with self._actions.lock:
            if not checked and not await self._checks.check(candidate):
                return self._tally.count(slot, Outcome.FAILED, "the snapshot failed its check", candidate.file), None
            started = time.perf_counter()
            view, problem = await self._sender.read(slot)
            if view is None:
                return self._tally.count(slot, Outcome.FAILED, problem), None
            refusal = self.refusal(candidate, n_ctx=view.n_ctx)
            if refusal:
                log.warning(
                    "snapshot_incompatible",
                    slot=slot,
                    file=candidate.file,
                    differences=refusal,
                    effect="not restored: the request runs without it, prefilled by llama-server",
                    hint="a snapshot of another model, adapters, build or slot count reached this node "
                    "(copied into the slot dir or the shared store); remove it if it keeps coming back",
                )
                return self._tally.count(slot, Outcome.INCOMPATIBLE, refusal, candidate.file), None
            if view.processing:
                return self._tally.count(slot, Outcome.SLOT_BUSY, "the slot is processing a request"), None
            staged, rebuilt = await self._sender.stage(candidate)
            if staged is None:
                return self._tally.count(slot, Outcome.FAILED, "the snapshot failed its check", candidate.file), None
            try:
                if rebuilt:  # rebuilt from the block store: time has passed, read it again
                    view, problem = await self._sender.read(slot)
                    if view is None:
                        return self._tally.count(slot, Outcome.FAILED, problem), None
                    if view.processing:
                        return self._tally.count(slot, Outcome.SLOT_BUSY, "the slot is processing a request"), None
                record, restored = await self._sender.send(
                    slot, view, candidate, None, counters, started, by=outcomes.SavedBy.SWAP, filename=staged
                )
            finally:
                self._sender.give_back(staged, candidate)
            if restored is None:
                return record, None
            after, _ = await self._sender.read(slot)
            return record, after

    def refusal(self, candidate: manifest.Manifest, *, n_ctx: int) -> str:
        """Why ``candidate`` cannot go into a slot of ``n_ctx`` on the running server; "" if it can.

        The one compatibility check of every road into a slot (restart restore,
        admin restore, library swap, shared-store fetch): the same function the
        restore round's plan applies.
        """
        identity = self._identity()
        if identity is None:
            return "the server's identity (/props) is not read yet: nothing can be matched against it"
        return "; ".join(manifest.incompatibilities(candidate, identity, slot_n_ctx=n_ctx))

    async def _restore_slot(
        self,
        step: plan.Step,
        fresh: tuple[events.SlotView, float] | None,
        identity: events.Identity,
        healthy_at: float | None,
        counters: events.Counters | None,
    ) -> tuple[records.RestoreRecord, manifest.Manifest | None]:
        """Restore ``step``; ``fresh``: a view of its slot and when its read began, nothing run since (else None)."""
        slot = step.slot
        view: events.SlotView | None
        if fresh is not None:
            (view, started), problem = fresh, ""
        else:
            started = time.perf_counter()
            view, problem = await self._sender.read(slot)
        if view is None:
            return self._tally.count(slot, Outcome.FAILED, problem), None
        chosen = plan.plan_restore(view, step.candidates, identity, in_order=True)
        for file, why in chosen.refusals:
            log.warning("snapshot_incompatible", slot=slot, file=file, differences=why)
        if chosen.outcome is not None:
            return self._tally.count(slot, chosen.outcome, _DETAILS.get(chosen.outcome, "")), None
        for candidate in chosen.candidates:
            # Rebuilt and checked (maybe ahead), or the file itself.
            staged, rebuilt = await self._sender.stage(candidate, slot=step.slot)
            if staged is None:
                continue
            try:
                if rebuilt or (staged == candidate.file and not self._checks.unchanged(candidate)):
                    # Not checked ahead: hash it now (a rebuild was), then read the slot again, as time has passed.
                    if staged == candidate.file and not await self._checks.check(candidate):
                        continue
                    view, problem = await self._sender.read(slot)
                    if view is None:
                        return self._tally.count(slot, Outcome.FAILED, problem), None
                    if view.processing or not view.empty:
                        return self._tally.count(slot, Outcome.SLOT_BUSY, _DETAILS[Outcome.SLOT_BUSY]), None
                return await self._sender.send(slot, view, candidate, healthy_at, counters, started, filename=staged)
            finally:
                self._sender.give_back(staged, candidate)
        return self._tally.count(slot, Outcome.FAILED, "every snapshot planned for this slot failed its check"), None
