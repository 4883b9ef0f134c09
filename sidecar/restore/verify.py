"""The verdict on each restore: whether the slot's next task reused its tokens, and what that saved."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import structlog

from sidecar.core import events, metrics, outcomes, protocols
from sidecar.restore import records, savings

log = structlog.get_logger("sidecar.restore")
EFFECTIVE_SHARE = 0.5
"""Share of the restored tokens the server must reuse for a restore to count as effective."""
Outcome = outcomes.RestoreOutcome
_VERDICTS = {
    Outcome.OK: "the slot's next request reused it",
    Outcome.INEFFECTIVE: "the slot's next request did not reuse it: on this sliding-window model a restored "
    "snapshot is reused only by a request that extends all of its tokens",
    Outcome.UNVERIFIED: "nothing decided whether the server reused it before it was lost (a restart, no "
    "readable /metrics, or other slots' tasks mixed into the server's reuse counter)",
}


class Verifier:
    def __init__(
        self,
        *,
        stats: metrics.Metrics,
        clock: protocols.Clock,
        identity: Callable[[], events.Identity | None],
        tally: records.Tally,
    ) -> None:
        """``identity``: the running server's identity as last read."""
        self._stats = stats
        self._clock = clock
        self._identity = identity
        self._tally = tally
        self.last: list[records.RestoreRecord] = []
        """The newest restore round's records, by slot (a verdict rewrites an unverified one)."""
        self.unverified: dict[int, records.Unverified] = {}
        """Restores waiting for their verification (the slot's next task), by slot."""
        self._memory: events.Memory | None = None
        """The model's memory kind, as the newest judged observation's identity says (for the hints)."""
        self.savings = savings.Savings()
        """Prefill seconds the effective restores and swaps saved."""
        self.recent: collections.deque[records.Done] = collections.deque(maxlen=records.RECENT)
        """The newest restores and swaps that put tokens back, oldest first."""
        self._verification_off_said = False

    def hold(
        self, done: records.Done, task: int | None, counters: events.Counters | None, since: float | None
    ) -> records.RestoreRecord:
        """Keep a restore that put ``done.tokens`` back until the slot's next task (after ``task``) judges it.

        Counted ok now; on a sliding-window model counted only once that task shows whether the server reused it.
        """
        identity = self._identity()
        sliding = identity is not None and identity.memory in (events.Memory.SWA, events.Memory.SWA_FULL)
        self.recent.append(done)
        self.unverified[done.slot] = records.Unverified(
            tokens=done.tokens,
            cached_before=counters.cached_tokens if counters else None,
            task=task,
            at=self._clock.monotonic(),
            by=done.by,
            serial=done.serial,
            uncounted=sliding,
        )
        if not sliding:
            return self._tally.count(done.slot, Outcome.OK, "", done.file, done.tokens, done.seconds, since)
        log.info(
            "restore_unverified",
            slot=done.slot,
            file=done.file,
            reason="the model uses sliding-window attention: llama-server reuses a restored window only for a "
            "request that extends all of its tokens",
            effect="shown as unverified in /status; counted in restores_total once the slot's next request "
            "shows whether the server reused it (ok) or not (ineffective)",
        )
        detail = "waiting for the slot's next request to show whether the server reuses it"
        return records.RestoreRecord(
            done.slot, Outcome.UNVERIFIED, detail, self._clock.wall(), done.file, done.tokens, done.seconds, since
        )

    def observe(self, obs: events.Observation, identity: events.Identity | None) -> None:
        """Follow the server's measured prefill rate (fresh counters only); price what waited for it."""
        for priced in self.savings.observe(obs.counters if obs.counters_fresh else None, identity):
            self._saved(priced)

    def _saved(self, priced: savings.Priced) -> None:
        self._stats.prefill_saved_seconds.labels(priced.by.value).inc(priced.seconds)
        self._stats.prefill_saved_tokens.labels(priced.by.value).inc(priced.tokens)

    def answered(self, slot: int, reused: int) -> None:
        """The slot's next task reused ``reused`` prompt tokens, as its own answer says: judge its restore."""
        pending = self.unverified.pop(slot, None)
        if pending is not None:
            self._verdict(slot, pending, reused)

    def judge(self, obs: events.Observation) -> None:
        """Judge the unverified restores whose slot has run a task that started after the restore."""
        tasks = {view.id: view.task for view in obs.slots or ()}
        if obs.identity is not None:
            self._memory = obs.identity.memory
        for view in obs.slots or ():
            pending = self.unverified.get(view.id)
            if pending is None or view.task is None or view.processing or obs.at <= pending.at:
                continue
            others = tuple(sorted((slot, task) for slot, task in tasks.items() if slot != view.id))
            if pending.others is None:
                pending = self.unverified[view.id] = dataclasses.replace(pending, others=others)
            if pending.task is not None and view.task <= pending.task:
                continue  # no task since the restore
            counters = obs.counters if obs.counters_fresh else None
            if counters is None and obs.counters is not None:
                continue  # counters carried over from an earlier poll: wait for fresh ones
            del self.unverified[view.id]
            if counters is None or pending.cached_before is None:
                self._decided(view.id, pending, Outcome.UNVERIFIED)
                if not self._verification_off_said:
                    log.warning(
                        "restore_verification_off",
                        reason="llama-server's /metrics is not readable",
                        hint="start llama-server with --metrics to check that restores save prefill",
                    )
                    self._verification_off_said = True
                continue
            if pending.others != others:
                self._stats.restore_verifications.labels(outcomes.Verification.UNVERIFIED.value).inc()
                self._decided(view.id, pending, Outcome.UNVERIFIED)
                log.info(
                    "restore_unverified",
                    slot=view.id,
                    restored_tokens=pending.tokens,
                    reason="other slots ran tasks too: the server-wide reuse counter mixes their reuse with this "
                    "slot's",
                    hint="send requests through the proxy (--proxy-listen): each answer's own reuse figure judges it",
                )
                continue
            self._verdict(view.id, pending, counters.cached_tokens - pending.cached_before)

    def _verdict(self, slot: int, pending: records.Unverified, reused: float) -> None:
        effective = reused >= EFFECTIVE_SHARE * pending.tokens
        priced = self._judged(pending, reused) if effective else None
        self._note(pending.serial, effective, reused, priced)
        self._decided(slot, pending, Outcome.OK if effective else Outcome.INEFFECTIVE)
        if effective:
            self._stats.restore_verifications.labels(outcomes.Verification.EFFECTIVE.value).inc()
            log.info(
                "restore_effective",
                slot=slot,
                by=pending.by.value,
                restored_tokens=pending.tokens,
                reused_tokens=reused,
                saved_seconds=round(priced.seconds, 3) if priced is not None else None,
            )
            return
        self._stats.restore_verifications.labels(outcomes.Verification.INEFFECTIVE.value).inc()
        log.warning(
            "restore_ineffective",
            slot=slot,
            restored_tokens=pending.tokens,
            reused_tokens=reused,
            memory=self._memory.value if self._memory is not None else events.Memory.UNKNOWN.value,
            hint=ineffective_hint(self._memory),
        )

    def forget_pending(self) -> None:
        """The restored slots are gone (a restart, a wake-up): count the restores nothing decided."""
        for slot, pending in sorted(self.unverified.items()):
            self._decided(slot, pending, Outcome.UNVERIFIED)
        self.unverified.clear()

    def _decided(self, slot: int, pending: records.Unverified, outcome: outcomes.RestoreOutcome) -> None:
        """Count a restore that waited for its verdict (``pending.uncounted``), and show it in /status."""
        if not pending.uncounted:
            return
        self._stats.restores.labels(str(slot), outcome.value).inc()
        self._stats.count_model(self._stats.model_restores, outcome.value)
        self.last = [
            dataclasses.replace(r, result=outcome, detail=_VERDICTS[outcome])
            if r.slot == slot and r.result is Outcome.UNVERIFIED
            else r
            for r in self.last
        ]

    def _judged(self, pending: records.Unverified, reused: float) -> savings.Priced | None:
        """Count the prefill an effective restore spared; None while no rate prices it."""
        priced = self.savings.reused(pending.by, savings.saved_tokens(restored=pending.tokens, reused=reused))
        if priced is not None:
            self._saved(priced)
        return priced

    def _note(self, serial: int, effective: bool, reused: float, priced: savings.Priced | None) -> None:
        verdict = outcomes.Verification.EFFECTIVE if effective else outcomes.Verification.INEFFECTIVE
        for i, done in enumerate(self.recent):
            if done.serial == serial:
                self.recent[i] = dataclasses.replace(
                    done,
                    verdict=verdict,
                    reused_tokens=max(0, int(reused)),
                    saved_seconds=priced.seconds if priced is not None else None,
                )
                return


def ineffective_hint(kind: events.Memory | None) -> str:
    """What to do about a restore the server did not reuse, by the model's memory kind. Pure."""
    if kind in (events.Memory.RECURRENT, events.Memory.HYBRID):
        return (
            "the model's state cannot be cut back (recurrent or hybrid layers; --swa-full changes nothing on it): "
            "a restored snapshot serves only a request that holds every one of its tokens, and the next request "
            "diverged before the snapshot's end (a regenerate, an edited history, another conversation)"
        )
    if kind is events.Memory.SWA:
        return (
            "the server re-prefilled instead of reusing the restored KV: a restored sliding-window snapshot "
            "serves only a request that holds every one of its tokens (its windowed layers cannot be cut back), "
            "and the next request diverged before the snapshot's end (a regenerate, an edited history, another "
            "conversation), or the snapshot held no more tokens than the window (those are re-prefilled); "
            "with --swa-full a restore can also be cut back by less than the window"
        )
    if kind is events.Memory.SWA_FULL:
        return (
            "the server re-prefilled instead of reusing the restored KV: the next request shared few tokens with "
            "the snapshot (a different conversation), or diverged from it more than the model's window before "
            "its end (a restored windowed layer holds only the window, even with --swa-full)"
        )
    return (
        "the server re-prefilled instead of reusing the restored KV: the next request shared few tokens with "
        "the snapshot (a different conversation)"
    )
