"""deploy/haproxy/haproxy.cfg: valid for the real HAProxy, and the conversation key it computes, per API.

Two stand-in nodes (threads: an HTTP server that records each request's key,
and an agent port answering ``ready up 100%``) behind the real HAProxy: each
API's first turn and next turn carry the same key and reach the same node.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deploytools import DEPLOY, require_tool, run

from support.haproxybed import INSTALL, HAProxy
from support.net import free_port


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


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[HAProxy]:
    require_tool("haproxy", install=INSTALL)
    servers: list[socketserver.TCPServer] = []
    nodes = {}
    for name in ("node-a", "node-b"):
        web = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Node)
        agent = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), _Agent)
        servers += [web, agent]
        nodes[name] = (web.server_address[1], agent.server_address[1])
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    with HAProxy(tmp_path, {n: (int(p), int(a)) for n, (p, a) in nodes.items()}, expose_key=True) as proxy:
        for name in nodes:
            proxy.wait_status(name, "UP", timeout=20)
        yield proxy
    for server in servers:
        server.shutdown()
        server.server_close()


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
