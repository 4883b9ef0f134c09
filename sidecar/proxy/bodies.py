"""Reading a request's body whole before it is forwarded: capped, within a time, against a shared budget.

The body is held so that a completion that never got an answer byte can be
sent once more after a restart. A declared length is reserved whole before a
byte is read; a chunked body is counted chunk by chunk. What was reserved is
given back at once on a refusal, else by the caller when the request ends.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import Gauge

from sidecar.core import outcomes
from sidecar.proxy import refusals

Refusal = tuple[web.StreamResponse, outcomes.ProxyOutcome]


class Budget:
    """Bytes of request bodies held now, all requests together, against a cap."""

    def __init__(self, cap: int, gauge: Gauge) -> None:
        self.cap = cap
        self.used = 0
        self._gauge = gauge

    def take(self, size: int) -> bool:
        if self.used + size > self.cap:
            return False
        self.used += size
        self._gauge.set(self.used)
        return True

    def give(self, size: int) -> None:
        self.used -= size
        self._gauge.set(self.used)


async def read(request: web.BaseRequest, budget: Budget, *, limit: int, timeout: float) -> tuple[bytes, Refusal | None]:
    """The whole request body, held against ``budget`` (the caller gives its length back); or the answer instead.

    Over ``limit`` bytes is a 413, over the budget a 503, not received
    within ``timeout`` seconds a 408. A body that arrived with the headers
    (most requests) is taken at once, with no timer to arm.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        return b"", (refusals.too_big(limit), outcomes.ProxyOutcome.INVALID)
    held = declared or 0
    if held and not budget.take(held):
        return b"", _busy(budget)
    content = request.content
    body = _Body(budget, limit, held)
    try:
        if content.is_eof():
            refusal = body.add(content.read_nowait())
        else:
            async with asyncio.timeout(timeout):
                refusal = None
                while refusal is None and (chunk := await content.readany()):
                    refusal = body.add(chunk)
    except TimeoutError:
        budget.give(body.held)
        return b"", (refusals.too_slow(timeout, body.size), outcomes.ProxyOutcome.INVALID)
    except BaseException:
        budget.give(body.held)
        raise
    if refusal is not None:
        budget.give(body.held)
        return b"", refusal
    budget.give(body.held - body.size)
    return body.joined(), None


class _Body:
    """A body's chunks as they arrive, with the bytes reserved for it in the budget."""

    __slots__ = ("_budget", "_chunks", "_limit", "held", "size")

    def __init__(self, budget: Budget, limit: int, held: int) -> None:
        self._budget = budget
        self._limit = limit
        self._chunks: list[bytes] = []
        self.held = held
        self.size = 0

    def add(self, chunk: bytes) -> Refusal | None:
        """Take ``chunk``; or the answer if the body grows over the limit or the budget."""
        self.size += len(chunk)
        if self.size > self._limit:
            return refusals.too_big(self._limit), outcomes.ProxyOutcome.INVALID
        if self.size > self.held:
            if not self._budget.take(self.size - self.held):
                return _busy(self._budget)
            self.held = self.size
        self._chunks.append(chunk)
        return None

    def joined(self) -> bytes:
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)


def _busy(budget: Budget) -> Refusal:
    return refusals.busy(budget.used, budget.cap), outcomes.ProxyOutcome.BUSY
