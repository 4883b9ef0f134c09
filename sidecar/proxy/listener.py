"""The proxy's own port: a low-level aiohttp server with the relay as its only handler.

No router and no middlewares in the way (every method and path goes to the
relay). ``handler_cancellation`` cancels a request's handler when its client
disconnects, which cancels the upstream request with it.
``keepalive_timeout`` closes a client connection that has not sent a
complete request within ``idle_timeout``: it bounds idle keep-alive
connections and clients that send their headers a byte at a time
(slowloris) alike. :mod:`conns` caps the connections open at once and
keeps a half-closed client's connection open for its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from aiohttp import web

from sidecar.core import config, metrics, tasks
from sidecar.proxy import conns, relay, sentinel, upclient

KEEPALIVE = 2.0
"""Seconds an idle connection to llama-server is kept for reuse; llama-server closes its own after 5 s."""
MAX_FIELD_SIZE = 64 << 10
"""Largest header line accepted, in bytes (aiohttp's default is 8 KiB; long API keys and cookies fit)."""


@dataclasses.dataclass(slots=True)
class Listener:
    runner: web.ServerRunner
    client: upclient.Client
    host: str
    port: int
    sentry: asyncio.Task[None] | None = None

    async def close(self) -> None:
        try:
            if self.sentry is not None:
                self.sentry.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.sentry
            await self.runner.cleanup()
        finally:
            await self.client.close()


def client(upstream: config.UpstreamSettings) -> upclient.Client:
    """The proxy's own connection pool to llama-server, apart from the poller's.

    No read timeout: a completion may prefill for minutes before its first
    byte, and a client that gives up cancels it. Answers are relayed as
    sent (no decompression), with only the client's headers (no headers of
    the proxy's own but ``Host`` and ``Content-Length``), and no cookies
    kept (they are the clients', passed on as headers).
    """
    return upclient.Client(upstream.url, connect_timeout=upstream.connect_timeout, keepalive=KEEPALIVE)


async def start(
    handler: relay.Relay,
    client: upclient.Client,
    settings: config.ProxySettings,
    stats: metrics.Metrics,
    *,
    sentry: sentinel.Sentinel | None = None,
) -> Listener:
    """Serve the relay on the proxy's port; ``sentry`` runs as long as the listener."""
    assert settings.host is not None
    server = conns.Server(
        handler.handle,
        max_connections=conns.usable_connections(settings.max_connections),
        opened=stats.proxy_connections,
        refused=stats.proxy_connections_refused,
        handler_cancellation=True,
        keepalive_timeout=settings.idle_timeout,
        max_field_size=MAX_FIELD_SIZE,
        access_log=None,
    )
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    port = settings.port
    try:
        for host in settings.host.split(","):  # a list of addresses, as llama-server's --host takes: one site each
            site = web.TCPSite(runner, host, port)
            await site.start()
            addresses = runner.addresses
            port = int(addresses[0][1]) if addresses else port  # port 0: the others take the first one's
    except BaseException:
        await runner.cleanup()
        raise
    task = (
        tasks.watch(
            asyncio.create_task(sentry.run(), name="proxy-sentinel"),
            effect="a restart of llama-server between two polls is no longer seen at once: the next poll sees it",
        )
        if sentry is not None
        else None
    )
    return Listener(runner, client, settings.host, port, task)
