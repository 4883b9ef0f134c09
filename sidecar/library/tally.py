"""The placer's counts: requests it did not route, and each routed one by its own answer. I/O (metrics, logs)."""

from __future__ import annotations

import structlog

from sidecar.core import metrics, outcomes
from sidecar.library import ramuse, seams, verdict
from sidecar.proxy import answer

log = structlog.get_logger("sidecar.library")


class Tally:
    def __init__(self, *, stats: metrics.Metrics, engine: seams.Slots, ram: ramuse.RamUse) -> None:
        self._stats = stats
        self._engine = engine
        self._ram = ram
        self._said: set[str] = set()
        self._unrouted_counts = {
            reason: stats.conversation_unrouted.labels(reason.value) for reason in outcomes.Unrouted
        }

    def unrouted(self, reason: outcomes.Unrouted, detail: str) -> None:
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

    def answered(self, planned: verdict.Planned, ended: answer.Ended, slot: int | None) -> None:
        """Count a routed request by its own answer; ``slot``: the one it ran in."""
        found = verdict.judge(planned, status=ended.status, outcome=ended.outcome, cached=ended.cached)
        log.info(
            "request_answered",
            planned=planned.source.value,
            planned_slot=planned.slot,
            slot=slot,
            restored_tokens=planned.restored,
            reused_tokens=ended.cached,
            source=found.source.value if found.source is not None else None,
            unserved=found.unserved.value if found.unserved is not None else None,
            status=ended.status,
        )
        if planned.source is outcomes.Source.RAM and found.source is not None:
            self._ram.judged(found.source is outcomes.Source.RAM)
        if found.source is not None:
            self._stats.conversation_requests.labels(found.source.value).inc()
        if found.unserved is not None:
            self._stats.conversation_unserved.labels(found.unserved.value).inc()
        if found.library_tokens:
            self._stats.library_tokens.inc(found.library_tokens)
        if slot is not None and found.reused is not None:
            self._engine.answered(slot, found.reused)
