"""The restore gate: closed while llama-server cannot yet serve a request with its restored KV.

The engine moves it with its observations; the proxy closes it when it loses llama-server, holds
completion requests at it (counted and timed), and ``/readyz`` reports it. During a restore round a
held request may read its token ids and go on as soon as its own snapshot is back.

Invariants and trade-offs: docs/modules.md, `sidecar/engine/gate.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence

import structlog

from sidecar.core import events, metrics, protocols
from sidecar.engine import lifecycle
from sidecar.restore import early, plan
from sidecar.snapshots import manifest

log = structlog.get_logger("sidecar.proxy.gate")

NOT_POLLED = lifecycle.NOT_POLLED
SAID_REASONS = 8
"""Distinct reasons logged while the gate stays closed; the rest are not (a reason may hold an error's words)."""


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
        self._life = lifecycle.START
        """Where the server is in its life: the one copy (see :mod:`sidecar.engine.lifecycle`)."""
        self._open = asyncio.Event()
        """Set while ``_life`` is open: what waiting requests wake on (set and cleared in :meth:`see` only)."""
        self._serving = asyncio.Event()
        """Set while ``_life`` is closed for a restore round (set and cleared in :meth:`see` only)."""
        self.prepared = 0
        """Requests that started their slot-free work while the gate was closed, since it last opened."""
        self._round = early.Round()
        """The restore round the gate is closed for now (or was last)."""
        self._unnamed = 0
        """Requests waiting with work meanwhile that has not ended (they may name the snapshot they wait for)."""
        self.waiting = 0
        """Requests waiting at the gate now."""
        self.openings = 0
        """Times the gate has opened: a poll saw the server serve (a sentinel tells one outage from the next by it)."""
        self._on_suspect = on_suspect
        self._on_wait = on_wait
        self._said: set[str] = set()
        """The reasons the gate was said closed for since it last opened (each is logged once)."""

    @property
    def life(self) -> lifecycle.Life:
        """Where the server is in its life now."""
        return self._life

    @property
    def is_open(self) -> bool:
        return self._life.open

    @property
    def reason(self) -> str:
        """Why the gate is closed ("" while it is open)."""
        return self._life.closed_because

    def see(self, seen: lifecycle.Observation) -> None:
        """Move the server's life on by ``seen`` (:func:`lifecycle.step`), and say so when the gate closes or opens."""
        was, life = self._life, lifecycle.step(self._life, seen)
        if not life.open and seen.kind in lifecycle.CLOSING:
            if was.open:
                self._said.clear()
            if life.reason not in self._said and len(self._said) < SAID_REASONS:
                self._said.add(life.reason)  # said once per closing: each poll and request would repeat it
                log.info("restore_gate_closed", reason=life.reason, waiting=self.waiting)
        if seen.kind is lifecycle.Kind.EMPTIED:
            self._round = early.Round()
        self._life = life
        if life.restoring:
            self._serving.set()
        else:
            self._serving.clear()
        if life.open and not was.open:
            log.info(
                "restore_gate_open",
                was=was.reason,
                waiting=self.waiting,
                prepared=self.prepared,
                early=self._round.early,
            )
            self.prepared = 0
            self._round.early = 0
            self.openings += 1
            self._open.set()
        elif not life.open:
            self._open.clear()

    def close(self, reason: str, *, serving: bool = False) -> None:
        """Close as for a server seen down; ``serving``: as for one that lost its slots (a restore round is owed)."""
        self.see(lifecycle.Emptied(reason) if serving else lifecycle.Unhealthy(events.Health.DOWN, reason))

    def suspect(self, reason: str) -> None:
        """Close until a poll that starts from now on sees the server up (and any restore is done)."""
        self.see(lifecycle.Suspected(self._clock.monotonic(), reason))
        if self._on_suspect is not None:
            self._on_suspect()

    def open(self, *, seen_at: float) -> None:
        """Open, on the word of a poll that started at ``seen_at`` (the poller's monotonic clock)."""
        self.see(lifecycle.Up(seen_at, ready=False))

    def lets(self, hold: Hold) -> bool:
        """Whether ``hold``'s request may reach the server now: the gate is open, or the round that let it
        through early still runs with the server answering."""
        return self._life.open or (hold.early is self._round and self._life.restoring)

    async def next_step(
        self, pending: Sequence[int], snapshots: Callable[[], Sequence[manifest.Manifest]]
    ) -> plan.Step:
        """What the restore round restores next, and where (see :mod:`sidecar.restore.early`)."""
        return await self._round.next_step(pending, lambda: self.waiting, lambda: self._unnamed, snapshots)

    def restored(self, slot: int, file: str) -> None:
        """The restore round restored snapshot ``file`` into ``slot``: requests waiting for it go on."""
        self._round.restored(slot, file)

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the gate to be open; False if it stayed closed."""
        if self._life.open:
            return True
        try:
            with self._counted():
                async with asyncio.timeout(max(timeout, 0.0)):
                    await self._open.wait()
        except TimeoutError:
            return False
        return True

    async def wait_meanwhile(
        self, timeout: float, work: Callable[[], Awaitable[str | None]]
    ) -> tuple[bool, early.Round | None]:
        """:meth:`wait`, running ``work`` once the server answers while the gate stays closed for a restore round.

        ``work`` must touch no slot; it returns the snapshot file whose restore
        the request waits for (None: it waits for the whole round). Once it has
        started it is awaited (within ``timeout``) before this returns, so
        what it did is done when the caller goes on; if the gate opens before
        it started, it is not started at all. Errors of ``work`` are the
        caller's to avoid: they are dropped here. Returns whether the request
        may go on, and the round that let it through before the gate opened
        (None: the gate opened, or stayed closed).
        """
        if self._life.open:
            return True, None
        named = asyncio.Event()
        self._unnamed += 1
        try:
            with self._counted():
                async with asyncio.timeout(max(timeout, 0.0)):
                    went = await self._passage(work, named)
        except TimeoutError:
            return False, None
        finally:
            if not named.is_set():
                self._unnamed -= 1
        if went is None or self._life.open:
            return True, None
        went.went()
        return True, went

    async def _passage(self, work: Callable[[], Awaitable[str | None]], named: asyncio.Event) -> early.Round | None:
        """Until the gate opens (None) or the request's own snapshot is restored in the running round (that round).

        ``named`` is set once ``work`` has named the snapshot (or nothing).
        """
        if not await self._first(self._serving):
            return None
        held = self._round
        self.prepared += 1
        try:
            file = await work()
        except Exception:
            file = None
        finally:
            named.set()
            self._unnamed -= 1
            held.changed()
        if file is None or held is not self._round:
            await self._open.wait()
            return None
        held.want(file, 1)
        try:
            restored = await self._first(held.event(file))
        finally:
            held.want(file, -1)
        return held if restored and held is self._round and self._life.restoring else None

    async def _first(self, event: asyncio.Event) -> bool:
        """Wait until ``event`` is set or the gate opens; True if ``event`` was set with the gate still closed."""
        if self._life.open:
            return False
        if not event.is_set():
            either = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._open.wait())}
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in either:
                    task.cancel()
        return event.is_set() and not self._life.open

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Count a request in :attr:`waiting` while it waits (the first one has the poller poll at once)."""
        self.waiting += 1
        self._round.changed()
        if self.waiting == 1 and self._on_wait is not None:
            self._on_wait()
        try:
            yield
        finally:
            self.waiting -= 1
            self._round.changed()

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
        self.early: early.Round | None = None
        """The restore round that let the request through before it ended (:mod:`sidecar.restore.early`), while
        the request counts as such; None otherwise."""

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        self.leave_early()
        if self.seconds is not None:
            self._stats.proxy_hold.observe(self.seconds)

    def leave_early(self) -> None:
        """The request no longer runs as let through early (it ended, or waits for the whole round now)."""
        if self.early is not None:
            self.early.ended()
            self.early = None

    async def wait(
        self,
        timeout: float,
        *,
        after: Awaitable[object] | None = None,
        meanwhile: Callable[[], Awaitable[str | None]] | None = None,
    ) -> bool:
        """Wait up to ``timeout`` seconds for the gate to be open; False if it stayed closed.

        ``after``: awaited first, within the same ``timeout`` (router mode: the model's load), and
        not cancelled when the time is up. ``meanwhile``: see :meth:`Gate.wait_meanwhile`; a request
        it lets through before the round ends has :attr:`early` set.
        """
        started = self._clock.monotonic()
        self._stats.proxy_held.inc()
        try:
            if after is not None:
                await asyncio.wait({asyncio.ensure_future(after)}, timeout=max(timeout, 0.0))
            left = timeout - (self._clock.monotonic() - started)
            self.leave_early()
            if meanwhile is not None:
                opened, self.early = await self._gate.wait_meanwhile(left, meanwhile)
                return opened
            return await self._gate.wait(left)
        finally:
            self._stats.proxy_held.dec()
            self.seconds = (self.seconds or 0.0) + self._clock.monotonic() - started
