"""The CORS headers of an answer the proxy sends itself, as llama-server's own answer has them.

A stream's headers go to the client before llama-server answered (see :mod:`keepalive`), so the proxy
cannot copy them from that answer. It does not decide them either: a request header must never set a
response header llama-server itself would not send (``--cors-origins``, ``--cors-credentials`` and the
``localhost`` rule are llama-server's). It asks llama-server instead: a ``GET /health`` with the same
``Origin`` (public, no task, answered even while the model loads) has the headers llama-server's
pre-routing handler sets for that origin, and the proxy sends exactly those. Answers are kept per origin
for :data:`FRESH` seconds (a bounded number of origins); when llama-server cannot be asked (a restart),
the last answer for that origin is used, and an origin never answered gets no CORS header at all.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from sidecar.core import tasks
from sidecar.proxy import upclient

HEADERS = ("access-control-allow-origin", "access-control-allow-credentials")
"""The response headers llama-server sets from its CORS settings on a request that is not ``OPTIONS``."""
FRESH = 60.0
"""Seconds an origin's answer is used before llama-server is asked again."""
ASK_TIMEOUT = 1.0
"""Seconds to wait for llama-server's ``/health`` answer before the stream's headers go without it."""
KEPT = 256
"""Origins remembered at most (the least recently asked go first)."""

Headers = tuple[tuple[str, str], ...]


class Origins:
    """llama-server's CORS headers per request ``Origin``, asked of llama-server itself."""

    def __init__(self, client: upclient.Client, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._known: collections.OrderedDict[str, tuple[float, Headers]] = collections.OrderedDict()
        self._asking: dict[str, asyncio.Future[Headers | None]] = {}

    async def headers(self, origin: str | None) -> Headers:
        """The CORS headers llama-server sends a request with this ``Origin`` (None: the request had none)."""
        key = origin if origin is not None else ""
        found = self._known.get(key)
        if found is not None and self._clock() - found[0] < FRESH:
            return found[1]
        asking = self._asking.get(key)
        if asking is None:  # one question per origin at a time: a thousand requests at once ask once
            asking = tasks.watch(
                asyncio.create_task(self._ask(origin), name="proxy-cors-ask"),
                effect="this origin's CORS headers are not known: the proxy's own answers to it carry none",
            )
            self._asking[key] = asking
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        asked = await asyncio.shield(asking)
        if asked is None:
            return found[1] if found is not None else ()
        self._known[key] = (self._clock(), asked)
        self._known.move_to_end(key)
        while len(self._known) > KEPT:
            self._known.popitem(last=False)
        return asked

    async def _ask(self, origin: str | None) -> Headers | None:
        sent = [upclient.OWN_AGENT, ("Origin", origin)] if origin is not None else [upclient.OWN_AGENT]
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                up = await self._client.request("GET", "/health", sent, b"")
                try:
                    await up.read()
                except BaseException:
                    up.close()
                    raise
                up.release()
        except (upclient.ForwardError, TimeoutError):
            return None
        return tuple((name, value) for name, value in up.headers if name.lower() in HEADERS)
