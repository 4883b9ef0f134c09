"""The placer's ``GET /slots`` on the relay's client, against replies the real server cannot be made to give.

Required of every bad reply: the poller's error for it (unavailable, denied,
not slots), never a parser's exception, and a connection that served a bad
reply is not kept. Its main path (a real llama-server, with an API key) is
tests/e2e/test_library_slots_reads.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import config, errors, metrics
from sidecar.library import reads
from sidecar.observe import upstream
from tests.support import net
from tests.support.fakellama import FakeLlama, MakeFake, Reply
from tests.support.wait import until

KEY = "reads-secret-key"


def _settings(url: str, **changes: object) -> config.UpstreamSettings:
    return dataclasses.replace(config.UpstreamSettings(url=url, api_key=KEY, request_timeout=2.0), **changes)  # type: ignore[arg-type]


class _Reader(reads.SlotsReader):
    """The reader, with the counts of its second tries (``library_slots_read_retries_total``) at hand."""

    def __init__(self, settings: config.UpstreamSettings) -> None:
        self.registry = CollectorRegistry()
        super().__init__(settings, stats=metrics.Metrics(self.registry, version="test"))

    def retries(self) -> dict[str, float]:
        """Reads sent again, by which answered."""
        name = "llama_sidecar_library_slots_read_retries_total"
        return {a: self.registry.get_sample_value(name, {"answered": a}) or 0.0 for a in metrics.SLOTS_RETRY_ANSWERS}


NO_RETRIES = dict.fromkeys(metrics.SLOTS_RETRY_ANSWERS, 0.0)


@pytest.fixture
async def keyed(make_fake: MakeFake) -> AsyncIterator[tuple[FakeLlama, _Reader]]:
    fake = make_fake(api_key=KEY)
    reader = _Reader(_settings(fake.url))
    try:
        yield fake, reader
    finally:
        await reader.close()


async def test_the_slots_read_as_the_pollers_client_reads_them_with_the_key_on_kept_alive_connections(
    keyed: tuple[FakeLlama, _Reader],
) -> None:
    fake, reader = keyed
    fake.use(1, 321)
    async with aiohttp.ClientSession() as session:
        polled = await upstream.LlamaClient(session, _settings(fake.url)).slots()
    for _ in range(3):
        assert await reader.slots() == polled
    assert polled[1].tokens == 321
    assert polled[1].task is not None
    mine = fake.requests("/slots")[1:]
    assert [seen.auth for seen in mine] == [f"Bearer {KEY}"] * 3


async def test_a_reply_in_chunks_reads_whole(keyed: tuple[FakeLlama, _Reader]) -> None:
    fake, reader = keyed
    fake.use(0, 77)
    fake.replies["/slots"] = Reply.chunked(fake.slots_body(), chunk=16, pause=0.0)
    views = await reader.slots()
    assert [(v.id, v.tokens) for v in views] == [(0, 77), (1, 0)]


async def test_a_server_that_went_away_and_came_back_is_read_again(keyed: tuple[FakeLlama, _Reader]) -> None:
    fake, reader = keyed
    fake.use(0, 50)
    assert (await reader.slots())[0].tokens == 50
    fake.respawn()  # every connection closed, the kept-alive one included; slots empty
    assert (await reader.slots())[0].tokens == 0


async def test_a_wrong_key_is_denied_with_the_servers_status(make_fake: MakeFake) -> None:
    fake = make_fake(api_key=KEY)
    reader = _Reader(_settings(fake.url, api_key="wrong"))
    try:
        with pytest.raises(errors.UpstreamDenied, match="/slots: HTTP 401: Invalid API Key") as caught:
            await reader.slots()
        assert caught.value.status == 401
    finally:
        await reader.close()


BadReply = Callable[[FakeLlama], Reply]


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (lambda f: Reply.error(500), errors.UpstreamUnavailable, "/slots: HTTP 500: fake internal error"),
        (lambda f: Reply.error(404, "no such endpoint"), errors.UpstreamRejected, "/slots: HTTP 404"),
        (lambda f: Reply.raw("<html>proxy error</html>"), errors.UpstreamProtocolError, "did not return JSON"),
        (lambda f: Reply.json({"slots": []}), errors.UpstreamProtocolError, "did not return a list"),
        (lambda f: Reply.json([{"id": "zero"}]), errors.UpstreamProtocolError, "field 'id'"),
        (lambda f: Reply.huge(), errors.UpstreamProtocolError, f"answered more than {upstream.MAX_BODY} bytes"),
        (
            lambda f: Reply.chunked([{"pad": "x" * (upstream.MAX_BODY + 1)}], chunk=1 << 20, pause=0.0),
            errors.UpstreamProtocolError,
            f"answered more than {upstream.MAX_BODY} bytes",
        ),
    ],
    ids=["500", "404", "not-json", "not-a-list", "bad-field", "too-long", "too-long-in-chunks"],
)
async def test_a_bad_reply_is_the_pollers_error_and_the_next_good_one_reads(
    keyed: tuple[FakeLlama, _Reader], reply: BadReply, error: type[errors.UpstreamError], message: str
) -> None:
    fake, reader = keyed
    fake.replies["/slots"] = reply(fake)
    with pytest.raises(error, match=message):
        await reader.slots()
    del fake.replies["/slots"]
    fake.use(0, 9)
    assert (await reader.slots())[0].tokens == 9


@pytest.mark.parametrize(
    "reply",
    [lambda f: Reply.hang(), lambda f: Reply.drip(f.slots_body(), pause=0.1)],
    ids=["no-headers", "body-a-byte-at-a-time"],
)
async def test_a_hung_server_is_unavailable_after_the_request_timeout_and_its_connection_dropped(
    make_fake: MakeFake, reply: BadReply
) -> None:
    fake = make_fake()
    fake.replies["/slots"] = reply(fake)
    reader = _Reader(_settings(fake.url, api_key=None, request_timeout=0.3))
    try:
        with pytest.raises(errors.UpstreamUnavailable, match=r"/slots: no answer within 0\.3 s"):
            await reader.slots()
        await until(lambda: fake.requests("/slots")[0].hung_up, timeout=5, what="the fake sees the read hang up")
        del fake.replies["/slots"]
        assert len(await reader.slots()) == 2
    finally:
        await reader.close()


async def test_nothing_listening_is_unavailable() -> None:
    reader = _Reader(_settings(f"http://127.0.0.1:{net.free_port()}"))
    try:
        with pytest.raises(errors.UpstreamUnavailable, match="/slots: "):
            await reader.slots()
    finally:
        await reader.close()


async def test_a_read_left_without_an_answer_is_asked_again_on_a_new_connection_and_the_first_answer_is_taken(
    make_fake: MakeFake,
) -> None:
    """The read once got no answer at all after a restart; the turn must not wait for ``--request-timeout``."""
    fake = make_fake()
    fake.use(0, 42)
    reader = _Reader(_settings(fake.url, api_key=None, request_timeout=10.0))
    try:
        assert (await reader.slots())[0].tokens == 42  # a kept-alive connection now waits in the pool
        fake.replies["/slots"] = reads_hang = Reply.hang()
        started = time.monotonic()
        read = asyncio.ensure_future(reader.slots())
        await until(lambda: len(fake.requests("/slots")) == 2, timeout=5, what="the read reaches the fake")
        assert fake.replies.pop("/slots") is reads_hang  # the read in hand hangs; the next is answered
        views = await read
        waited = time.monotonic() - started
        assert views[0].tokens == 42
        assert reads.HEDGE_SECONDS <= waited < reads.HEDGE_SECONDS + 1.0, waited
        hung, asked_again = fake.requests("/slots")[1:]
        assert asked_again.start - hung.start >= reads.HEDGE_SECONDS
        await until(lambda: hung.hung_up, timeout=5, what="the hung read's connection is dropped")
        assert reader.retries() == {**NO_RETRIES, "second": 1.0}
        assert (await reader.slots())[0].tokens == 42
        assert reader.retries() == {**NO_RETRIES, "second": 1.0}, "a read answered at once is no retry"
    finally:
        await reader.close()


async def test_a_slow_first_read_that_answers_before_the_second_is_taken_and_counted_so(make_fake: MakeFake) -> None:
    fake = make_fake()
    fake.replies["/slots"] = Reply.drip(fake.slots_body(), pause=0.01)  # each read takes about 1 s
    reader = _Reader(_settings(fake.url, api_key=None, request_timeout=10.0))
    try:
        started = time.monotonic()
        assert len(await reader.slots()) == 2
        assert time.monotonic() - started < 2 * len(json.dumps(fake.slots_body())) * 0.01
        assert len(fake.requests("/slots")) == 2, "the read was sent again while the first still dripped"
        assert reader.retries() == {**NO_RETRIES, "first": 1.0}
    finally:
        await reader.close()


async def test_a_read_neither_try_answers_fails_after_the_request_timeout_and_is_counted(make_fake: MakeFake) -> None:
    fake = make_fake()
    fake.replies["/slots"] = Reply.hang()
    reader = _Reader(_settings(fake.url, api_key=None, request_timeout=1.0))
    try:
        with pytest.raises(errors.UpstreamUnavailable, match=r"/slots: no answer within 1 s"):
            await reader.slots()
        assert len(fake.requests("/slots")) == 2
        assert reader.retries() == {**NO_RETRIES, "neither": 1.0}
    finally:
        await reader.close()


async def test_a_read_answered_before_the_hedge_is_asked_once(keyed: tuple[FakeLlama, _Reader]) -> None:
    fake, reader = keyed
    fake.use(1, 5)
    for _ in range(5):
        assert (await reader.slots())[1].tokens == 5
    assert len(fake.requests("/slots")) == 5
    assert reader.retries() == NO_RETRIES


async def test_the_read_is_written_in_its_tasks_first_step_so_an_early_read_goes_out_before_the_callers_parse() -> None:
    """The placer sends its read, yields once, then parses while the loop is held: the request must be out by then."""
    arrived: list[float] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    body = json.dumps([{"id": 0, "n_ctx": 4096, "is_processing": False, "id_task": -1}]).encode()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            arrived.append(time.monotonic())
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    reader = _Reader(_settings(f"http://127.0.0.1:{port}", api_key=None))
    try:
        connected = await reader._client._connect()  # a kept-alive connection, as the placer's read finds one
        reader._client.give_back(connected)
        read = asyncio.ensure_future(reader.slots())
        await asyncio.sleep(0)  # the read's task takes its first step
        held = time.monotonic()
        while not arrived and time.monotonic() < held + 5:  # the caller's parse, holding the loop
            time.sleep(0.001)
        assert arrived, "the request went out only after the caller let the loop go"
        assert (await read)[0].id == 0
    finally:
        await reader.close()
        listener.close()
        server.join(timeout=5)
