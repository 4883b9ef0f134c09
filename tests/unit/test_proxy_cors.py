"""A stream's CORS headers are llama-server's answer for the request's Origin, never built from the request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.test_utils import RawTestServer

from sidecar.proxy import cors, upclient

MakeRaw = Callable[..., Awaitable[RawTestServer]]


async def test_the_headers_are_the_servers_kept_a_minute_and_none_for_an_origin_it_was_never_asked(
    aiohttp_raw_server: MakeRaw,
) -> None:
    asked: list[str | None] = []
    down = False

    async def health(request: web.BaseRequest) -> web.StreamResponse:
        if down:
            assert request.transport is not None
            request.transport.close()  # the server going away: the question fails
        origin = request.headers.get("Origin")
        asked.append(origin)
        allowed = {"Access-Control-Allow-Origin": origin} if origin and "localhost" in origin else {}
        return web.Response(text='{"status":"ok"}', headers={**allowed, "X-Other": "not CORS"})

    server = await aiohttp_raw_server(health)
    now = [0.0]
    client = upclient.Client(str(server.make_url("")), connect_timeout=1.0, keepalive=2.0)
    origins = cors.Origins(client, clock=lambda: now[0])
    try:
        assert await origins.headers("http://evil.com") == ()
        assert await origins.headers("http://localhost:3000") == (
            ("Access-Control-Allow-Origin", "http://localhost:3000"),
        )
        assert await origins.headers("http://localhost:3000") != ()
        assert asked == ["http://evil.com", "http://localhost:3000"], "one question per origin within a minute"
        down = True
        now[0] = cors.FRESH + 1
        assert await origins.headers("http://localhost:3000") == (
            ("Access-Control-Allow-Origin", "http://localhost:3000"),
        ), "the server away: its last answer for that origin"
        assert await origins.headers("http://localhost:4000") == (), "never answered: no CORS header at all"
    finally:
        await client.close()
