"""The proxy's sentinel connection against a minimal HTTP server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import structlog

from sidecar.act import gate
from sidecar.proxy import sentinel

OK = b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
CLOSING = b'HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'


class Server:
    """Answers each request with ``answer(n)`` (n counts requests over all connections); None: close at once."""

    def __init__(self, answer: Callable[[int], bytes | None]) -> None:
        self.answer = answer
        self.requests = 0
        self.connections = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
                reply = self.answer(self.requests)
                if reply is None:
                    break
                writer.write(reply)
                if reply is CLOSING:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def opened() -> gate.Gate:
    g = gate.Gate()
    g.open(seen_at=0.0)
    return g


async def _run(server: Server, g: gate.Gate, until: Callable[[], bool]) -> None:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    watch = sentinel.Sentinel(f"http://127.0.0.1:{port}", g, connect_timeout=1.0, ping=0.02, reconnect=0.01)
    task = asyncio.create_task(watch.run())
    try:
        async with asyncio.timeout(5):
            while not until():
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        listening.close()


async def test_a_connection_dropped_without_a_word_closes_the_gate_and_asks_for_a_poll() -> None:
    polls = []
    opened = gate.Gate(on_suspect=lambda: polls.append(1))
    opened.open(seen_at=0.0)
    server = Server(lambda n: OK if n < 3 else None)
    await _run(server, opened, lambda: not opened.is_open)
    assert "exited or restarted" in opened.reason
    assert polls


async def test_an_announced_close_is_not_a_restart(opened: gate.Gate) -> None:
    server = Server(lambda n: CLOSING if n % 3 == 0 else OK)
    await _run(server, opened, lambda: server.connections >= 3)
    assert opened.is_open, opened.reason


async def test_a_refusal_right_after_an_announced_close_is_a_restart(opened: gate.Gate) -> None:
    server = Server(lambda n: CLOSING)
    listening: asyncio.Server | None = None

    async def announce_then_exit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert listening is not None
        listening.close()  # the process says it will close the connection, and exits before the reconnect
        await server.handle(reader, writer)

    listening = await asyncio.start_server(announce_then_exit, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    watch = sentinel.Sentinel(f"http://127.0.0.1:{port}", opened, connect_timeout=1.0, ping=0.02, reconnect=0.01)
    task = asyncio.create_task(watch.run())
    try:
        async with asyncio.timeout(5):
            while opened.is_open:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert server.requests == 1
    assert "refused" in opened.reason


async def test_a_server_never_reached_raises_no_suspicion(opened: gate.Gate) -> None:
    listening = await asyncio.start_server(Server(lambda n: OK).handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    listening.close()
    await listening.wait_closed()
    watch = sentinel.Sentinel(f"http://127.0.0.1:{port}", opened, connect_timeout=1.0, ping=0.02, reconnect=0.01)
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.sleep(0.1)
        assert opened.is_open, "nothing was ever connected: a refusal then says nothing of a restart"
    finally:
        task.cancel()


LOADING = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}"


async def test_one_outage_is_logged_once_however_many_connections_the_restarting_server_drops(
    opened: gate.Gate,
) -> None:
    # up (two 200s), then gone, then loading: each connection gets a 503 and is dropped, five times; then up
    # again and gone again: a second outage, a second line
    script = [OK, OK, None, LOADING, None, LOADING, None, LOADING, None, LOADING, None, LOADING, None, OK, None]
    server = Server(lambda n: script[n - 1] if n <= len(script) else OK)
    with structlog.testing.capture_logs() as logs:
        await _run(server, opened, lambda: server.requests >= len(script) + 1)
    dropped = [entry for entry in logs if entry["event"] == "server_connection_dropped"]
    assert len(dropped) == 2, dropped
