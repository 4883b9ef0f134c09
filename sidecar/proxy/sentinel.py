"""The sentinel: a connection held open to llama-server, so that a restart between two polls is seen at once.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/sentinel.py`.
"""

from __future__ import annotations

import asyncio
import enum

import structlog
import yarl

from sidecar.core import parse
from sidecar.engine import gate
from sidecar.proxy import backoff

log = structlog.get_logger("sidecar.proxy.sentinel")

PING = 2.0
"""Seconds between two /health requests on the sentinel connection (llama-server closes it after 5 s idle)."""
RECONNECT = 0.1
"""Seconds before a new connection after a steady one (doubled after each attempt that does not hold,
up to ``PING``; drawn between half and all of it)."""
ANSWER_TIMEOUT = 10.0
"""Seconds to wait for llama-server's answer to a ping; past it the connection is dropped and made anew,
with no conclusion drawn (a busy or unreachable server, not a proof of exit)."""
_HEAD_LIMIT = 16 << 10


class End(enum.StrEnum):
    """How the sentinel connection ended."""

    ANNOUNCED = "announced"
    """llama-server said it would close it (``Connection: close``): the process is alive."""
    DROPPED = "dropped"
    """Closed or reset without a word: the process exited."""
    CONFUSED = "confused"
    """No answer in time, or one that is not llama-server's (bytes unasked for, a malformed head): started
    over later, with no conclusion drawn."""


class Sentinel:
    def __init__(
        self,
        url: str,
        restore_gate: gate.Gate,
        *,
        connect_timeout: float,
        ping: float = PING,
        reconnect: float = RECONNECT,
    ) -> None:
        parsed = yarl.URL(url)
        self._host = parsed.host or "127.0.0.1"
        self._port = parsed.port or 80
        self._tls = parsed.scheme == "https"
        path = parsed.raw_path.rstrip("/") + "/health"
        self._request = f"GET {path} HTTP/1.1\r\nHost: {parsed.raw_authority}\r\n\r\n".encode()
        self._gate = restore_gate
        self._connect_timeout = connect_timeout
        self._ping = ping
        self._backoff = backoff.Backoff(reconnect, ping)
        self._running = False
        self._steady = False
        """Whether the connection being watched answered 200 and then stayed open through a quiet ping."""
        self.connections = 0
        """Connections opened so far."""
        self._healthy = True
        """Whether /health answered 200 on the sentinel since the last ``server_connection_dropped`` line: with
        :attr:`_openings`, one line per outage, not one per connection a restarting server drops while it loads."""
        self._openings = restore_gate.openings
        """The gate's openings at the last line: a poll that saw the server serve since also ends an outage."""

    async def run(self) -> None:
        if self._running:
            raise RuntimeError("a sentinel runs once: one prober per upstream")
        self._running = True
        expect_up = False
        """True after an announced end: a refusal now means the process has just gone."""
        while True:
            try:
                async with asyncio.timeout(self._connect_timeout):
                    reader, writer = await asyncio.open_connection(
                        self._host, self._port, ssl=self._tls or None, limit=_HEAD_LIMIT
                    )
            except (OSError, TimeoutError) as exc:
                if expect_up:
                    self._gone(f"refused the proxy's sentinel connection ({exc.__class__.__name__})")
                expect_up = False
                await asyncio.sleep(self._backoff.next_delay())
                continue
            self.connections += 1
            self._steady = False
            try:
                end = await self._watch(reader, writer)
            finally:
                writer.close()
            expect_up = end is End.ANNOUNCED
            if end is End.DROPPED:
                self._gone("closed the proxy's sentinel connection without a word")
            if self._steady:
                self._backoff.reset()
            await asyncio.sleep(self._backoff.next_delay())

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> End:
        """Ping until the connection ends; how it ended."""
        try:
            while True:
                writer.write(self._request)
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
                    length, close = _framing(head)
                    await reader.readexactly(length)
                if head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
                    self._healthy = True
                if close:
                    return End.ANNOUNCED
                try:
                    async with asyncio.timeout(self._ping):
                        extra = await reader.read(1)
                except TimeoutError:
                    self._steady = self._steady or head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 "))
                    continue
                return End.CONFUSED if extra else End.DROPPED
        except (ConnectionError, asyncio.IncompleteReadError):
            return End.DROPPED
        except (asyncio.LimitOverrunError, ValueError, TimeoutError):
            return End.CONFUSED

    def _gone(self, what: str) -> None:
        # A poll may have seen the server serve since the last line though the sentinel's own pings have not (a
        # kill within a ping of the restore round's end), and the relay may have closed the gate first (a kill
        # in a request): the gate's openings count the polls' word.
        if self._healthy or self._gate.openings != self._openings:
            self._healthy = False
            self._openings = self._gate.openings
            log.info(
                "server_connection_dropped",
                reason=f"llama-server {what}",
                effect="completions wait at the restore gate until a poll sees the server up and any restore is done",
            )
        self._gate.suspect(f"llama-server {what}: its process exited or restarted")


def _framing(head: bytes) -> tuple[int, bool]:
    """Body length and whether the server will close the connection, from an answer's head."""
    length, close = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = parse.integer(value.strip())
        elif name == b"connection" and b"close" in value.lower():
            close = True
    return length, close
