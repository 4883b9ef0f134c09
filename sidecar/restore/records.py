"""What a restore leaves behind: its record, counted in the metrics, and what waits for its verdict."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import structlog

from sidecar.core import metrics, outcomes, protocols
from sidecar.restore import plan
from sidecar.snapshots import manifest

log = structlog.get_logger("sidecar.restore")
Outcome = outcomes.RestoreOutcome
RECENT = 20
"""Restores and swaps kept in :attr:`sidecar.restore.verify.Verifier.recent`."""


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreRecord:
    slot: int
    result: outcomes.RestoreOutcome
    detail: str
    at: float
    """Unix time of the attempt's end."""
    file: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    since_healthy: float | None = None

    @property
    def restored(self) -> bool:
        """The server holds the snapshot now (counted ``ok``, or waiting for its verdict)."""
        return self.result in (Outcome.OK, Outcome.UNVERIFIED)


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """A restore or swap that put tokens back, and what the slot's next task made of it (for the page)."""

    serial: int
    by: outcomes.SavedBy
    slot: int
    file: str
    tokens: int
    seconds: float
    at: float
    """Unix time the restore call ended."""
    verdict: outcomes.Verification | None = None
    """None while the slot's next task has not run (or could not be judged: no /metrics, a restart)."""
    reused_tokens: int = 0
    saved_seconds: float | None = None
    """Prefill seconds it saved; None until judged effective and priced."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unverified:
    """A restore waiting for the slot's next task to show whether the server reused it."""

    tokens: int
    cached_before: float | None
    task: int | None
    """The slot's ``id_task`` read right after the restore: only a later task may judge it."""
    at: float
    """Monotonic time the restore ended: only counters read after it may judge it."""
    by: outcomes.SavedBy = outcomes.SavedBy.RESTORE
    """What put the tokens back: a restore round or a library swap."""
    serial: int = 0
    """The :class:`Done` entry the verdict goes to."""
    others: tuple[tuple[int, int | None], ...] | None = None
    """The other slots' ``id_task`` at the first poll after the restore: if one moves, the counter is not
    this slot's alone."""
    uncounted: bool = False
    """Not counted in ``restores_total`` yet (a sliding-window model): the verdict decides ok or ineffective."""


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """A snapshot file being checked now (for liveness: a hash that hangs is a stuck sidecar)."""

    file: str
    deadline: float
    """Monotonic time by which the check gives up (``hashing.deadline_for`` its size)."""


class Order(Protocol):
    """A restore round's order: what goes next and where, and who is told of each restore as it lands."""

    async def next_step(self, pending: tuple[int, ...]) -> plan.Step:
        """What to restore next into one of ``pending`` (not empty), as :func:`plan.plan` says; may wait."""

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """``record`` is restored into ``slot``, before the round goes on."""


class Acts:
    """Files hashed and restore calls made: a view of ``/slots`` read before either is no longer fresh."""

    def __init__(self) -> None:
        self.count = 0

    def mark(self) -> None:
        self.count += 1


class Tally:
    """Counts each restore attempt's outcome in the metrics and makes its record."""

    def __init__(self, *, stats: metrics.Metrics, clock: protocols.Clock) -> None:
        self._stats = stats
        self._clock = clock

    def count(
        self,
        slot: int,
        outcome: outcomes.RestoreOutcome,
        detail: str,
        file: str | None = None,
        tokens: int = 0,
        seconds: float = 0.0,
        since: float | None = None,
    ) -> RestoreRecord:
        self._stats.restores.labels(str(slot), outcome.value).inc()
        self._stats.count_model(self._stats.model_restores, outcome.value)
        if outcome not in (Outcome.OK, Outcome.RACED):
            log.info(
                "restore_skipped" if outcome is not Outcome.FAILED else "restore_not_done",
                slot=slot,
                result=outcome.value,
                reason=detail,
            )
        return RestoreRecord(slot, outcome, detail, self._clock.wall(), file, tokens, seconds, since)
