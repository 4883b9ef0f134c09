"""Clients that end their side of the connection, through the real proxy to a real llama-server."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, http_json, slots
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar


def _send(port: int, body: dict[str, object]) -> socket.socket:
    data = json.dumps(body).encode()
    head = "POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(head.encode() + data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _answer(raw: bytes, name: str) -> dict[str, object]:
    """The final answer's JSON (after any interim 100 Continue)."""
    heads = raw.split(b"\r\n\r\n")
    while heads and heads[0].startswith(b"HTTP/1.1 100"):
        heads.pop(0)
    assert heads, (name, raw[:300])
    assert heads[0].startswith(b"HTTP/1.1 200"), (name, raw[:300])
    parsed: dict[str, object] = json.loads(b"\r\n\r\n".join(heads[1:]))
    return parsed


def test_a_client_that_half_closes_after_sending_gets_its_whole_answer_as_straight_from_llama_server(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    server = llama(slot_dir)
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    side.wait_for(lambda: http_json("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200, what="proxy")
    body = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
    complete(server.url, str(body["prompt"]), n_predict=12)  # warm: the half-closed turns then take < 1 s

    answers = {}
    for name, target in (("direct", server.port), ("proxy", port)):
        sock = _send(target, body)
        sock.shutdown(socket.SHUT_WR)
        answers[name] = _answer(_read_all(sock), name)
        sock.close()
    assert answers["direct"]["tokens_predicted"] == 12, "straight to llama-server the half-closed client is answered"
    assert answers["proxy"]["content"] == answers["direct"]["content"]
    assert answers["proxy"]["tokens_predicted"] == 12
    assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="ok") == 1
    assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="cancelled") == 0

    # the path next to it: a client that closes its socket outright is seen gone and its request cancelled
    sock = _send(port, {"prompt": "Count: 1 2 3", "n_predict": 4000, "temperature": 0, "ignore_eos": True})
    side.wait_for(lambda: slots(server.url)[0]["is_processing"], timeout=30, what="the long generation to start")
    sock.close()
    closed = time.monotonic()
    side.wait_for(
        lambda: side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="cancelled") == 1,
        timeout=10,
        what="the closed client's request cancelled",
    )
    assert time.monotonic() - closed < 5
