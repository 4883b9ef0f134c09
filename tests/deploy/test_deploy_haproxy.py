"""deploy/haproxy/haproxy.cfg: valid for the real HAProxy, the conversation key it computes per API, its bound.

Two stand-in nodes (threads: an HTTP server that records each request's key,
and an agent port answering ``ready up 100%``) behind the real HAProxy: each
API's first turn and next turn carry the same key and reach the same node;
and requests of one key held in flight at once are spread by the config's
``hash-balance-factor`` (the bound it sets is on requests in flight, not on
conversations).
"""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import math
import re
import socketserver
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploytools import DEPLOY, require_tool, run
from tests.support.haproxybed import INSTALL, HAProxy
from tests.support.net import free_port
from tests.support.wait import wait_until


def test_haproxy_accepts_the_shipped_config() -> None:
    haproxy = require_tool("haproxy", install=INSTALL)
    proc = run([haproxy, "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")])
    assert "Configuration file is valid" in proc.stdout + proc.stderr


class _Node(http.server.BaseHTTPRequestHandler):
    """Answers each request with the key HAProxy gave it."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = self.headers.get("x-conv-key", "").encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Agent(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"ready up 100%\n")


class _Held:
    """Requests the stand-in nodes hold until :attr:`release` is set, counted per node while they wait."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.waiting: dict[str, int] = {}

    def handler(self, node: str) -> type[http.server.BaseHTTPRequestHandler]:
        held = self

        class _Holding(_Node):
            def do_POST(self) -> None:
                with held.lock:
                    held.waiting[node] = held.waiting.get(node, 0) + 1
                held.release.wait(30)
                super().do_POST()

        return _Holding


def _stand_ins(tmp_path: Path, held: _Held | None = None) -> Iterator[HAProxy]:
    require_tool("haproxy", install=INSTALL)
    servers: list[socketserver.TCPServer] = []
    nodes = {}
    for name in ("node-a", "node-b"):
        handler = held.handler(name) if held is not None else _Node
        web = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        agent = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), _Agent)
        servers += [web, agent]
        nodes[name] = (web.server_address[1], agent.server_address[1])
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    with HAProxy(tmp_path, {n: (int(p), int(a)) for n, (p, a) in nodes.items()}, expose_key=True) as proxy:
        for name in nodes:
            proxy.wait_status(name, "UP", timeout=20)
        yield proxy
    if held is not None:
        held.release.set()
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[HAProxy]:
    yield from _stand_ins(tmp_path)


@pytest.fixture
def holding(tmp_path: Path) -> Iterator[tuple[HAProxy, _Held]]:
    held = _Held()
    for proxy in _stand_ins(tmp_path, held):
        yield proxy, held


def _send(proxy: HAProxy, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, str]:
    """(the node that took it, the key it was given)."""
    sent = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(proxy.url + path, data=json.dumps(body).encode(), headers=sent)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.headers["x-node"]), resp.read().decode()


SYSTEM = "You are a careful coding agent. " * 40
LONG_SYSTEM = "You are a careful coding agent with a very long system prompt. " * 400  # about 25 KB


def _turns(first: str) -> list[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """(path, first turn, next turn, what the key must contain) for each API's shape."""
    reply = {"role": "assistant", "content": "Sure."}
    more = {"role": "user", "content": "And then?"}
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    parts = [{"role": "user", "content": [{"type": "text", "text": first}]}]
    opening: list[dict[str, Any]] = [{"role": "user", "content": first}]
    anthropic = {"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": opening}
    return [
        ("/v1/chat/completions", {"messages": chat}, {"messages": [*chat, reply, more]}, first),
        ("/v1/chat/completions", {"messages": parts}, {"messages": [*parts, reply, more]}, first),
        ("/v1/messages", anthropic, {**anthropic, "messages": [*opening, reply, more]}, first),
        (
            "/v1/responses",
            {"instructions": SYSTEM, "input": first},
            {"instructions": SYSTEM, "input": [{"role": "user", "content": first}, reply, more]},
            first,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": first}]},
            {"messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": first}, reply]},
            first,
        ),
        # a raw prompt holds the whole conversation: its first KiB is the key (a longer first turn than 1 KiB)
        ("/completion", {"prompt": f"{first} {SYSTEM}"}, {"prompt": f"{first} {SYSTEM} Sure. And then?"}, first),
    ]


def test_each_apis_next_turn_gets_its_first_turns_key_and_node(balancer: HAProxy) -> None:
    for n in range(6):
        first = f"Fix the bug in module {n} of the parser."
        for path, turn1, turn2, inside in _turns(first):
            node1, key1 = _send(balancer, path, turn1)
            node2, key2 = _send(balancer, path, turn2)
            assert key1 == key2, (path, key1[:200], key2[:200])
            assert inside in key1, (path, key1[:200])
            assert node1 == node2, path


def test_a_named_session_wins_over_the_conversations_start(balancer: HAProxy) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    assert _send(balancer, "/v1/chat/completions", body, {"x-session-id": "s-1"})[1] == "s-1"
    assert _send(balancer, "/v1/chat/completions", body, {"session_id": "s-2"})[1] == "s-2"
    assert _send(balancer, "/v1/responses", {"prompt_cache_key": "c-3", "input": "hello"})[1] == "c-3"
    anthropic = {"metadata": {"user_id": "u-4"}, "messages": body["messages"]}
    assert _send(balancer, "/v1/messages", anthropic)[1] == "u-4"


def test_conversations_spread_over_both_nodes(balancer: HAProxy) -> None:
    nodes = [
        _send(balancer, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Task {n}: go."}]})[0]
        for n in range(40)
    ]
    counts = {name: nodes.count(name) for name in set(nodes)}
    assert set(counts) == {"node-a", "node-b"}, counts
    assert min(counts.values()) >= 8, counts


def test_requests_of_one_key_in_flight_at_once_are_bounded_by_the_balance_factor(
    holding: tuple[HAProxy, _Held],
) -> None:
    """The config's ``hash-balance-factor`` bounds the requests a node has in flight against the average, not the
    conversations it holds: one key's requests, held at the node all at once, spill to the next node past it."""
    proxy, held = holding
    found = re.search(r"(?m)^    hash-balance-factor (\d+)$", proxy.path.read_text())
    assert found is not None, "the shipped config bounds the load with hash-balance-factor"
    factor = int(found.group(1)) / 100
    burst = 8
    body = {"messages": [{"role": "user", "content": "One agent's many calls."}]}
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        sent = []
        for n in range(burst):  # one at a time, each in flight before the next: HAProxy's count is exact
            sent.append(pool.submit(_send, proxy, "/v1/chat/completions", body, {"x-session-id": "agent-1"}))
            wait_until(lambda: sum(held.waiting.values()) == len(sent), timeout=10, what=f"request {n + 1} at a node")
        at = dict(held.waiting)
        held.release.set()
        nodes = [future.result()[0] for future in sent]
    assert {name: nodes.count(name) for name in set(nodes)} == at
    assert len(at) == 2, f"one key's {burst} requests in flight all went to one node: {at}"
    assert max(at.values()) <= math.ceil(factor * burst / len(at)), (at, factor)
