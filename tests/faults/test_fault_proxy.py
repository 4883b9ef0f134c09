"""The proxy against faults and hostile clients the real llama-server cannot produce on demand.

The relay and listener are the real ones; the upstream is a scripted aiohttp
server (:mod:`proxybed`) and the restore gate is driven by the test in place
of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp.test_utils import RawTestServer

from sidecar.core import tries
from sidecar.engine import gate
from sidecar.proxy import held, routes, tickets
from tests.support.proxybed import Upstream, json_body, raw_exchange, run_proxy, status_of
from tests.support.sidecarbed import SidecarProcess
from tests.support.wait import eventually, until

ADMIN = "admin-Zq8w3Xv1-a7Rk"
API_KEY = "sk-llama-7f3c9b1d2e4a"
MakeRaw = Callable[..., Awaitable[RawTestServer]]


@pytest.fixture
async def upstream(aiohttp_raw_server: MakeRaw) -> tuple[Upstream, str]:
    fake = Upstream()
    server = await aiohttp_raw_server(fake.handle)
    return fake, str(server.make_url("")).rstrip("/")


async def _post(url: str, path: str, **kwargs: Any) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, **kwargs) as resp:
        body = await resp.json(content_type=None)
        return resp.status, dict(resp.headers), body


@pytest.mark.timeout(20)
async def test_every_method_and_path_is_forwarded_with_body_and_end_to_end_headers(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    body = b'{"prompt": "x", "n_predict": 1}' * 100
    async with run_proxy(url) as proxy, aiohttp.ClientSession() as session:
        routes = {"GET": "/v1/models", "POST": "/tokenize", "DELETE": "/v1/stream", "OPTIONS": "/v1/embeddings"}
        for method, route in routes.items():
            path = f"{route}?model=a%20b&x=1"
            headers = {
                "Authorization": "Bearer client-key-1",
                "X-Client": "kept",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "dropped, named by Connection",
                "Keep-Alive": "timeout=5",
                "Proxy-Authorization": "Basic c2VjcmV0",
                "TE": "trailers",
            }
            async with session.request(method, proxy.url + path, data=body, headers=headers) as resp:
                echo = await resp.json()
                assert resp.status == 200
                assert resp.headers["X-Upstream"] == "yes"
                assert "X-Private" not in resp.headers
            seen = {k.lower(): v for k, v in echo["headers"]}
            assert echo["method"] == method
            assert echo["raw_path"] == path
            assert echo["body_bytes"] == len(body)
            assert seen["authorization"] == "Bearer client-key-1", "Authorization must pass through as is"
            assert seen["x-client"] == "kept"
            for hop in ("x-hop", "keep-alive", "proxy-authorization", "te"):
                assert hop not in seen, f"hop-by-hop header {hop} was forwarded"
        assert proxy.count("other", "ok") == 4
        for method in ("PUT", "PATCH"):  # llama-server has no route for them: its own 404, never forwarded
            async with session.request(method, proxy.url + "/tokenize", data=body) as resp:
                assert resp.status == 404
    assert len(fake.arrived) == 4


@pytest.mark.timeout(20)
async def test_body_over_the_cap_is_refused_before_reaching_the_server(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url, max_body_bytes=64 << 10) as proxy:
        status, _, body = await _post(proxy.url, "/completion", data=b"x" * (1 << 20))
        assert status == 413, body
        assert "--proxy-max-body-bytes" in body["error"]["message"]

        async def chunked() -> Any:  # no Content-Length: the cap is enforced while reading
            for _ in range(40):
                yield b"y" * 4096

        status, _, body = await _post(proxy.url, "/completion", data=chunked())
        assert status == 413, body
        status, _, echo = await _post(proxy.url, "/completion", data=b"z" * (60 << 10))
        assert status == 200
        assert echo["body_bytes"] == 60 << 10
        assert proxy.count("completion", "invalid") == 2
    assert fake.paths() == ["/completion"], "an oversized body reached the server"


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "target",
    [
        b"/../slots/0?action=erase",
        b"/v1/%2e%2e/slots/0?action=erase",
        b"/v1/%2E%2E/completion",
        b"/a/./completion",
        b"/a\\..\\slots/0",
        b"/a/%5c../b",
        b"/x%00y",
        b"//slots/0?action=erase",
        b"http://elsewhere.example/completion",
    ],
)
async def test_paths_with_dot_segments_or_foreign_targets_are_refused(
    upstream: tuple[Upstream, str], target: bytes
) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy:
        request = b"POST " + target + b" HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
        answer = await raw_exchange(proxy.port, request)
        # A path no route of llama-server holds: its own 404; a target that is no path: 400.
        assert status_of(answer) == (404 if target.startswith(b"/") else 400), answer[:200]
        assert proxy.count("other", "invalid") == 1
    assert not fake.arrived, f"{target!r} reached the server as {fake.paths()}"


@pytest.mark.timeout(20)
async def test_slot_actions_are_refused_however_spelled_unless_the_admin_token_is_sent(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    # Each spelling is refused for what it is, not for the wrong tokens sent before it: no wait for those here.
    unlimited = tries.Tries(free=1000)
    async with run_proxy(url, admin_token=ADMIN, api_key=API_KEY, admin_tries=unlimited) as proxy:
        refused = [
            ("POST", "/slots/0?action=erase"),
            ("POST", "/slots/0?action=save"),
            ("POST", "/slots/1?action=restore"),
            ("POST", "/slots%2F0?action=erase"),
            ("POST", "/slots%2f0?action=erase"),
            ("POST", "/%u0073lots/0?action=erase"),
            ("POST", "/sl%uD800ots/1?action=save"),
            ("POST", "/slots/0/?action=erase"),
            ("POST", "/v1//slots/0?action=erase"),
            ("POST", "/api/slots/0?action=erase"),
            ("POST", "/SLOTS/0?action=erase"),
            ("PUT", "/slots/0?action=erase"),
            ("POST", "/slots"),
        ]
        for method, path in refused:
            for auth in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"Bearer {ADMIN}x"}):
                answer = await raw_exchange(
                    proxy.port,
                    f"{method} {path} HTTP/1.1\r\nHost: a\r\nContent-Length: 23\r\n".encode()
                    + b"".join(f"{k}: {v}\r\n".encode() for k, v in auth.items())
                    + b'\r\n{"filename": "x.bin"}\r\n',
                )
                # A slot action's spelling: 403; a path llama-server has no route for: its own 404.
                slot_action = routes.classify(method, path).verdict is routes.Verdict.SLOT_ACTION
                assert status_of(answer) == (403 if slot_action else 404), (method, path, auth, answer[:300])
                assert b"reserved to llama-kv-sidecar" in answer or b"\r\n\r\n" in answer
        assert not fake.arrived, f"refused slot actions reached the server: {fake.paths()}"
        assert proxy.count("other", "refused") == len(refused) * 3

        async with aiohttp.ClientSession() as session:
            async with session.get(proxy.url + "/slots", headers={"Authorization": "Bearer c"}) as resp:
                assert resp.status == 200, "reading /slots is not a slot action"
            admin = {"Authorization": f"Bearer {ADMIN}"}
            async with session.post(proxy.url + "/slots/0?action=erase", headers=admin) as resp:
                echo = await resp.json()
                assert resp.status == 200
        sent = {k.lower(): v for k, v in echo["headers"]}
        assert sent["authorization"] == f"Bearer {API_KEY}", "the admin token must not reach llama-server"


@pytest.mark.timeout(20)
async def test_client_sending_headers_slowly_is_disconnected_and_others_are_served(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    async with run_proxy(url, idle_timeout=1.0) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        started = time.monotonic()
        closed_after = None
        trickle = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"a" * 1000
        for byte in trickle:  # one byte every 0.1 s, for at most 6 s
            if time.monotonic() - started > 6.0:
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                async with asyncio.timeout(0.1):
                    data = await reader.read(1)
            except TimeoutError:
                continue
            except ConnectionError:
                data = b""
            if data == b"":
                closed_after = time.monotonic() - started
                break
        writer.close()
        assert closed_after is not None, "the proxy kept a connection open that never finished its headers"
        assert closed_after < 5.0
        status, _, _ = await _post(proxy.url, "/completion", json={"prompt": "x"})
        assert status == 200
    assert fake.paths() == ["/completion"]


@pytest.mark.timeout(20)
async def test_client_that_goes_away_cancels_the_upstream_request(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy:
        with pytest.raises(TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
                await session.post(proxy.url + "/completion?fake=hang", json={"prompt": "x"})
        await eventually(_is_set(fake.hung_up), timeout=5, what="the upstream request to be cancelled")
        await until(lambda: proxy.count("completion", "cancelled") == 1, what="cancelled counted")
        assert proxy.gauge("proxy_inflight_requests") == 0

        fake.hung_up.clear()  # a stream the client leaves after its first event
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proxy.url + "/completion?fake=sse", json={"stream": True})
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()
        fake.step.set()
        await until(lambda: proxy.count("completion", "cancelled") == 2, what="the stream's end counted as cancelled")


def _is_set(event: asyncio.Event) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return event.is_set()

    return check


@pytest.mark.timeout(20)
async def test_events_are_relayed_one_by_one_not_buffered(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy, aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/completion?fake=sse", json={"stream": True}) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            for n in range(3):
                # The upstream writes event n+1 only after the client has read event n through the proxy.
                async with asyncio.timeout(3):
                    line = await resp.content.readline()
                assert line == f'data: {{"n": {n}}}\n'.encode(), line
                assert await resp.content.readline() == b"\n"
                fake.step.set()
            assert await resp.content.read() == b"data: [DONE]\n\n"
        assert proxy.count("completion", "ok") == 1
        assert proxy.count("other", "ok") == 0


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("path", "event"),
    [
        ("/completion?fake=cut", b'data: {"error":{"code":502,"message":"llama-server went away'),
        ("/v1/messages?fake=cut", b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"llama-'),
        ("/v1/responses?fake=cut", b'event: error\ndata: {"type":"error","code":"server_error","message":"llama-'),
    ],
)
async def test_stream_cut_after_its_first_events_ends_with_an_error_event_of_its_api(
    upstream: tuple[Upstream, str], path: str, event: bytes
) -> None:
    _, url = upstream
    async with run_proxy(url) as proxy, aiohttp.ClientSession() as session:
        async with session.post(proxy.url + path, json={"stream": True}) as resp:
            assert resp.status == 200
            rest = await resp.content.read()  # a complete chunked body: no ClientPayloadError
        assert rest.startswith(b'data: {"n": 0}\n\ndata: {"n": 1}\n\n'), rest
        tail = rest.split(b'data: {"n": 1}\n\n', 1)[1]
        assert tail.startswith(event), tail
        assert tail.endswith(b"\n\n")
        await until(lambda: proxy.count("completion", "error") == 1, what="the cut counted as an error")


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "path", ["/v1/chat/completions?fake=prefill-crash-once", "/v1/messages?fake=prefill-crash-once"]
)
async def test_a_stream_whose_server_dies_before_its_first_event_is_sent_again_unseen(
    upstream: tuple[Upstream, str], path: str
) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy, aiohttp.ClientSession() as session:
        async with session.post(proxy.url + path, json={"stream": True}) as resp:
            assert resp.status == 200
            body = await resp.content.read()
        assert body == b'data: {"timings": {"cache_n": 7}}\n\n', "one answer, the first attempt's ping never relayed"
        assert fake.paths() == [path, path]
        assert proxy.count("completion", "ok") == 1


@pytest.mark.timeout(20)
async def test_answer_shorter_than_its_length_becomes_a_502(upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    async with run_proxy(url) as proxy:
        status, _, body = await _post(proxy.url, "/tokenize?fake=short", json={})
        assert status == 502, body
        assert "could not get an answer from llama-server" in body["error"]["message"]
        assert proxy.count("other", "error") == 1


@pytest.mark.timeout(30)
async def test_a_thousand_held_time_outs_are_logged_as_a_few_lines_with_their_count(
    upstream: tuple[Upstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = upstream
    monkeypatch.setattr(held, "LOG_EVERY", 1.0)
    with structlog.testing.capture_logs() as logs:
        async with run_proxy(url, hold_seconds=0.5, gate_open=False) as proxy:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one() -> int:
                    async with session.post(proxy.url + "/completion", json={"prompt": "x"}) as resp:
                        return resp.status

                statuses = await asyncio.gather(*(one() for _ in range(1000)))
            assert statuses == [503] * 1000
            assert proxy.count("completion", "held_timeout") == 1000
            await until(
                lambda: sum(e.get("requests", 0) for e in logs if e["event"] == "proxy_request_held_too_long") == 1000,
                timeout=5,
                what="the last line with the rest of the count",
            )
    lines = [e for e in logs if e["event"] == "proxy_request_held_too_long"]
    assert len(lines) <= 5, [e["requests"] for e in lines]


@pytest.mark.timeout(20)
async def test_completion_held_past_the_limit_gets_503_with_retry_after_and_others_pass(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    async with run_proxy(url, hold_seconds=0.5, gate_open=False) as proxy:
        started = time.monotonic()
        status, headers, body = await _post(proxy.url, "/v1/chat/completions", json={"messages": []})
        waited = time.monotonic() - started
        assert status == 503, body
        assert int(headers["Retry-After"]) > 0
        assert gate.NOT_POLLED in body["error"]["message"]
        assert 0.5 <= waited < 3
        assert proxy.count("completion", "held_timeout") == 1
        assert proxy.held() == 1
        async with aiohttp.ClientSession() as session, session.get(proxy.url + "/health") as resp:
            assert resp.status == 200, "non-completion routes do not wait at the gate"
    assert fake.paths() == ["/health"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("path", "keep_alive", "error"),
    [
        ("/v1/chat/completions", b": keep-alive\n\n", b'data: {"error":{"code":503,'),
        ("/v1/messages", b'event: ping\ndata: {"type":"ping"}\n\n', b'event: error\ndata: {"type":"error","error":'
         b'{"type":"overloaded_error",'),
    ],
)  # fmt: skip
async def test_a_stream_held_past_the_limit_is_kept_alive_then_ends_with_the_503_as_its_error_event(
    upstream: tuple[Upstream, str], path: str, keep_alive: bytes, error: bytes
) -> None:
    fake, url = upstream
    async with run_proxy(url, hold_seconds=1.5, gate_open=False) as proxy, aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(proxy.url + path, json={"stream": True, "messages": []}) as resp:
            headed = time.monotonic() - started
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            body = await resp.content.read()  # a complete chunked body: no ClientPayloadError
        assert headed < 0.5, f"the headers came {headed:.3f} s after the request"
        assert body.startswith(keep_alive + keep_alive), body  # at once, then a second later
        tail = body.removeprefix(keep_alive * body.count(keep_alive))
        assert tail.startswith(error), body
        assert gate.NOT_POLLED.encode() in tail
        assert proxy.count("completion", "held_timeout") == 1
    assert fake.paths() == []


@pytest.mark.timeout(20)
async def test_held_request_goes_through_once_the_gate_opens(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url, gate_open=False) as proxy:
        request = asyncio.create_task(_post(proxy.url, "/completion", json={"prompt": "x"}))
        await until(lambda: proxy.gauge("proxy_held_requests") == 1, what="the request held at the gate")
        assert not fake.arrived
        proxy.gate.open(seen_at=time.monotonic())
        status, _, _ = await request
        assert status == 200
        assert proxy.count("completion", "ok") == 1
        assert proxy.held() == 1
        assert proxy.gauge("proxy_held_requests") == 0


@pytest.mark.timeout(20)
async def test_request_dropped_before_any_answer_byte_is_sent_once_more(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy:
        for path in ("/completion?fake=drop-once", "/tokenize?fake=drop-once"):
            fake.dropped = 0
            status, _, _ = await _post(proxy.url, path, json={"prompt": "x"})
            assert status == 200
    assert fake.paths() == ["/completion?fake=drop-once"] * 2 + ["/tokenize?fake=drop-once"] * 2


@pytest.mark.timeout(20)
async def test_completion_dropped_twice_waits_at_the_gate_and_is_sent_after_the_restore(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy:
        request = asyncio.create_task(_post(proxy.url, "/completion?fake=drop-twice", json={"prompt": "x"}))
        await until(lambda: not proxy.gate.is_open, what="the gate closed on the second drop")
        await until(lambda: proxy.gauge("proxy_held_requests") == 1, what="the request held at the gate")
        assert len(fake.arrived) == 2
        proxy.gate.open(seen_at=time.monotonic())
        status, _, _ = await request
        assert status == 200
        fake.dropped = 0
        status, _, _ = await _post(proxy.url, "/tokenize?fake=drop-twice", json={"content": "x"})
        assert status == 502, "a route that never waits is sent at most twice"
    assert fake.paths() == ["/completion?fake=drop-twice"] * 3 + ["/tokenize?fake=drop-twice"] * 2


class Placing:
    """A pinner that numbers its placements (``id_slot`` 0, 1, ...) and keeps each one's answer."""

    def __init__(self) -> None:
        self.placed: list[Any] = []

    async def prepare(self, raw_path: str, body: bytes, *, owner: str = "") -> str | None:
        return None

    @contextlib.asynccontextmanager
    async def pin(
        self, raw_path: str, body: bytes, *, owner: str = "", ticket: tickets.Ticket | None = None
    ) -> AsyncIterator[Any]:
        placement = _Placement(b'{"id_slot": %d}' % len(self.placed), f"slot={len(self.placed)}")
        self.placed.append(placement)
        yield placement


@dataclasses.dataclass
class _Placement:
    body: bytes
    header: str
    ended: Any = None
    counted: bool = True
    later: bool = False

    def answered(self, ended: Any) -> None:
        self.ended = ended


@pytest.mark.timeout(20)
async def test_a_completion_sent_again_after_the_restore_is_placed_afresh(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    placing = Placing()
    async with run_proxy(url, pinner=placing) as proxy:
        request = asyncio.create_task(_post(proxy.url, "/completion?fake=drop-twice", json={"prompt": "x"}))
        await until(lambda: proxy.gauge("proxy_held_requests") == 1, what="the request held at the gate")
        assert len(placing.placed) == 1, "held before its second placement"
        proxy.gate.open(seen_at=time.monotonic())
        status, headers, _ = await request
    assert status == 200
    assert [a.body for a in fake.arrived] == [b'{"id_slot": 0}'] * 2 + [b'{"id_slot": 1}']
    assert headers["X-Llama-Sidecar-Prefix"] == "slot=1"
    assert placing.placed[0].ended is None
    assert placing.placed[1].ended.status == 200


@pytest.mark.timeout(20)
async def test_completion_to_a_server_that_is_not_listening_waits_for_it(
    unused_tcp_port: int, aiohttp_raw_server: MakeRaw
) -> None:
    fake = Upstream()
    async with run_proxy(f"http://127.0.0.1:{unused_tcp_port}") as proxy:
        before = time.monotonic()
        request = asyncio.create_task(_post(proxy.url, "/v1/completions", json={"prompt": "x"}))
        await until(lambda: not proxy.gate.is_open, what="the gate closed on a refused connection")
        status, _, _ = await _post(proxy.url, "/tokenize", json={"content": "x"})
        assert status == 502, "a non-completion route answers at once when the server is down"
        await aiohttp_raw_server(fake.handle, port=unused_tcp_port)
        # A poll that started before the proxy saw the failure speaks for the old process: it must not open.
        proxy.gate.open(seen_at=before)
        await asyncio.sleep(0.3)
        assert not request.done()
        assert not proxy.gate.is_open
        proxy.gate.open(seen_at=time.monotonic())
        status, _, _ = await request
        assert status == 200
        assert proxy.count("completion", "ok") == 1
        assert proxy.count("other", "error") == 1
    assert fake.paths() == ["/v1/completions"]


@pytest.mark.timeout(20)
async def test_completion_answered_loading_model_is_held_and_retried(upstream: tuple[Upstream, str]) -> None:
    fake, url = upstream
    async with run_proxy(url) as proxy:
        request = asyncio.create_task(_post(proxy.url, "/completion?fake=loading-once", json={"prompt": "x"}))
        await until(lambda: not proxy.gate.is_open, what="the gate closed on 'Loading model'")
        proxy.gate.open(seen_at=time.monotonic())
        status, _, _ = await request
        assert status == 200
    assert len(fake.arrived) == 2


@pytest.mark.timeout(30)
def test_proxy_port_in_use_is_a_clear_error_at_start(slot_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = SidecarProcess(
            "http://127.0.0.1:1", slot_dir, tmp_path / "log", extra={"--proxy-listen": f"127.0.0.1:{port}"}
        )
        assert proc.run_to_exit(20) == 2
    output = "\n".join(proc.lines())
    assert f"--proxy-listen 127.0.0.1:{port}: cannot listen there" in output


@pytest.mark.timeout(20)
async def test_connections_over_the_cap_get_a_503_json_answer_and_are_closed(upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    async with run_proxy(url, max_connections=3) as proxy:
        opened = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(5)]
        answers = []
        for reader, _ in opened:
            try:
                answers.append(await asyncio.wait_for(reader.read(4096), 0.3))
            except TimeoutError:
                answers.append(b"")
        assert answers[:3] == [b"", b"", b""], "connections within the cap are kept open, unanswered"
        for answer in answers[3:]:
            assert status_of(answer) == 503, answer
            assert "--proxy-max-connections" in json_body(answer)["error"]["message"]
        assert proxy.gauge("proxy_connections") == 3
        assert proxy.gauge("proxy_connections_refused_total") == 2
        for _, writer in opened:
            writer.close()
        await until(lambda: proxy.gauge("proxy_connections") == 0, what="closed connections counted out")
        status, _, _ = await _post(proxy.url, "/tokenize", json={"content": "x"})
        assert status == 200


@pytest.mark.timeout(20)
async def test_bodies_in_flight_are_capped_and_a_stalled_body_is_cut_at_the_body_timeout(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    async with run_proxy(url, max_inflight_body_bytes=3 << 20, body_timeout=1.0) as proxy:
        stalled = []
        for _ in range(3):  # each declares 1 MiB and sends half of it: the cap holds 3
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"POST /completion HTTP/1.1\r\nHost: a\r\nContent-Length: 1048576\r\n\r\n" + b"x" * (1 << 19))
            await writer.drain()
            stalled.append((reader, writer))
        await until(lambda: proxy.gauge("proxy_body_bytes") == 3 << 20, what="three bodies reserved")
        status, headers, body = await _post(proxy.url, "/completion", data=b"y" * 1000)
        assert status == 503, body
        assert headers["Retry-After"] == "1"
        assert "--proxy-max-inflight-body-bytes" in body["error"]["message"]
        for reader, writer in stalled:
            answer = await asyncio.wait_for(reader.read(4096), 5)
            assert status_of(answer) == 408, answer
            writer.close()
        assert proxy.gauge("proxy_body_bytes") == 0
        assert proxy.count("completion", "busy") == 1
        status, _, echo = await _post(proxy.url, "/completion", data=b"z" * 1000)
        assert status == 200
        assert echo["body_bytes"] == 1000
    assert fake.paths() == ["/completion"], "a refused or stalled body reached the server"


class _Uncounted(Placing):
    """A pinner whose placements (``counted``) say whether they need the answer's reuse figure."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.counted = counted

    @contextlib.asynccontextmanager
    async def pin(
        self, raw_path: str, body: bytes, *, owner: str = "", ticket: tickets.Ticket | None = None
    ) -> AsyncIterator[Any]:
        async with super().pin(raw_path, body, ticket=ticket) as placement:
            placement.counted = self.counted
            yield placement


@pytest.mark.timeout(20)
@pytest.mark.parametrize("counted", [True, False])
async def test_an_answer_is_read_for_its_reuse_figure_only_for_a_placement_that_counts_by_it(
    upstream: tuple[Upstream, str], counted: bool
) -> None:
    _, url = upstream
    placing = _Uncounted(counted)
    async with run_proxy(url, pinner=placing) as proxy, aiohttp.ClientSession() as session:
        path = "/v1/chat/completions?fake=prefill-crash-once"
        async with session.post(proxy.url + path, json={"stream": True}) as resp:
            body = await resp.content.read()
    assert body == b'data: {"timings": {"cache_n": 7}}\n\n', "relayed as it came either way"
    ended = placing.placed[-1].ended
    assert ended is not None
    assert ended.cached == (7 if counted else None), "a request the library did not route is relayed unread"


@pytest.mark.timeout(20)
async def test_wrong_admin_tokens_on_slot_actions_through_the_proxy_are_slowed_down(
    upstream: tuple[Upstream, str],
) -> None:
    fake, url = upstream
    async with run_proxy(url, admin_token=ADMIN, api_key=API_KEY) as proxy:

        async def erase(token: str) -> bytes:
            return await raw_exchange(
                proxy.port,
                f"POST /slots/0?action=erase HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
                f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n{{}}".encode(),
            )

        codes = [status_of(await erase(ADMIN + "x")) for _ in range(6)]
        assert codes == [403] * 6
        answer = await erase(ADMIN)
        assert status_of(answer) == 429, answer[:300]
        assert b"Retry-After: " in answer
        assert "too many wrong admin tokens" in json_body(answer)["error"]["message"]
        assert not fake.arrived  # neither the guesses nor the right token sent meanwhile reached llama-server
        await until_status(erase, ADMIN, 200)
        assert fake.paths() == ["/slots/0?action=erase"]


async def until_status(send: Callable[[str], Awaitable[bytes]], token: str, wanted: int) -> bytes:
    async def answered() -> bytes | None:
        answer = await send(token)
        return answer if status_of(answer) == wanted else None

    found = await eventually(answered, timeout=5, what=f"a {wanted}")
    assert found is not None
    return found
