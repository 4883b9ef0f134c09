"""The proxy's sentinel connection against a minimal HTTP server on loopback."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
import structlog

from sidecar.engine import gate
from sidecar.proxy import backoff, sentinel

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


async def test_a_drop_after_a_poll_reopened_the_gate_is_a_new_outage_though_the_sentinel_saw_no_200() -> None:
    # gone, then back loading (503s), then the poll sees it serve and opens the gate, and the process is
    # killed before the sentinel's next ping: a second outage, a second line
    g = gate.Gate()
    g.open(seen_at=0.0)
    reopened = False

    def answer(n: int) -> bytes | None:
        nonlocal reopened
        if n == 1:
            return OK
        if n in (2, 4):
            return None
        if n == 3:
            g.open(seen_at=time.monotonic())  # a poll that started after the suspicion saw it serve
            reopened = True
            return LOADING
        return OK

    server = Server(answer)
    with structlog.testing.capture_logs() as logs:
        await _run(server, g, lambda: server.requests >= 5)
    assert reopened
    dropped = [entry for entry in logs if entry["event"] == "server_connection_dropped"]
    assert len(dropped) == 2, dropped


async def test_a_drop_the_relay_saw_first_after_the_gate_reopened_is_still_a_new_outage() -> None:
    # as above, but a request's lost connection closed the gate before the sentinel saw its own drop (a kill in
    # a request): the poll's opening in between still makes it a second outage
    g = gate.Gate()
    g.open(seen_at=0.0)

    def answer(n: int) -> bytes | None:
        if n == 1:
            return OK
        if n in (2, 4):
            if n == 4:
                g.suspect("llama-server closed the connection twice (Lost)")  # the relay, first
            return None
        if n == 3:
            g.open(seen_at=time.monotonic())
            return LOADING
        return OK

    server = Server(answer)
    with structlog.testing.capture_logs() as logs:
        await _run(server, g, lambda: server.requests >= 5)
    dropped = [entry for entry in logs if entry["event"] == "server_connection_dropped"]
    assert len(dropped) == 2, dropped


def test_the_backoff_doubles_to_its_cap_with_jitter_and_starts_over_after_a_reset() -> None:
    draws = iter([0.0, 0.999, 0.5, 0.0, 0.999, 0.25, 0.0])
    pace = backoff.Backoff(0.1, 0.5, draw=lambda: next(draws))
    delays = [pace.next_delay() for _ in range(6)]
    steps = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    for delay, step in zip(delays, steps, strict=True):
        assert step / 2 <= delay <= step, (delays, steps)
    assert delays[3] != delays[4] != delays[5], "jitter: no two sidecars in step"
    pace.reset()
    assert pace.next_delay() == 0.05


async def test_a_server_that_drops_every_connection_is_reconnected_to_at_a_paced_rate(opened: gate.Gate) -> None:
    # a server that is closing: it accepts each connection and drops it before answering
    times: list[float] = []
    loop = asyncio.get_running_loop()

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        times.append(loop.time())
        writer.close()

    listening = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    watch = sentinel.Sentinel(f"http://127.0.0.1:{port}", opened, connect_timeout=1.0, ping=0.16, reconnect=0.02)
    task = asyncio.create_task(watch.run(), name="sentinel-under-test")
    try:
        async with asyncio.timeout(10):
            while len(times) < 8:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        listening.close()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    floors = [0.01, 0.02, 0.04, 0.08, 0.08, 0.08, 0.08]  # half of each step: 0.02 doubled, capped at 0.16
    assert all(gap >= floor * 0.9 for gap, floor in zip(gaps, floors, strict=True)), gaps
    assert not opened.is_open, "each drop is still a sign of a restart"


async def test_one_sentinel_runs_once(opened: gate.Gate) -> None:
    watch = sentinel.Sentinel("http://127.0.0.1:9", opened, connect_timeout=0.1, ping=0.02, reconnect=0.01)
    first = asyncio.create_task(watch.run(), name="first-sentinel")
    try:
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one prober per upstream"):
            await watch.run()
    finally:
        first.cancel()
