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

A request waits with :meth:`Gate.hold`, the one place that counts it in
``proxy_held_requests`` while it waits and observes its whole wait in
``proxy_hold_seconds`` (once per request, however many times it waited).

While the gate is closed for a restore round (the server answers, its slots
are being restored: ``close(..., serving=True)``), a waiting request may do
what touches no slot, so that it is done when the gate opens: the proxy has
a routed request's token ids read then (``meanwhile`` of :meth:`Hold.wait`).
The gate's ``restore_gate_open`` log line says how many did
(``prepared``).
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Awaitable, Callable

import structlog

from sidecar.core import metrics, protocols

log = structlog.get_logger("sidecar.proxy.gate")

NOT_POLLED = "the sidecar has not seen llama-server up yet"


class Gate:
    def __init__(
        self,
        *,
        clock: protocols.Clock | None = None,
        on_suspect: Callable[[], None] | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """``on_suspect`` is called on each suspicion: the poller polls at once, so the suspicion is
        cleared (or confirmed) soon. ``on_wait`` is called when a request starts waiting and none was:
        the poller polls at once, and keeps polling fast while requests wait."""
        self._clock = clock or protocols.SystemClock()
        self._open = asyncio.Event()
        self._reason = NOT_POLLED
        self._serving = asyncio.Event()
        """Closed for a restore round: the server answers, only its slots are not ready."""
        self.prepared = 0
        """Requests that started their slot-free work while the gate was closed, since it last opened."""
        self._suspect_at: float | None = None
        self.waiting = 0
        """Requests waiting at the gate now."""
        self._on_suspect = on_suspect
        self._on_wait = on_wait

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def reason(self) -> str:
        """Why the gate is closed ("" while it is open)."""
        return "" if self._open.is_set() else self._reason

    def close(self, reason: str, *, serving: bool = False) -> None:
        """``serving``: the server answers and only its slots are not ready (a restore round is owed)."""
        if self._open.is_set() or reason != self._reason:
            log.info("restore_gate_closed", reason=reason, waiting=self.waiting)
        self._reason = reason
        self._open.clear()
        if serving:
            self._serving.set()
        else:
            self._serving.clear()

    def suspect(self, reason: str) -> None:
        """Close until a poll that starts from now on sees the server up (and any restore is done)."""
        self._suspect_at = self._clock.monotonic()
        self.close(reason)
        if self._on_suspect is not None:
            self._on_suspect()

    def open(self, *, seen_at: float) -> None:
        """Open, on the word of a poll that started at ``seen_at`` (the poller's monotonic clock)."""
        if self._suspect_at is not None and seen_at <= self._suspect_at:
            return
        self._suspect_at = None
        self._serving.clear()
        if not self._open.is_set():
            log.info("restore_gate_open", was=self._reason, waiting=self.waiting, prepared=self.prepared)
            self.prepared = 0
            self._open.set()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the gate to be open; False if it stayed closed."""
        if self._open.is_set():
            return True
        self.waiting += 1
        if self.waiting == 1 and self._on_wait is not None:
            self._on_wait()
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._open.wait()
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True

    async def wait_meanwhile(self, timeout: float, work: Callable[[], Awaitable[object]]) -> bool:
        """:meth:`wait`, running ``work`` once the server answers while the gate stays closed for a restore round.

        ``work`` must touch no slot. Once it has started it is awaited (within ``timeout``) before this
        returns, so what it did is done when the caller goes on; if the gate opens before it started,
        it is not started at all. Errors of ``work`` are the caller's to avoid: they are dropped here.
        """
        started = asyncio.Event()

        async def when_serving() -> None:
            await self._serving.wait()
            if self._open.is_set():
                return
            started.set()
            self.prepared += 1
            await work()

        early = asyncio.ensure_future(when_serving())
        deadline = self._clock.monotonic() + timeout
        try:
            opened = await self.wait(timeout)
            if opened and started.is_set() and not early.done():
                await asyncio.wait({early}, timeout=max(deadline - self._clock.monotonic(), 0.0))
            return opened
        finally:
            early.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await early

    def hold(self, stats: metrics.Metrics) -> Hold:
        """One request's waits at this gate, counted in ``stats`` (use it as a ``with`` block)."""
        return Hold(self, stats, self._clock)


class Hold:
    """A request held at a gate: each :meth:`wait` counts it as held; leaving the ``with`` block observes
    the sum of its waits in ``proxy_hold_seconds`` if it waited at all."""

    def __init__(self, gate: Gate, stats: metrics.Metrics, clock: protocols.Clock) -> None:
        self._gate = gate
        self._stats = stats
        self._clock = clock
        self.seconds: float | None = None
        """Seconds waited so far; None until the first wait."""

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        if self.seconds is not None:
            self._stats.proxy_hold.observe(self.seconds)

    async def wait(
        self,
        timeout: float,
        *,
        after: Awaitable[object] | None = None,
        meanwhile: Callable[[], Awaitable[object]] | None = None,
    ) -> bool:
        """Wait up to ``timeout`` seconds for the gate to be open; False if it stayed closed.

        ``after``: awaited first, within the same ``timeout`` (router mode: the model's load), and
        not cancelled when the time is up. ``meanwhile``: see :meth:`Gate.wait_meanwhile`.
        """
        started = self._clock.monotonic()
        self._stats.proxy_held.inc()
        try:
            if after is not None:
                await asyncio.wait({asyncio.ensure_future(after)}, timeout=max(timeout, 0.0))
            left = timeout - (self._clock.monotonic() - started)
            if meanwhile is not None:
                return await self._gate.wait_meanwhile(left, meanwhile)
            return await self._gate.wait(left)
        finally:
            self._stats.proxy_held.dec()
            self.seconds = (self.seconds or 0.0) + self._clock.monotonic() - started
