"""The relay's connections to llama-server after a streamed answer: closed, and a spare opened in its place.

llama-server closes its connection after every chunked (streamed) answer,
with no ``Connection: close`` to say so (cpp-httplib ends the stream when
its content provider returns false). aiohttp pools a connection as soon as
the answer's last chunk is read: the next request would find it dead and
be sent twice. So a chunked answer's connection is marked not to be reused
(:func:`no_reuse_if_chunked`), and every streamed request would then pay
for a new TCP connection before its first byte; :class:`Spare` opens one
in the background once a stream ends, while the client reads it, for the
next request to find in the pool (it expires with the pool's keep-alive,
as any idle connection; one is opened at a time).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import yarl


def chunked(up: aiohttp.ClientResponse) -> bool:
    return "Transfer-Encoding" in up.headers


def no_reuse_if_chunked(up: aiohttp.ClientResponse) -> None:
    """Close a chunked answer's connection at its end instead of pooling it (see the module's docstring)."""
    if chunked(up) and (conn := up.connection) is not None and conn.protocol is not None:
        conn.protocol.force_close()


class Spare:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self._session = session
        self._url = yarl.URL(base + "/", encoded=True)
        self._opening: asyncio.Task[None] | None = None

    def open(self) -> None:
        """Open a spare connection in the background, unless one is being opened."""
        if self._opening is None or self._opening.done():
            self._opening = asyncio.get_running_loop().create_task(self._open(), name="proxy-spare-connection")

    async def _open(self) -> None:
        connector = self._session.connector
        if connector is None or connector.closed:
            return
        request = aiohttp.ClientRequest("GET", self._url, loop=asyncio.get_running_loop())
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            # A server that is gone is the poller's and the next request's to find: nothing to report here.
            conn = await connector.connect(request, [], self._session.timeout)
            conn.release()

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
