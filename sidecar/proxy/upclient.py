"""The relay's HTTP/1.1 client to llama-server: kept-alive connections, answers parsed by ``httptools``.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/upclient.py`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
import typing
from urllib.parse import urlsplit

import httptools

from sidecar.core import tasks

PAUSE_BYTES = 1 << 18
"""Bytes of an answer read and not yet taken by the relay at which reading pauses, until they are taken."""
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
OWN_AGENT = ("User-Agent", "llama-kv-sidecar-proxy")
"""The header of the proxy's own questions to llama-server (CORS headers, token counts), not a client's request."""


class ForwardError(Exception):
    """A request the proxy forwards to llama-server failed (the sidecar's own calls raise ``errors.UpstreamError``)."""


class ConnectFailed(ForwardError):
    """No connection could be opened to llama-server."""


class Lost(ForwardError):
    """The connection to llama-server closed or broke before the answer's end."""


class Answer:
    """llama-server's answer: status and headers, and a body read as it arrives."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_held",
        "_waiter",
        "chunked",
        "headers",
        "length",
        "reason",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._held = 0
        self._done = False
        self._error: Lost | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.length: int | None = None
        """The body's Content-Length; None for a chunked body (or one that ends when the connection does)."""
        self.chunked = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def readany(self) -> bytes:
        """What has arrived of the body since the last read (waits for some); b"" at its end; raises ``Lost``."""
        while not self._chunks:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._take_all())
        self._held -= len(data)
        self._conn.taken(self._held)
        return data

    def _take_all(self) -> list[bytes]:
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    async def read(self) -> bytes:
        """The whole body (the rest of it); raises ``Lost`` if it is cut."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """The answer was read to its end: the connection goes back to the pool if it can serve again."""
        self._conn.finished(self)

    def close(self) -> None:
        """Close the connection (llama-server stops a task whose connection drops)."""
        self._conn.close()

    # Called by the connection as the parser reads.

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._held += len(data)
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: Lost) -> None:
        if not self._done:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection to llama-server, serving one request at a time; the parser's callbacks fill its answer."""

    def __init__(self, pool: Client) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._headers_ready: asyncio.Future[None] | None = None
        self._reason = b""
        self.answer: Answer | None = None
        self.closed = False
        self.reusable = True
        self.idle_since = 0.0
        self._paused = False
        self._until_close = False
        """The answer in hand has neither a Content-Length nor chunks: it ends when the connection closes."""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses

    def data_received(self, data: bytes) -> None:
        if self.answer is None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted for another request
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(Lost(f"llama-server's answer is not valid HTTP: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self.answer
        if exc is None and answer is not None and self._until_close:
            answer._end()  # its body ends where the connection does: this close is its end
            return
        self._lose(Lost("llama-server closed the connection before the end of its answer"))

    # httptools callbacks

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.answer is not None
        self.answer.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        answer.status = self._parser.get_status_code()
        answer.reason = self._reason.decode("latin-1")
        answer.chunked = answer.header("transfer-encoding") is not None
        length = answer.header("content-length")
        answer.length = int(length) if length is not None and not answer.chunked and length.isdigit() else None
        if answer.chunked or not self._parser.should_keep_alive():
            self.reusable = False
        self._until_close = answer.length is None and not answer.chunked and length is None
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.answer is not None
        self.answer._feed(body)
        if self.answer._held >= PAUSE_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def on_message_complete(self) -> None:
        assert self.answer is not None
        self.answer._end()

    # the client's side

    async def send(self, head: bytes, body: bytes, *, head_only: bool) -> Answer:
        """Write one request; returns its answer once the status and headers have arrived."""
        assert self._transport is not None
        self.answer = answer = Answer(self)
        self._reason = b""
        self._until_close = False
        self._headers_ready = asyncio.get_running_loop().create_future()
        self._transport.write(head + body if len(body) < 1 << 16 else head)
        if len(body) >= 1 << 16:
            self._transport.write(body)
        try:
            await self._headers_ready
        except BaseException:
            self.close()  # cancelled or lost: llama-server sees the connection drop
            raise
        if head_only:
            # A HEAD answer has headers only; the parser would wait for the body they describe.
            self.reusable = False
            answer._end()
        return answer

    def taken(self, held: int) -> None:
        """The relay took the answer's bytes up to ``held`` still waiting: resume reading below the mark."""
        if self._paused and held < PAUSE_BYTES and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def finished(self, answer: Answer) -> None:
        if answer is self.answer and answer._done and self.reusable and not self.closed:
            self.answer = None
            self._pool.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None and not self.closed:
            self._transport.close()
        self.closed = True

    def _lose(self, error: Lost) -> None:
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_exception(error)
        if self.answer is not None:
            self.answer._fail(error)


class Client:
    """Kept-alive connections to one llama-server, for the relay."""

    def __init__(self, base_url: str, *, connect_timeout: float, keepalive: float) -> None:
        url = urlsplit(base_url)
        self._host = url.hostname or "127.0.0.1"
        self._tls = url.scheme == "https"
        self._port = url.port or (443 if self._tls else 80)
        self._prefix = url.path.rstrip("/")
        self._host_header = url.netloc.rpartition("@")[2]
        self._ssl = ssl.create_default_context() if self._tls else None
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._idle: list[_Connection] = []
        self._spare: asyncio.Task[None] | None = None
        self._closed = False

    async def request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes, *, fresh: bool = False
    ) -> Answer:
        """Send one request (``target``: path and query, as the client sent them); raises ``ForwardError``.

        ``fresh``: on a connection opened for it, never a kept-alive one.
        """
        head = self._head(method, target, headers, body)
        conn = (None if fresh else self._reuse()) or await self._connect()
        return await conn.send(head, body, head_only=method == "HEAD")

    def _head(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        lines = [f"{method} {self._prefix}{target} HTTP/1.1\r\nHost: {self._host_header}\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                continue  # aiohttp's server never lets one through; a header is never a way to split a request
            lines.append(f"{name}: {value}\r\n")
        if body or method not in _NO_BODY_METHODS:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("utf-8", "surrogateescape")

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise ConnectFailed("the proxy is closing")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._tls else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"connecting took over {self._connect_timeout:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(str(exc) or exc.__class__.__name__) from exc
        return conn

    def give_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = now = time.monotonic()
        # The oldest idle connections, at the bottom, are never the next taken: drop those no longer of use.
        while self._idle and (self._idle[0].closed or now - self._idle[0].idle_since >= self._keepalive):
            self._idle.pop(0).close()
        self._idle.append(conn)

    def open_spare(self) -> None:
        """Open a connection in the background for the next request, unless one is being opened."""
        if self._closed or (self._spare is not None and not self._spare.done()):
            return
        self._spare = tasks.watch(
            asyncio.get_running_loop().create_task(self._open_spare(), name="proxy-spare-connection"),
            effect="no spare connection was opened: the next request opens its own",
        )

    async def _open_spare(self) -> None:
        with contextlib.suppress(ConnectFailed):
            # A server that is gone is the poller's and the next request's to find: nothing to report here.
            self.give_back(await self._connect())

    async def close(self) -> None:
        self._closed = True
        if self._spare is not None:
            self._spare.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._spare
        for conn in self._idle:
            conn.close()
        self._idle.clear()
