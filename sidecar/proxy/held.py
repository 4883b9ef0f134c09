"""The answer to a request held at the restore gate past ``--proxy-hold-seconds``, and its log line.

A closed gate can time out thousands of requests at once: they are logged
as at most one ``proxy_request_held_too_long`` line per :data:`LOG_EVERY`
seconds, each with the count it stands for, and a last line for the rest
once the burst is over. Every one is counted by the relay.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from sidecar.core import logs, protocols
from sidecar.proxy import refusals

log = structlog.get_logger("sidecar.proxy")

LOG_EVERY = 10.0
"""Seconds between two ``proxy_request_held_too_long`` lines: a thousand time-outs are one line with a count."""


class HeldTooLong:
    def __init__(self, *, hold_seconds: float, retry_after: int, clock: protocols.Clock) -> None:
        self._seconds = hold_seconds
        self._retry_after = retry_after
        self._clock = clock
        self._log = logs.Throttle(LOG_EVERY)
        self._flush_due = False

    def answer(self, reason: str) -> web.Response:
        """The 503 for one request the gate held too long (closed for ``reason``), logged in a throttled line."""
        if (count := self._log.tick(self._clock.monotonic())) is not None:
            self._line(count, reason)
        elif not self._flush_due:
            self._flush_due = True
            delay = max(self._log.due - self._clock.monotonic(), 0.0)
            asyncio.get_running_loop().call_later(delay, self._flush, reason)
        return refusals.error(
            503,
            f"llama-server is not ready after {self._seconds:g} s: {reason}. Retry later.",
            "unavailable_error",
            headers={"Retry-After": str(self._retry_after)},
        )

    def _flush(self, reason: str) -> None:
        self._flush_due = False
        if count := self._log.flush(self._clock.monotonic()):
            self._line(count, reason)

    def _line(self, count: int, reason: str) -> None:
        log.warning(
            "proxy_request_held_too_long",
            requests=count,
            seconds=self._seconds,
            reason=reason,
            effect=f"{count} request(s) answered 503 with Retry-After since the last such line (at most one line "
            f"per {self._log.every:g} s; every one is counted in proxy_requests_total{{outcome=held_timeout}})",
            hint="see the sidecar's /status and llama-server's log; raise --proxy-hold-seconds for slow loads",
        )
