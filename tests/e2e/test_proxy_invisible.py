"""Through the proxy, answers read as llama-server's own: the same request to the real server, direct and
through the proxy, compared field by field.

The proxy answers some requests itself: a stream's headers and keep-alives while its prompt is placed,
the refusals of paths no route holds. Those answers must say what llama-server would have said: no
request header sets a response header the server itself would not send (CORS), a prompt over the
context size gets llama-server's ``400`` and not a ``200`` with an error event, a scrape of
``/metrics`` reads the rate gauges as if the sidecar had never read them.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.llamabed import MakeServer, make_prompt
from tests.support.sidecarbed import MakeSidecar, proxied

LONG = 800
"""Prompt tokens of a streamed request whose prefill outlasts the proxy's 50 ms before it sends the headers."""


def _exchange(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request as sent (the path not normalised); status, headers (lower-case names) and the whole body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
        conn.request(method, path, body=data, headers=sent)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def _stream_body(prompt: str) -> dict[str, Any]:
    """A streamed chat (OpenAI or Anthropic: the same fields), its prompt never taken from the cache."""
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }


CORS = ("access-control-allow-origin", "access-control-allow-credentials")


@pytest.mark.parametrize("cors", [["--cors-origins", "localhost"], []], ids=["localhost", "default"])
def test_a_stream_the_proxy_answers_itself_has_the_servers_cors_headers(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path, cors: list[str]
) -> None:
    server = llama(slot_dir=tmp_path, extra_args=cors)
    _, proxy = proxied(sidecar, server, tmp_path)
    seeds = iter(range(7, 100))
    for route, first in (("/v1/chat/completions", b": keep-alive"), ("/v1/messages", b"event: ping")):
        for origin in ("http://evil.com", "http://localhost:5173"):
            sent = {"Origin": origin} if origin else {}
            # A prompt of its own for each request: no cache of the server's can shorten the prefill below
            # the proxy's 50 ms (llama-server's Anthropic route does not pass cache_prompt on: the same
            # prompt sent direct first would be served from the cache at once).
            body = _stream_body(make_prompt(server.url, LONG, seed=next(seeds)))
            status, direct, _ = _exchange(server.url, "POST", route, body, sent)
            assert status == 200
            body = _stream_body(make_prompt(server.url, LONG, seed=next(seeds)))
            status, through, streamed = _exchange(proxy, "POST", route, body, sent)
            assert status == 200
            assert streamed.startswith(first), f"the proxy did not answer {route} itself: {streamed[:80]!r}"
            for name in CORS:
                assert through.get(name) == direct.get(name), (route, origin, name, direct, through)
            assert through.get("server") == direct.get("server") == "llama.cpp"
            if cors and origin == "http://evil.com":
                assert "access-control-allow-origin" not in through, "a request header set a CORS header"


def _gauges(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            found[name] = float(value)
    return found


def test_a_scrape_through_the_proxy_reads_the_rate_gauges_the_sidecars_polls_reset(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    server = llama(slot_dir=tmp_path)
    side, proxy = proxied(sidecar, server, tmp_path)
    prompt = make_prompt(server.url, 300, seed=11)
    status, _, _ = _exchange(proxy, "POST", "/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0})
    assert status == 200
    side.wait_saved(1)  # polls (each a /metrics read, resetting the gauges' window) ran after the turn ended

    status, _, text = _exchange(proxy, "GET", "/metrics")
    assert status == 200
    seen = _gauges(text.decode())
    # The only work since the process started: the window llama-server would report to its first scraper.
    assert seen["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        seen["llamacpp:prompt_tokens_total"] / seen["llamacpp:prompt_seconds_total"], rel=0.01
    )
    steps = seen["llamacpp:tokens_predicted_total"] - 1  # the first token comes from the prompt's batch
    assert seen["llamacpp:predicted_tokens_seconds"] == pytest.approx(
        steps / seen["llamacpp:tokens_predicted_seconds_total"], rel=0.02
    )
    again = _gauges(_exchange(proxy, "GET", "/metrics")[2].decode())
    assert again["llamacpp:predicted_tokens_seconds"] == 0.0, "no work since the last scrape: llama-server says 0"


def test_a_prompt_over_the_context_gets_the_servers_400_not_a_stream(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    server = llama(slot_dir=tmp_path, ctx_size=512)
    _, proxy = proxied(sidecar, server, tmp_path)
    prompt = make_prompt(server.url, 700, seed=3)
    for route in ("/v1/chat/completions", "/v1/messages"):
        answers = []
        for url in (server.url, proxy):
            # The one slot busy: the request waits in llama-server's queue, past the proxy's first keep-alive.
            busy = threading.Thread(
                target=_exchange,
                args=(server.url, "POST", "/completion", {"prompt": "Once upon", "n_predict": 24}),
                daemon=True,
            )
            busy.start()
            status, headers, body = _exchange(url, "POST", route, _stream_body(prompt))
            busy.join()
            answers.append((status, headers.get("content-type"), json.loads(body)))
        assert answers[1] == answers[0]
        assert answers[0][0] == 400
        assert answers[0][2]["error"]["type"] == "exceed_context_size_error"


def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """Send ``head``; what came back before the body was sent (an interim answer), and the rest."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(1.5)
        interim = b""
        try:  # an interim answer may arrive in more than one TCP segment
            while b"\r\n\r\n" not in interim:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                interim += chunk
        except TimeoutError:
            pass
        sock.settimeout(10)
        sock.sendall(body)
        rest = b""
        while b"\r\n\r\n" not in rest or len(rest.split(b"\r\n\r\n", 1)[1]) < 2:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return interim, rest


def test_paths_heads_and_interim_answers_read_as_the_servers(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    server = llama(slot_dir=tmp_path)
    _, proxy = proxied(sidecar, server, tmp_path)
    for method, path in (("POST", "/no/such/route"), ("GET", "/v1/../health"), ("POST", "/v1/%2e%2e/completion")):
        direct = _exchange(server.url, method, path, {})
        through = _exchange(proxy, method, path, {})
        assert through[0] == direct[0] == 404, (method, path, direct, through)
        assert json.loads(through[2]) == json.loads(direct[2])
        assert through[1]["server"] == direct[1]["server"] == "llama.cpp"
        assert through[1]["content-type"] == direct[1]["content-type"]

    direct = _exchange(server.url, "HEAD", "/health")
    through = _exchange(proxy, "HEAD", "/health")
    assert through[0] == direct[0] == 200
    assert through[1].get("content-length") == direct[1].get("content-length") == "15"

    body = b'{"content": "hello"}'
    for url in (server.url, proxy):
        head = (
            f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
        ).encode()
        interim, rest = _raw(url, head, body)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), (url, interim)
        assert rest.startswith(b"HTTP/1.1 200"), (url, rest[:200])
