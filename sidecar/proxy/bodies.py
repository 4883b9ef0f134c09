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
    within ``timeout`` seconds a 408.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        return b"", (refusals.too_big(limit), outcomes.ProxyOutcome.INVALID)
    held = declared or 0
    if held and not budget.take(held):
        return b"", _busy(budget)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    budget.give(held)
                    return b"", (refusals.too_big(limit), outcomes.ProxyOutcome.INVALID)
                if size > held:
                    if not budget.take(size - held):
                        budget.give(held)
                        return b"", _busy(budget)
                    held = size
                chunks.append(chunk)
    except TimeoutError:
        budget.give(held)
        return b"", (refusals.too_slow(timeout, size), outcomes.ProxyOutcome.INVALID)
    except BaseException:
        budget.give(held)
        raise
    budget.give(held - size)
    return b"".join(chunks), None


def _busy(budget: Budget) -> Refusal:
    return refusals.busy(budget.used, budget.cap), outcomes.ProxyOutcome.BUSY
