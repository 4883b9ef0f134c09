"""The relay's client to llama-server against a minimal HTTP server on loopback that misbehaves on demand.

The relay's main path goes through a real llama-server in tests/e2e; these
are the faults it cannot be made to produce: an answer cut mid-body, bytes
that are not HTTP, a kept-alive connection closed while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.proxy import upclient

Reply = Callable[[bytes], list[bytes] | None]
"""The bytes to write (in order) for a request's head; None: close the connection."""


def length(body: bytes, extra: str = "") -> list[bytes]:
    return [f"HTTP/1.1 200 OK\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body]


def chunked(*chunks: bytes) -> list[bytes]:
    parts = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    parts += [f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks]
    return [*parts, b"0\r\n\r\n"]


class Server:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(size))
                parts = self.reply(head)
                if parts is None:
                    break
                for part in parts:
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


@contextlib.asynccontextmanager
async def serving(
    reply: Reply, *, prefix: str = "", keepalive: float = 2.0
) -> AsyncIterator[tuple[Server, upclient.Client]]:
    server = Server(reply)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    client = upclient.Client(f"http://127.0.0.1:{port}{prefix}", connect_timeout=2.0, keepalive=keepalive)
    try:
        yield server, client
    finally:
        await client.close()
        for writer in server.writers:
            writer.close()
        listening.close()
        await listening.wait_closed()


async def test_a_kept_alive_connection_serves_the_next_request_and_the_request_goes_out_as_given() -> None:
    async with serving(lambda head: length(b'{"ok":1}', "X-Up: yes\r\n"), prefix="/llama/") as (server, client):
        for n in range(3):
            up = await client.request(
                "POST", "/completion?x=1", [("Content-Type", "application/json")], b'{"n":%d}' % n
            )
            assert (up.status, up.reason, up.length, up.chunked) == (200, "OK", 8, False)
            assert up.header("x-up") == "yes"
            assert await up.read() == b'{"ok":1}'
            up.release()
        assert server.connections == 1
        assert server.bodies == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
        first = server.heads[0].split(b"\r\n")
        assert first[0] == b"POST /llama/completion?x=1 HTTP/1.1"
        assert b"Content-Type: application/json" in first
        assert b"Content-Length: 7" in first


async def test_a_chunked_answers_connection_is_never_reused_and_a_spare_takes_its_place() -> None:
    async with serving(lambda head: chunked(b"data: 1\n\n", b"data: 2\n\n")) as (server, client):
        up = await client.request("POST", "/completion", [], b"{}")
        assert up.chunked
        assert up.length is None
        assert await up.read() == b"data: 1\n\ndata: 2\n\n"
        up.release()
        assert not client._idle, "llama-server closes it after the stream: never pooled"
        client.open_spare()
        await asyncio.wait_for(_until(lambda: server.connections == 2), 5)
        up = await client.request("POST", "/completion", [], b"{}")
        assert await up.read() == b"data: 1\n\ndata: 2\n\n"
        assert server.connections == 2, "the request took the spare, not a connection of its own"


async def test_an_answer_cut_mid_body_raises_lost_after_the_bytes_that_came() -> None:
    async with serving(lambda head: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf"]) as (server, client):
        up = await client.request("GET", "/slots", [], b"")
        assert await up.readany() == b"half"
        for writer in server.writers:
            writer.close()
        with pytest.raises(upclient.Lost):
            await up.readany()
        up.release()  # not at its end: closed, never pooled
        await client.request("GET", "/slots", [], b"")
        assert server.connections == 2


async def test_bytes_that_are_not_http_raise_lost() -> None:
    async with serving(lambda head: [b"SSH-2.0-OpenSSH\r\n\r\n"]) as (_server, client):
        with pytest.raises(upclient.Lost, match="not valid HTTP"):
            await client.request("GET", "/health", [], b"")


async def test_a_connection_closed_before_the_answer_raises_lost() -> None:
    async with serving(lambda head: None) as (_server, client):
        with pytest.raises(upclient.Lost):
            await client.request("POST", "/completion", [], b"{}")


async def test_nothing_listening_raises_connect_failed() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    client = upclient.Client(f"http://127.0.0.1:{port}", connect_timeout=2.0, keepalive=2.0)
    with pytest.raises(upclient.ConnectFailed):
        await client.request("GET", "/health", [], b"")


async def test_a_request_cancelled_while_it_waits_closes_its_connection() -> None:
    """A client that goes away: llama-server sees the connection drop and stops the task."""
    async with serving(lambda head: []) as (server, client):
        waiting = asyncio.create_task(client.request("POST", "/completion", [], b"{}"))
        await asyncio.wait_for(_until(lambda: len(server.heads) == 1), 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(server.closed.wait(), 5)


async def test_an_idle_connection_past_its_keepalive_or_closed_by_the_server_is_not_reused() -> None:
    async with serving(lambda head: length(b"ok"), keepalive=0.2) as (server, client):
        up = await client.request("GET", "/health", [], b"")
        await up.read()
        up.release()
        await asyncio.sleep(0.3)  # past the keep-alive, on purpose
        up = await client.request("GET", "/health", [], b"")
        await up.read()
        up.release()
        assert server.connections == 2
        server.writers[-1].close()  # llama-server closes an idle one
        await asyncio.wait_for(_until(lambda: client._idle[-1].closed), 5)
        up = await client.request("GET", "/health", [], b"")
        assert await up.read() == b"ok"
        assert server.connections == 3


async def test_a_big_answer_read_slowly_arrives_whole() -> None:
    """Reading pauses while the relay has not taken what was read, and resumes: nothing lost or stuck."""
    blob = bytes(range(256)) * (upclient.PAUSE_BYTES // 64)
    async with serving(lambda head: chunked(*[blob[i : i + 65536] for i in range(0, len(blob), 65536)])) as (
        _s,
        client,
    ):
        up = await client.request("GET", "/props", [], b"")
        await asyncio.sleep(0.2)  # the server writes meanwhile, past the pause mark
        got = []
        while chunk := await asyncio.wait_for(up.readany(), 5):
            got.append(chunk)
        assert b"".join(got) == blob


async def test_a_head_answer_ends_at_its_headers() -> None:
    async with serving(lambda head: [b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n"]) as (_server, client):
        up = await client.request("HEAD", "/", [], b"")
        assert (up.status, up.length) == (200, 5000)
        assert await asyncio.wait_for(up.read(), 5) == b""


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


async def test_an_answer_with_neither_length_nor_chunks_ends_where_its_connection_does() -> None:
    """An HTTP/1.0 server in between: the close is the answer's end, not a cut; the connection is not reused."""
    async with serving(
        lambda head: [b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n", b'{"a":', b"1}"]
    ) as (
        server,
        client,
    ):
        up = await client.request("GET", "/props", [], b"")
        assert up.length is None
        await asyncio.wait_for(_until(lambda: len(server.heads) == 1), 5)
        for writer in server.writers:
            writer.close()
        assert await asyncio.wait_for(up.read(), 5) == b'{"a":1}'
        up.release()
        assert not client._idle


async def test_idle_connections_no_longer_of_use_are_dropped_as_others_come_back() -> None:
    """The pool takes its newest connection first, so the oldest are closed as another comes back, not kept."""
    async with serving(lambda head: length(b"ok"), keepalive=0.5) as (server, client):

        async def once() -> None:
            up = await client.request("GET", "/health", [], b"")
            await up.read()
            up.release()

        answers = [await client.request("GET", "/health", [], b"") for _ in range(3)]  # three at once
        for up in answers:
            await up.read()
            up.release()
        assert len(client._idle) == 3
        await asyncio.sleep(0.3)  # time passing is the behaviour under test: the keep-alive is 0.5 s
        await once()  # the newest, still fresh, goes out and comes back
        await asyncio.sleep(0.3)  # now the two below it are past the keep-alive, it is not
        await once()
        assert len(client._idle) == 1, "the two stale connections were closed, not kept"
        assert server.connections == 3
