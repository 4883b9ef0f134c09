"""Putting snapshots back after a restart, and checking that it helped.

:class:`Restorer` is the face the engine's parts see; the work is split by job:
the files' checks (:mod:`sidecar.restore.filechecks`), the round and the swap
(:mod:`sidecar.restore.rounds`), one restore call and its answer
(:mod:`sidecar.restore.send`), and the verdict of the slot's next task
(:mod:`sidecar.restore.verify`). How the restore window is kept small and
what counts as ``ok``: ``docs/modules.md``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from sidecar.core import events, metrics, protocols
from sidecar.restore import ahead, filechecks, records, rounds, savings, send, verify
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
        self._checks = filechecks.FileChecks(snapshots=snapshots, clock=clock, rebuilt_ahead=self._ahead, acts=acts)
        self._verifier = verify.Verifier(stats=stats, clock=clock, identity=identity, tally=tally)
        sender = send.Sender(
            slot_actions=slot_actions,
            snapshots=snapshots,
            stats=stats,
            clock=clock,
            rebuilt_ahead=self._ahead,
            acts=acts,
            tally=tally,
            verifier=self._verifier,
        )
        self._round = rounds.Round(
            slot_actions=slot_actions,
            snapshots=snapshots,
            identity=identity,
            checks=self._checks,
            rebuilt_ahead=self._ahead,
            acts=acts,
            tally=tally,
            sender=sender,
            verifier=self._verifier,
        )

    @property
    def last(self) -> list[RestoreRecord]:
        """The newest restore round's records, by slot."""
        return self._verifier.last

    @property
    def unverified(self) -> dict[int, Unverified]:
        """Restores waiting for their verification (the slot's next task), by slot."""
        return self._verifier.unverified

    @property
    def savings(self) -> savings.Savings:
        """Prefill seconds the effective restores and swaps saved."""
        return self._verifier.savings

    @property
    def recent(self) -> collections.deque[Done]:
        """The newest restores and swaps that put tokens back, oldest first."""
        return self._verifier.recent

    @property
    def checking(self) -> Check | None:
        """The file being checked now; None between checks."""
        return self._checks.checking

    @property
    def checked_at(self) -> float:
        """Monotonic time the last check ended (progress, for liveness)."""
        return self._checks.checked_at

    async def precheck(self, *, rebuild: bool = False) -> None:
        """Check the newest good snapshot of every slot now, so the restore round does not hash (see
        :meth:`filechecks.FileChecks.precheck`)."""
        await self._checks.precheck(rebuild=rebuild)

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

    def observe(self, obs: events.Observation, identity: events.Identity | None) -> None:
        """Follow the server's measured prefill rate (fresh counters only); price what waited for it."""
        self._verifier.observe(obs, identity)

    def answered(self, slot: int, reused: int) -> None:
        """The slot's next task reused ``reused`` prompt tokens, as its own answer says: judge its restore."""
        self._verifier.answered(slot, reused)

    def judge(self, obs: events.Observation) -> None:
        """Judge the unverified restores whose slot has run a task that started after the restore."""
        self._verifier.judge(obs)

    def forget_pending(self) -> None:
        """The restored slots are gone (a restart, a wake-up): count the restores nothing decided."""
        self._verifier.forget_pending()
