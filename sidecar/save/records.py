"""What a save leaves behind: its record, counted in the metrics and logged, the newest kept for /status.

Every save attempt ends in one :class:`SaveRecord`, made here: a save carried out (:mod:`.snapshotter`),
or one not made (below ``--min-tokens``, within a sliding window, a busy slot).
"""

from __future__ import annotations

import dataclasses

import structlog

from sidecar.core import errors, events, metrics, outcomes, protocols
from sidecar.observe import memory
from sidecar.save import policy

log = structlog.get_logger("sidecar.snapshot")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveRecord:
    """One save attempt; the newest is shown in /status."""

    slot: int
    result: outcomes.SaveResult
    cause: outcomes.SaveCause | None
    """Why the save did not end ``ok``; None when it did."""
    detail: str
    """The committed file, or what went wrong and what to do."""
    at: float
    """Unix time of the attempt's end."""
    seconds: float
    tokens: int
    bytes: int


class Records:
    """The save records of one engine: each counted, the newest kept (:attr:`last`)."""

    def __init__(self, *, stats: metrics.Metrics, clock: protocols.Clock) -> None:
        self._stats = stats
        self._clock = clock
        self.last: SaveRecord | None = None
        """The newest save attempt's record; None before the first."""

    def failed(self, slot: int, exc: errors.SnapshotError | errors.UpstreamError, seconds: float) -> SaveRecord:
        """The record of a save or commit that raised ``exc``."""
        if isinstance(exc, errors.UpstreamNotSupported):
            detail = f"{exc}: start llama-server with --slot-save-path set to the sidecar's --slot-dir"
            return self.fail(slot, outcomes.SaveCause.NOT_SUPPORTED, detail, seconds)
        if isinstance(exc, errors.UpstreamError):
            return self.fail(slot, outcomes.SaveCause.SERVER, str(exc), seconds)
        if exc.reason == outcomes.SnapshotProblem.EMPTY:
            log.info("snapshot_skipped_empty", slot=slot, reason=str(exc))
            return self.record(slot, outcomes.SaveCause.EMPTY, str(exc), seconds=seconds)
        cause = (
            outcomes.SaveCause.NOT_LINKED
            if exc.reason == outcomes.SnapshotProblem.MISSING
            else outcomes.SaveCause.CHECK
        )
        return self.fail(slot, cause, str(exc), seconds)

    def skip(self, action: policy.Skip) -> SaveRecord:
        log.info("snapshot_skipped", slot=action.slot, reason=action.why)
        return self.record(action.slot, outcomes.SaveCause.BELOW_MIN_TOKENS, action.why, tokens=action.signature.tokens)

    def within_window(self, action: policy.Save, identity: events.Identity) -> SaveRecord | None:
        """The record of a save not made because a sliding-window model's slot fits in its window (no restore
        of it could be reused: there is no position below the window for the cell); None: save it."""
        if identity.memory is not events.Memory.SWA:
            return None
        window = memory.window_of_file(identity.model_path)
        if window is None or action.tokens > window.size:
            return None
        detail = (
            f"the slot holds {action.tokens} tokens, no more than the model's window of {window.size}: "
            "llama-server would re-prefill a restore of it anyway (at most that many tokens), and the "
            "library leaves the conversation to the server's own cache"
        )
        log.info("snapshot_skipped", slot=action.slot, reason=detail)
        return self.record(action.slot, outcomes.SaveCause.WITHIN_WINDOW, detail, tokens=action.tokens)

    def busy(self, action: policy.Save) -> SaveRecord:
        detail = (
            "the slot was processing a request when read right before the save: nothing is sent to a busy "
            "slot (the server would hold the call until the request ends); it is saved once idle"
        )
        log.info("snapshot_skipped_busy", slot=action.slot, reason=action.reason.value)
        return self.record(action.slot, outcomes.SaveCause.SLOT_BUSY, detail, tokens=action.tokens)

    def fail(self, slot: int, cause: outcomes.SaveCause, detail: str, seconds: float) -> SaveRecord:
        log.error("snapshot_failed", slot=slot, cause=cause.value, error=detail)
        return self.record(slot, cause, detail, seconds=seconds)

    def record(
        self,
        slot: int,
        cause: outcomes.SaveCause | None,
        detail: str,
        *,
        seconds: float = 0.0,
        tokens: int = 0,
        size: int = 0,
        result: outcomes.SaveResult | None = None,
    ) -> SaveRecord:
        """``result``: None, the cause's (``ok`` without one, ``skipped`` or ``failed``)."""
        if result is None and cause is None:
            result = outcomes.SaveResult.OK
        elif result is None:
            result = outcomes.SaveResult.SKIPPED if cause in outcomes.SKIP_CAUSES else outcomes.SaveResult.FAILED
        self._stats.snapshots.labels(str(slot), result.value).inc()
        self._stats.count_model(self._stats.model_snapshots, result.value)
        self.last = SaveRecord(slot, result, cause, detail, self._clock.wall(), seconds, tokens, size)
        return self.last
