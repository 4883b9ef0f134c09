"""Putting snapshots back after a restart, and checking that it helped.

:class:`Restorer` is the face the engine's parts see; the work is split by job:
the files' checks (:mod:`sidecar.restore.filechecks`), the round and the swap
(:mod:`sidecar.restore.rounds`), one restore call and its answer
(:mod:`sidecar.restore.send`), and the verdict of the slot's next task
(:mod:`sidecar.restore.verify`). How the restore window is kept small and
what counts as ``ok``: ``docs/modules.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.core import events, metrics, protocols
from sidecar.restore import ahead, filechecks, records, rounds, send, verify
from sidecar.slots import actions
from sidecar.snapshots import manifest, store

RestoreRecord = records.RestoreRecord
Done = records.Done
Unverified = records.Unverified
Check = records.Check
Order = records.Order
RECENT = records.RECENT
EFFECTIVE_SHARE = verify.EFFECTIVE_SHARE
ineffective_hint = verify.ineffective_hint


class Restorer:
    def __init__(
        self,
        *,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        identity: Callable[[], events.Identity | None] = lambda: None,
        rebuilt_ahead: ahead.Ahead | None = None,
    ) -> None:
        """``identity``: the running server's identity as last read (what every snapshot must match).

        ``rebuilt_ahead``: where files are rebuilt from the block store while the server loads (else one of
        :class:`ahead.Ahead` on ``snapshots``).
        """
        self._stats = stats
        self._ahead = rebuilt_ahead if rebuilt_ahead is not None else ahead.Ahead(snapshots, stats)
        acts = records.Acts()
        tally = records.Tally(stats=stats, clock=clock)
        self.checks = filechecks.FileChecks(snapshots=snapshots, clock=clock, rebuilt_ahead=self._ahead, acts=acts)
        """The files' size and checksum checks: ahead while the server loads (``precheck``), the file being
        checked now (``checking``) and when the last check ended (``checked_at``, for liveness)."""
        self.verifier = verify.Verifier(stats=stats, clock=clock, identity=identity, tally=tally)
        """The verdict on each restore (``observe``, ``answered``, ``judge``, ``forget_pending``), the newest
        round's records (``last``), those awaiting a verdict (``unverified``), the ``savings`` and the
        ``recent`` restores."""
        sender = send.Sender(
            slot_actions=slot_actions,
            snapshots=snapshots,
            stats=stats,
            clock=clock,
            rebuilt_ahead=self._ahead,
            acts=acts,
            tally=tally,
            verifier=self.verifier,
        )
        self._round = rounds.Round(
            slot_actions=slot_actions,
            snapshots=snapshots,
            identity=identity,
            checks=self.checks,
            rebuilt_ahead=self._ahead,
            acts=acts,
            tally=tally,
            sender=sender,
            verifier=self.verifier,
        )

    @property
    def ahead(self) -> bool:
        """Whether files rebuilt ahead wait for a restore round (give them back with :meth:`drop_ahead`)."""
        return self._ahead.pending

    async def drop_ahead(self) -> None:
        """Delete the files rebuilt ahead that no restore took (no restore round came)."""
        await self._ahead.discard()

    async def restore_all(
        self,
        identity: events.Identity,
        *,
        healthy_at: float | None,
        counters: events.Counters | None,
        order: Order | None = None,
    ) -> dict[int, manifest.Manifest] | None:
        """One restore round into every idle, empty slot (see :meth:`rounds.Round.restore_all`)."""
        return await self._round.restore_all(identity, healthy_at=healthy_at, counters=counters, order=order)

    def rebuild_ahead(self, record: manifest.Manifest) -> bool:
        """Begin rebuilding ``record`` for a swap while its slot is saved (see :meth:`ahead.Ahead.start`)."""
        return self._ahead.start(record)

    def rebuilt_ahead_done(self, record: manifest.Manifest) -> None:
        """The swap :meth:`rebuild_ahead` began for is over: its file goes back unless a restore took it."""
        self._ahead.finish(record)

    async def swap_in(
        self, slot: int, candidate: manifest.Manifest, *, counters: events.Counters | None, checked: bool = False
    ) -> tuple[RestoreRecord, events.SlotView | None]:
        """Restore ``candidate`` into ``slot``, replacing what it holds (see :meth:`rounds.Round.swap_in`)."""
        return await self._round.swap_in(slot, candidate, counters=counters, checked=checked)

    def refusal(self, candidate: manifest.Manifest, *, n_ctx: int) -> str:
        """Why ``candidate`` cannot go into a slot of ``n_ctx`` on the running server; "" if it can."""
        return self._round.refusal(candidate, n_ctx=n_ctx)
