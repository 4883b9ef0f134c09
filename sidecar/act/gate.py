"""The restore gate: closed while llama-server cannot yet serve a request with its restored KV.

The engine drives it from its observations: it closes the gate when a poll
finds the server down or loading and when a restore round becomes owed (a
restart, a wake-up, the sidecar's own start), and opens it once a poll has
seen the server up and the owed round is done (or there is nothing the
sidecar can restore). The proxy waits at it with completion requests, and
``/readyz`` reports it.

The proxy also closes it, with :meth:`Gate.suspect`, as soon as a request
fails to reach llama-server or its sentinel connection drops: the proxy sees a
crash before the poller does, and the poller is asked to poll at once.
A suspicion is cleared only by a poll that *started after it*; a poll that
was already in flight saw the old process, and opening on its word would let
a retrying client reach the new process before the restore round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("sidecar.proxy.gate")

NOT_POLLED = "the sidecar has not seen llama-server up yet"


class Gate:
    def __init__(self, *, mono: Callable[[], float] = time.monotonic) -> None:
        self._mono = mono
        self._open = asyncio.Event()
        self._reason = NOT_POLLED
        self._suspect_at: float | None = None
        self.waiting = 0
        """Requests waiting at the gate now."""
        self.on_suspect: Callable[[], None] | None = None
        """Called on each suspicion: the poller polls at once, so the suspicion is cleared (or confirmed) soon."""

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def reason(self) -> str:
        """Why the gate is closed ("" while it is open)."""
        return "" if self._open.is_set() else self._reason

    def close(self, reason: str) -> None:
        if self._open.is_set() or reason != self._reason:
            log.info("restore_gate_closed", reason=reason, waiting=self.waiting)
        self._reason = reason
        self._open.clear()

    def suspect(self, reason: str) -> None:
        """Close until a poll that starts from now on sees the server up (and any restore is done)."""
        self._suspect_at = self._mono()
        self.close(reason)
        if self.on_suspect is not None:
            self.on_suspect()

    def open(self, *, seen_at: float) -> None:
        """Open, on the word of a poll that started at ``seen_at`` (the poller's monotonic clock)."""
        if self._suspect_at is not None and seen_at <= self._suspect_at:
            return
        self._suspect_at = None
        if not self._open.is_set():
            log.info("restore_gate_open", was=self._reason, waiting=self.waiting)
            self._open.set()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the gate to be open; False if it stayed closed."""
        if self._open.is_set():
            return True
        self.waiting += 1
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._open.wait()
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True
