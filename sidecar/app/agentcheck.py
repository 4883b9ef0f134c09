"""HAProxy's agent-check protocol on a TCP port of its own (``--agent-check-listen``).

Each connection gets ``standing.answer``'s line for the current status at once; connections are
bounded in time, input and number, and none keeps a task.

Invariants and trade-offs: docs/modules.md, `sidecar/app/agentcheck.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import typing
from typing import Protocol

import structlog

from sidecar.app import standing
from sidecar.engine import report

log = structlog.get_logger("sidecar.agent")

TIMEOUT = 2.0
"""Seconds a connection may stay open (HAProxy reads the answer in a few milliseconds and closes)."""
MAX_INPUT = 1024
"""Bytes a client may send (an ``agent-send`` line is a few words) before it is closed."""
MAX_CONNECTIONS = 64
"""Connections open at once; one balancer holds at most one per server line."""


class Known(Protocol):
    """The seam: what the agent check reads of the node (the engine, or the fleet in router mode)."""

    def status(self) -> report.Status: ...


class _Connection(asyncio.Protocol):
    def __init__(self, owner: _Server) -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = typing.cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self._transport = transport
        if len(self._owner.open) >= self._owner.max_connections:
            self._owner.refused += 1
            transport.abort()
            return
        self._owner.open.add(self)
        self._timer = asyncio.get_running_loop().call_later(self._owner.timeout, transport.abort)
        try:
            line = standing.answer(standing.facts(self._owner.known.status())).line()
        except Exception as exc:
            log.error(
                "agent_check_failed",
                error=f"{type(exc).__name__}: {exc}",
                effect="the balancer got no answer from this node's agent and keeps its last state",
                hint="this is a fault of the sidecar: report it with this line",
            )
            transport.abort()
            return
        transport.write(line)
        transport.write_eof()  # the answer is whole: the client reads to the end, then closes its side

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self._owner.max_input and self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._owner.open.discard(self)


@dataclasses.dataclass(slots=True)
class _Server:
    known: Known
    timeout: float
    max_input: int
    max_connections: int
    open: set[_Connection] = dataclasses.field(default_factory=set)
    refused: int = 0
    """Connections closed unanswered because :attr:`max_connections` were open."""


@dataclasses.dataclass(slots=True)
class Handle:
    """The listening agent port: where it listens, and how to close it."""

    host: str
    port: int
    server: asyncio.Server
    state: _Server

    @property
    def refused(self) -> int:
        return self.state.refused

    async def close(self) -> None:
        """Stop listening and close the connections still open."""
        self.server.close()
        for conn in list(self.state.open):
            conn.abort()
        with contextlib.suppress(TimeoutError):  # uvloop waits for every connection: each has its own bound
            async with asyncio.timeout(self.state.timeout):
                await self.server.wait_closed()


async def start(
    known: Known,
    *,
    host: str,
    port: int,
    timeout: float = TIMEOUT,
    max_input: int = MAX_INPUT,
    max_connections: int = MAX_CONNECTIONS,
) -> Handle:
    """Listen on ``host:port`` (0: a free port, read back in the handle)."""
    state = _Server(known, timeout, max_input, max_connections)
    server = await asyncio.get_running_loop().create_server(lambda: _Connection(state), host, port)
    bound = server.sockets[0].getsockname() if server.sockets else (host, port)
    return Handle(host, int(bound[1]), server, state)
