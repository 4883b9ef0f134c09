"""The engine's admin view: one frozen ``report.Status`` on demand, and the admin's save and restore.

The HTTP layer reads the engine only through this view (the seam is
``report.Engines``); it reads the other parts of the engine and keeps
no state of its own.
"""

from __future__ import annotations

from sidecar.core import redact
from sidecar.engine import consumer, part, report, runner, saves
from sidecar.restore import restorer
from sidecar.save import policy


class StatusView(part.Part):
    def __init__(
        self,
        wiring: part.Wiring,
        *,
        saving: saves.Saves,
        consuming: consumer.Consumer,
        running: runner.Runner,
    ) -> None:
        super().__init__(wiring)
        self._saves = saving
        self._consumer = consuming
        self._runner = running

    def status(self) -> report.Status:
        """What the engine knows now, for the HTTP layer."""
        latest = self._sight.latest
        return report.Status(
            server_url=redact.url(self._client.url),
            observation=latest,
            identity=self._sight.identity,
            link_ok=self._sight.server.link.ok,
            link_problem=self._sight.server.link.problem,
            last_snapshot=self._saves.saver.records.last,
            last_restore=tuple(self._restorer.verifier.last),
            # The older of the two: the last poll handled, and the start of the action runner's
            # current pass or the end of its last file check (a hung disk or call stops the runner,
            # not the polls).
            progress_at=min(self._consumer.handled_at, self._runner.progress() or self._consumer.handled_at),
            acting=self._runner.progress() is not None or self._runner.acting(),
            restore_gate=self._gate.life.closed_because,
            saved=self._restorer.verifier.savings.totals(),
            recent=tuple(self._restorer.verifier.recent),
            slot_since=self._slot_since(),
            check=self._restorer.checks.checking,
            low_disk=self._saves.saver.low_disk,
        )

    def _slot_since(self) -> tuple[tuple[int, float], ...]:
        """When each slot's content last changed, in Unix time (the policy keeps monotonic time)."""
        offset = self._clock.wall() - self._clock.monotonic()
        return tuple((slot, track.changed_at + offset) for slot, track in sorted(self._policy.tracks.items()))

    async def save_now(self, slot: int) -> report.SaveReply | None:
        """An admin's save of ``slot``; None when the newest poll shows no such slot holding tokens."""
        view = self._sight.latest.slot(slot) if self._sight.latest is not None else None
        if view is None or view.signature is None:
            return None
        ok = await self._saves.save(policy.Save(view.id, view.signature, view.tokens, policy.SaveReason.MANUAL))
        return report.SaveReply(ok, self._saves.saver.records.last)

    async def restore_now(self) -> list[restorer.RestoreRecord]:
        """An admin's restore round into the slots that are empty now."""
        return await self._runner.restore_now()
