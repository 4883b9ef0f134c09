"""The engine's saves: which due save goes now, each carried out and judged, the final ones at exit.

:meth:`Saves.save` reads the slot afresh, holds a background save while
another slot generates, brings a slot of a recurrent or hybrid model back to
its prompt's boundary (:mod:`sidecar.save.rewind`), then has the snapshotter save and
commit it. What a save's outcome means for the slot (saved, due again later)
and for the slot-dir link is decided here too.
"""

from __future__ import annotations

import dataclasses

import structlog

from sidecar.core import config, errors, events, hashing, outcomes
from sidecar.engine import part, probe
from sidecar.restore import savings
from sidecar.save import policy, records, rewind, snapshotter, stallweigh

log = structlog.get_logger("sidecar.engine")
AGE_CHECK_EVERY = 30.0
"""Seconds between --max-age checks while no save runs retention (at most a quarter of --max-age)."""
RETRY_AFTER = 30.0
"""Seconds before a slot whose save failed, or was skipped for lack of disk, is tried again."""
Cause = outcomes.SaveCause
WEIGHED_SAVES = {
    stallweigh.Weight.UNMEASURED: "past --save-hold-seconds; no prefill rate or save time measured yet to weigh it",
    stallweigh.Weight.OFF: "past --save-hold-seconds (--max-unsaved-seconds 0: not weighed)",
    stallweigh.Weight.OVER_BOUND: "past --save-hold-seconds; what a crash would lose of the slot re-prefills slower "
    "than --max-unsaved-seconds",
    stallweigh.Weight.WORTH_ITS_STALL: "past --save-hold-seconds; what a crash would lose of the slot re-prefills "
    "at least as slowly as the save stalls every slot",
}
"""Why a held save is made now (``snapshot_hold_ended``), by what its weighing found."""
REWOUND = (events.Memory.RECURRENT, events.Memory.HYBRID, events.Memory.SWA)
"""Models whose restored state serves only a prompt that extends it: their slots are saved at the prompt's boundary."""
ASLEEP = "llama-server is asleep (--sleep-idle-seconds): a save would wake it"


def processing(
    slots: tuple[events.SlotView, ...], counters: events.Counters | None, *, besides: int | None = None
) -> bool:
    """Whether a slot other than ``besides`` is processing, as the listing or the counters say."""
    return any(v.processing for v in slots if v.id != besides) or (counters is not None and counters.processing > 0)


class Saves(part.Part):
    def __init__(
        self,
        wiring: part.Wiring,
        *,
        settings: config.SnapshotSettings,
        rewinder: rewind.Rewinder,
    ) -> None:
        super().__init__(wiring)
        self._rewinder = rewinder
        self._max_age = settings.max_age
        self._next_age_check = 0.0
        self._held: dict[int, tuple[events.SlotContent, outcomes.SaveHold]] = {}
        """The content of each slot whose save was last held, and why (logged once per content and reason)."""
        self._ended: dict[int, events.SlotContent] = {}
        """The content of each slot whose save was last weighed worth its stall (logged once per content)."""
        self.saver = snapshotter.Snapshotter(
            slot_actions=wiring.slot_actions,
            snapshots=wiring.snapshots,
            stats=wiring.stats,
            settings=settings,
            clock=wiring.clock,
            committed_later=self._committed_later,
        )
        """The snapshotter that carries the saves out (its last record and disk state are read for /status)."""

    async def save(self, action: policy.Save) -> bool:
        """Save one slot if it is idle right now; True if its content is in a snapshot (committed now or before)."""
        if self._sight.identity is None or self._sight.latest is None:
            log.warning("snapshot_postponed", slot=action.slot, reason="server identity (/props) not read yet")
            return False
        async with self._actions.lock:
            read_at = self._clock.monotonic()
            try:
                fresh = await self._actions.slots()
            except errors.UpstreamError as exc:
                log.warning("snapshot_postponed", slot=action.slot, reason=f"cannot read /slots: {exc}")
                self._policy.defer(action.slot, self._clock.monotonic() + RETRY_AFTER)
                return False
            view = next((v for v in fresh if v.id == action.slot), None)
            if view is None or view.signature is None:
                log.info("snapshot_postponed", slot=action.slot, reason="the slot holds nothing (any more)")
                # It ran no task in this process: empty, or what a restore put there, which a snapshot holds. A swap
                # loses nothing giving it away (refused, the library sent its request unpinned, to a slot of the
                # server's choice).
                return action.reason is policy.SaveReason.SWAP
            # Newer than the poll's listing (carried over while other slots generate): the policy follows it.
            self._policy.observe([view], self._clock.monotonic(), read_at=read_at)
            if view.processing:
                self.saver.records.busy(action)
                return False
            if self.hold(action, fresh, None):
                return False
            if action.reason not in snapshotter.BACKGROUND and self.saver.pending:
                await self.saver.commit_pending()  # someone waits on this save: a content that waits is committed
            track = self._policy.tracks.get(view.id)
            if action.reason is not policy.SaveReason.MANUAL and track is not None and track.settled == view.signature:
                return True  # saved already (an earlier save found this content): nothing to lose
            if view.signature != action.signature:  # it ran a turn since: save what it holds now
                action = dataclasses.replace(action, signature=view.signature, tokens=view.tokens)
            window = self.saver.records.within_window(action, self._sight.identity)
            if window is None and self._sight.identity.memory in REWOUND:
                rewound = await self._rewinder.to_boundary(view)  # the state the next turn can use
                if rewound.signature is not None and rewound.signature != action.signature:
                    action = dataclasses.replace(action, signature=rewound.signature, tokens=rewound.tokens)
                window = self.saver.records.within_window(action, self._sight.identity)
            if window is not None:  # nothing a restore could reuse: settled, as a slot saved already
                self._saved(action, window)
                return True
            others_busy = processing(fresh, None, besides=action.slot)
            record = await self.saver.save(
                action,
                identity=self._sight.identity,
                slot_n_ctx=view.n_ctx,
                others_busy=others_busy,
                epoch=self._sight.server.epoch,
                prefill_rate=self._rate(),
                owner=self._listeners.owner(action.slot),
            )
        if isinstance(record, snapshotter.Written):
            self._policy.settle(action.slot, action.signature)  # its commit waits; undone if that fails
            self.export_unsaved()
            return True
        self._saved(action, record)
        self.export_unsaved()
        return record.result is outcomes.SaveResult.OK

    def hold(self, action: policy.Save, slots: tuple[events.SlotView, ...], counters: events.Counters | None) -> bool:
        """Whether to hold a due save because another slot is processing (see ``Policy.may_hold``), and past
        that hold, because what it protects re-prefills faster than it would stall every slot (``Policy.weigh``)."""
        if action.reason not in snapshotter.BACKGROUND:
            return False  # a swap, an admin's or the final save is taken now
        if not processing(slots, counters, besides=action.slot):
            return False
        if self._policy.may_hold(action.slot, self._clock.monotonic()):
            self._held_once(action, outcomes.SaveHold.HOLD)
            return True
        weighing = self._policy.weigh(action.slot, rate=self._rate(), pace=self.saver.pace)
        if weighing is None or weighing.save:
            if weighing is not None and self._ended.get(action.slot) != action.signature:
                self._ended[action.slot] = action.signature  # made while another slot processes: say why, once
                log.info(
                    "snapshot_hold_ended",
                    slot=action.slot,
                    reason=WEIGHED_SAVES[weighing.weight],
                    reprefill_seconds=None if weighing.reprefill is None else round(weighing.reprefill, 4),
                    stall_seconds=None if weighing.stall is None else round(weighing.stall, 4),
                )
            return False
        self._held_once(action, outcomes.SaveHold.CHEAP_TAIL, weighing)
        return True

    def _held_once(
        self, action: policy.Save, why: outcomes.SaveHold, weighing: stallweigh.Weighing | None = None
    ) -> None:
        """Log and count a held save once per slot content and reason."""
        if self._held.get(action.slot) == (action.signature, why):
            return
        self._held[action.slot] = (action.signature, why)
        self._stats.snapshots_held.labels(why.value).inc()
        if weighing is None:
            log.info(
                "snapshot_held",
                slot=action.slot,
                reason="another slot is processing: a save would stall its generation",
                effect="saved once no slot is processing, or when --save-hold-seconds runs out and the save is "
                "worth its stall (--max-unsaved-seconds)",
            )
            return
        log.info(
            "snapshot_held",
            slot=action.slot,
            reason=f"past --save-hold-seconds, but what a crash would lose of the slot (its tokens past its "
            f"last snapshot) re-prefills in {weighing.reprefill or 0:.3f} s, less than the {weighing.stall or 0:.3f} "
            "s the save would stall every slot",
            effect="saved once no slot is processing, or once that re-prefill outweighs the stall or exceeds "
            "--max-unsaved-seconds",
            reprefill_seconds=round(weighing.reprefill or 0, 4),
            stall_seconds=round(weighing.stall or 0, 4),
        )

    def _rate(self) -> float | None:
        """The server's measured prefill rate, tokens per second; None before it prefilled enough."""
        latest = self._sight.latest
        counters = latest.counters if latest is not None else None
        return savings.measured_rate(counters) if counters is not None else None

    def _saved(self, action: policy.Save, record: records.SaveRecord) -> None:
        """What the outcome of a save means for the slot and the link."""
        if record.cause is None:
            self._sight.set_link(probe.Link(True))
            self._policy.settle(action.slot, action.signature)
        elif record.cause in (Cause.EMPTY, Cause.BELOW_MIN_TOKENS, Cause.WITHIN_WINDOW):
            self._policy.settle(action.slot, action.signature, kept=False)
        elif record.cause is not Cause.SLOT_BUSY:  # busy: the policy proposes it again once idle
            self._policy.defer(action.slot, self._clock.monotonic() + RETRY_AFTER)
            if record.cause is Cause.NOT_LINKED:
                self._sight.set_link(probe.Link(False, record.detail))
            elif record.cause is Cause.NOT_SUPPORTED:
                self._sight.set_link(probe.not_supported(str(self._snapshots.staging)))

    async def final_snapshots(self) -> None:
        """Save every changed, idle slot once more before the process exits; never wake a sleeping server.

        Saves whose commit waits are committed too, whatever the server's state.
        """
        try:
            await self._final_snapshots()
            await self.commit_written(quiet=True)
        finally:
            self._actions.sweep()  # files of actions cut short now; the next start-up cleans later ones

    async def _final_snapshots(self) -> None:
        obs = self._sight.latest
        if obs is not None and obs.sleeping:
            log.info("final_snapshot_skipped", reason=ASLEEP)
            return
        if obs is None or not self._sight.ready(obs):
            log.info("final_snapshot_skipped", reason="llama-server is not up, or its slots were not read")
            return
        try:
            _, sleeping = await self._client.props()  # /props does not wake a sleeping server; /slots would
            if sleeping:
                log.info("final_snapshot_skipped", reason=ASLEEP)
                return
            fresh = await self._actions.slots()
        except errors.UpstreamError as exc:
            log.warning("final_snapshot_skipped", reason=f"cannot read the server's state: {exc}")
            return
        self._policy.observe(fresh, self._clock.monotonic())
        todo = self._policy.final()
        if not todo:
            log.info("final_snapshot_nothing_to_save")
        for action in todo:
            await self.save(action)

    async def commit_written(self, *, quiet: bool) -> None:
        """Commit the saves whose commit waits (see :mod:`sidecar.save.snapshotter`) once due.

        ``quiet``: no slot is processing: commit them all now. Otherwise commit
        only those that have waited ``snapshotter.COMMIT_WAIT``, paced.
        """
        before = self.saver.commit_due(quiet=quiet)
        if before is None:
            return
        async with self._actions.lock:
            await self.saver.commit_pending(pause=0.0 if quiet else hashing.PACE, written_before=before)

    def _committed_later(self, written: snapshotter.Written, record: records.SaveRecord) -> None:
        """A save whose commit waited: it was taken as saved; if the commit failed, the slot is due again."""
        if written.epoch != self._sight.server.epoch:
            return  # a save of an earlier server process: its slots are gone
        if record.cause is None:
            self._sight.set_link(probe.Link(True))
        else:
            self._policy.unsettle(written.action.slot, written.action.signature, self._clock.monotonic())
            self._saved(written.action, record)

    async def expire(self) -> None:
        """Apply --max-age on an idle server too: retention otherwise runs only after a commit."""
        now = self._clock.monotonic()
        if self._max_age <= 0 or now < self._next_age_check:
            return
        self._next_age_check = now + min(AGE_CHECK_EVERY, self._max_age / 4)
        async with self._actions.lock:
            await self.saver.garbage.collect()

    def export_unsaved(self) -> None:
        """Each slot's oldest unsaved change as Unix time (0: none), from the policy's monotonic one; the
        re-prefill its unsaved tokens would cost and the stall a save of it would cause."""
        now_mono, now_wall = self._clock.monotonic(), self._clock.wall()
        rate, pace = self._rate(), self.saver.pace
        for slot in range(self._sight.slot_count):
            since = self._policy.unsaved_since(slot)
            label = str(slot)
            self._stats.unsaved_since.labels(label).set(0 if since is None else now_wall - (now_mono - since))
            reprefill = stallweigh.reprefill_seconds(self._policy.unsaved_tokens(slot), rate)
            self._stats.unsaved_reprefill.labels(label).set(reprefill or 0.0)
            track = self._policy.tracks.get(slot)
            stall = stallweigh.stall_seconds(track.signature.tokens if track and track.signature else 0, pace)
            self._stats.save_expected_stall.labels(label).set(stall or 0.0)
