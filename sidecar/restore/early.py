"""One restore round's order, and the requests it lets through before it ends.

Requests held at the restore gate name the snapshot they want; the round restores those first, each
into the slot its request will run in, and lets each request go on as soon as its snapshot is back.
The rest of the round then waits, for a bounded time, while such a request runs: llama-server runs
one task at a time, so a restore beside it would stall it.

Invariants and trade-offs: docs/modules.md, `sidecar/restore/early.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from sidecar.restore import plan
from sidecar.snapshots import manifest

log = structlog.get_logger("sidecar.proxy.gate")

WANT_SECONDS = 0.1
"""Seconds a round waits, before its first restore, for held requests still reading their token ids to name
their snapshot (the ids usually come from the sidecar's token cache in well under that)."""
QUIET_SECONDS = 1.0
"""Seconds after the first request let through early that the rest of the round may wait for such requests to
end; then it goes on beside them."""


class Round:
    """The wants, the restored slots and the requests let through early of one restore round."""

    def __init__(self) -> None:
        self.wants: dict[str, int] = {}
        """Requests waiting for each snapshot to be restored, by file, in the order the files were first wanted."""
        self.ready: set[int] = set()
        """Slots this round has restored."""
        self.landed: set[str] = set()
        """Snapshot files this round has restored."""
        self.tried: set[str] = set()
        """Wanted snapshot files this round has planned a restore of (restored or not: never planned twice)."""
        self.passed = 0
        """Requests let through early that have not ended."""
        self.early = 0
        """Requests let through early in all (for the gate's open log line)."""
        self._ready: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Event()
        self._started: float | None = None
        self._passed_at: float | None = None
        self._restored_at: float | None = None

    def changed(self) -> None:
        """Something :meth:`next_slot` decides on changed: a want, a waiting or naming request, a pass."""
        self._changed.set()

    def restored(self, slot: int, file: str) -> None:
        """Snapshot ``file`` is restored into ``slot``: the requests waiting for it may go."""
        self.ready.add(slot)
        self.landed.add(file)
        self._restored_at = asyncio.get_running_loop().time()
        self.event(file).set()

    def event(self, file: str) -> asyncio.Event:
        """Set once snapshot ``file`` is restored in this round."""
        return self._ready.setdefault(file, asyncio.Event())

    def want(self, file: str, more: int) -> None:
        """One more (``more`` 1) or one fewer (-1) request waiting for snapshot ``file``."""
        left = self.wants.get(file, 0) + more
        if left > 0:
            self.wants[file] = left
        else:
            self.wants.pop(file, None)
        self.changed()

    def went(self) -> None:
        """A request went on early."""
        self.passed += 1
        self.early += 1
        if self._passed_at is None:
            self._passed_at = asyncio.get_running_loop().time()

    def ended(self) -> None:
        """A request let through early ended."""
        self.passed -= 1
        log.info(
            "restore_early_request_ended",
            still_running=self.passed,
            effect="the rest of the restore round goes on once no request let through early runs",
        )
        self.changed()

    def _going(self) -> bool:
        """Whether a request waits for a snapshot this round has restored: it is about to go on early."""
        return any(file in self.landed for file in self.wants)

    async def next_step(
        self,
        pending: Sequence[int],
        waiting: Callable[[], int],
        unnamed: Callable[[], int],
        snapshots: Callable[[], Sequence[manifest.Manifest]],
    ) -> plan.Step:
        """What to restore next, into one of ``pending`` (not empty); waits as the module says.

        ``waiting``: how many requests wait at the gate now; ``unnamed``: how many of them are to name
        the snapshot they wait for once their ids are read, and have not yet; ``snapshots``: every
        committed snapshot now.
        """
        loop = asyncio.get_running_loop()
        if self._started is None:
            self._started = loop.time()
        while True:
            self._changed.clear()
            step = plan.plan(pending, tuple(self.wants), snapshots(), done=self.landed | self.tried)[0]
            if step.wanted is not None:
                self.tried.add(step.wanted)
                return step
            now = loop.time()
            until: float | None = None
            if unnamed() and now < self._started + WANT_SECONDS:
                until = self._started + WANT_SECONDS
            elif self._going() and self._restored_at is not None and now < self._restored_at + QUIET_SECONDS:
                until = self._restored_at + QUIET_SECONDS  # they go on within a few steps: then the wait below
            elif self.passed > 0 and not waiting() and self._passed_at is not None:
                until = self._passed_at + QUIET_SECONDS if now < self._passed_at + QUIET_SECONDS else None
            if until is None:
                return step
            try:
                async with asyncio.timeout(until - now):
                    await self._changed.wait()
            except TimeoutError:
                pass
