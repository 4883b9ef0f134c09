"""The proxy's client connections: a cap on how many are open, and clients that half-close.

A connection over ``max_connections`` gets a 503 at once; a client that half-closes its socket still
gets its answer, and the proxy probes such a client so that one that left cancels its request.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/conns.py`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import socket
from typing import Any, cast

import structlog
from aiohttp import HttpVersion11, web, web_protocol
from prometheus_client import Counter, Gauge

from sidecar.core import tasks
from sidecar.proxy import keepalive

log = structlog.get_logger("sidecar.proxy")

PROBE = 1.0
"""Seconds between two liveness probes of a half-closed client (llama-server checks its own clients once a
second too)."""
CHECKS = (0.01, 0.03, 0.06, 0.1, 0.2, 0.6)
"""Seconds between the checks for a reset after each probe (their sum is ``PROBE``): a client that closed its
socket answers the probe with a reset within a round trip, so most are seen at the first checks."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
FD_RESERVE = 256
"""File descriptors kept for everything but client connections: slot files, the upstream pool, the
sidecar's own port, logs."""


def _refusal(cap: int) -> bytes:
    message = (
        f"the proxy has {cap} client connections open (--proxy-max-connections): close idle keep-alive "
        "connections, retry shortly, or raise the cap (and the file-descriptor limit with it)"
    )
    body = json.dumps({"error": {"code": 503, "message": message, "type": "unavailable_error"}}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Server(web.Server):
    def __init__(self, handler: Any, *, max_connections: int, opened: Gauge, refused: Counter, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections
        self.open: set[Connection] = set()
        self.opened = opened
        self.refused = refused
        self.refusal = _refusal(max_connections)

    def __call__(self) -> Connection:
        return Connection(self, loop=self._loop, **self._kwargs)


class Connection(web_protocol.RequestHandler):
    """One client connection to the proxy: refused over the cap, watched for a client that half-closed."""

    __slots__ = ("_owner", "_probe")

    def __init__(self, manager: Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._owner = manager
        self._probe: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        owner = self._owner
        if len(owner.open) >= owner.max_connections:
            # uvloop's transports are not asyncio.Transport subclasses: no isinstance check here
            writable = cast(asyncio.Transport, transport)
            writable.write(owner.refusal)
            writable.close()
            owner.refused.inc()
            self._manager = None  # never served: connection_lost has nothing to undo
            return
        owner.open.add(self)
        owner.opened.set(len(owner.open))
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self in self._owner.open:
            self._owner.open.discard(self)
            self._owner.opened.set(len(self._owner.open))
        if self._probe is not None:
            self._probe.cancel()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """Waiting for a next request, with none queued or being handled."""
        waiting = self._waiter is not None and not self._waiter.done()
        return waiting and not self._messages and not self._request_in_progress

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol returns a bool
        if self._idle():
            return None  # an idle connection closed by its client: close ours
        self.keep_alive(False)
        if self._probe is None or self._probe.done():
            self._probe = tasks.watch(
                self._loop.create_task(self._watch(), name="proxy-half-closed-client"),
                effect="a client that half-closed its connection is no longer checked; if it went away, its "
                "request runs on until llama-server ends it",
            )
        return True  # keep the connection open to write the answer

    async def _watch(self) -> None:
        """Probe the half-closed client until its connection ends; one that is gone is dropped.

        Until the answer starts a ``100 Continue`` is the probe, after it the answer's own bytes: to
        either, a socket that was closed answers with a reset, which the kernel keeps as the socket's
        pending error. Reading is off after the end of the client's stream, so nothing else sees it.
        """
        while (transport := self.transport) is not None and not transport.is_closing():
            if self._idle():
                transport.close()  # its answer was sent (or it never sent a whole request)
                return
            request = self._current_request
            if request is not None:
                if request.version >= HttpVersion11 and request.writer.output_size == 0:
                    transport.write(_CONTINUE)
                elif (poke := request.get(keepalive.PROBE)) is not None:
                    poke()  # the stream the proxy started, before its first event: a keep-alive now
            for wait in CHECKS:
                await asyncio.sleep(wait)
                if transport.is_closing():
                    return  # closed during the sleep: connection_lost does the rest
                if code := _pending_error(transport):
                    transport.abort()  # connection_lost cancels the request, as for any disconnect
                    log.debug("proxy_client_gone", error=os.strerror(code))
                    return


def _pending_error(transport: asyncio.BaseTransport) -> int:
    """The socket's pending error (a reset the client answered a probe with), 0 for none."""
    sock = transport.get_extra_info("socket")
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)) if sock is not None else 0
    except (OSError, ValueError) as exc:
        # The socket's descriptor is gone (closed under the transport: uvloop's socket then
        # raises ValueError "negative file descriptor"): the client is gone with it.
        return getattr(exc, "errno", None) or errno.EBADF


def usable_connections(wanted: int) -> int:
    """``wanted``, or fewer if the file-descriptor limit (raised to its hard limit first) cannot hold them.

    Each client connection may need two descriptors (its socket and one to llama-server), plus
    ``FD_RESERVE`` for the rest of the process.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    usable = max((soft - FD_RESERVE) // 2, 1)
    log.warning(
        "proxy_connections_capped",
        wanted=wanted,
        usable=usable,
        nofile=soft,
        effect=f"the file-descriptor limit ({soft}) cannot hold {wanted} client connections; the proxy "
        f"takes at most {usable} and answers 503 past it",
        hint="raise the limit (LimitNOFILE= in the systemd unit, ulimits: nofile in Compose) to "
        f"{needed} or more, or lower --proxy-max-connections",
    )
    return usable
