"""A streamed request's headers at once, then keep-alive events until its first event.

When the first event is slow, the client gets a ``200`` with SSE headers and keep-alives, so it does
not time out and send the request again; an answer that turns out to be no stream becomes the
stream's error event.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/keepalive.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar.core import tasks
from sidecar.proxy import cors, sse

HEADERS_AFTER = 0.05
"""Seconds after a streamed request's arrival at which its headers are sent, if its first event has not come."""
EVERY = 1.0
"""Seconds between two keep-alives: below any read timeout a client sets (the SDKs' default is 600 s)."""
SERVER = "llama.cpp"
"""The ``Server`` header llama-server sends (cpp-httplib's default headers in ``server-http.cpp``)."""
PROBE: web.RequestKey[Callable[[], None]] = web.RequestKey("llama_sidecar_keepalive")
"""The request's key for :meth:`KeepAlive.poke`, which the listener calls to see whether the client is still there."""


class KeepAlive:
    """One streamed request's headers and keep-alives, sent by a task of their own until :meth:`stop`."""

    def __init__(
        self,
        request: web.BaseRequest,
        api: sse.Api,
        *,
        delay: float,
        origins: cors.Origins,
        too_long: Callable[[], Awaitable[bool]] | None = None,
        every: float = EVERY,
    ) -> None:
        """``too_long``: True if llama-server will refuse the prompt as over its context size (see
        :mod:`overflow`): then no keep-alive is sent, and the client gets llama-server's own answer."""
        self._request = request
        self._origins = origins
        self._too_long = too_long
        self._api = api
        self._every = every
        self._response: web.StreamResponse | None = None
        self._poke = asyncio.Event()
        self._stopping = False
        self._writing = False
        self.header: tuple[str, str] | None = None
        """The prefix header (name, value), once the request was placed; sent as a comment if the headers went first."""
        self._header_sent = False
        self._task = tasks.watch(
            asyncio.get_running_loop().create_task(self._run(delay), name="proxy-keepalive"),
            effect="this stream's client got no more keep-alives; its answer is relayed as it comes",
        )
        request[PROBE] = self.poke

    @property
    def started(self) -> bool:
        """The client got the stream's headers from the proxy."""
        return self._response is not None

    def poke(self) -> None:
        """Send a keep-alive now, if the headers went (a client that left answers it with a reset)."""
        self._poke.set()

    async def _run(self, delay: float) -> None:
        _, allowed = await asyncio.gather(
            asyncio.sleep(delay), self._origins.headers(self._request.headers.get("Origin"))
        )
        if await self._refused():  # asked only of a stream still waiting: one answered at once costs nothing
            return  # llama-server answers this one at once, with a status a stream's 200 would hide
        try:
            self._writing = True
            self._response = await self._prepare(allowed)
            while not self._stopping:
                self._writing = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._every):
                        await self._poke.wait()
                self._poke.clear()
                self._writing = True
                await self._response.write(sse.keep_alive(self._api))
        except ConnectionError:
            return  # the client is gone: the listener cancels its request
        finally:
            self._writing = False

    async def _refused(self) -> bool:
        return self._too_long is not None and await self._too_long()

    async def _prepare(self, allowed: cors.Headers) -> web.StreamResponse:
        # The headers llama-server sends on a stream (server-http.cpp), its CORS headers as it answers this Origin.
        response = web.StreamResponse(status=200)
        response.content_type = "text/event-stream"
        response.headers["Server"] = SERVER
        response.headers.extend(allowed)
        response.headers["X-Accel-Buffering"] = "no"  # as llama-server sends it: a proxy in front passes each event on
        if self.header is not None:
            response.headers[self.header[0]] = self.header[1]
            self._header_sent = True
        await response.prepare(self._request)
        await response.write(sse.keep_alive(self._api))
        return response

    async def stop(self) -> tuple[web.StreamResponse, bytes] | None:
        """No more keep-alives: the response already sent to the client, and what to write before the first
        event (the prefix header's comment); None if nothing was sent, the caller answers as it would have."""
        self._stopping = True
        if not self._writing:
            self._task.cancel()
        await asyncio.wait({self._task})  # a failure is logged by its watch
        if self._response is None:
            return None
        lead = b""
        if self.header is not None and not self._header_sent:
            lead = sse.comment(*self.header)
            self._header_sent = True
        return self._response, lead

    async def settle(self, response: web.StreamResponse) -> web.StreamResponse:
        """The response for the client: ``response``; or, if the stream's headers went first and ``response``
        is an answer not sent (a refusal, a 503), the stream ended with that answer as its error event."""
        started = await self.stop()
        if started is None or response.prepared:
            return response
        stream, _ = started
        body = response.body if isinstance(response, web.Response) and isinstance(response.body, bytes) else b""
        with contextlib.suppress(ConnectionError):
            await stream.write(sse.answer_as_event(self._api, response.status, response.reason, body))
            await stream.write_eof()
        return stream

    def cancel(self) -> None:
        """The request ended (or was cancelled): stop the task, whatever it was doing."""
        self._task.cancel()
        self._request.pop(PROBE, None)
