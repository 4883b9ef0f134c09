"""Streamed clients through the proxy to the real llama-server: kept alive while they wait, and cancelled
when they leave.

A streamed request held at the restore gate, or in a long prefill, gets its
headers and keep-alives at once, so the official SDKs with a read timeout
shorter than the wait finish their stream (on the old relay they raised
``APITimeoutError``). A client that leaves closes its request at
llama-server, which stops the prefill: it is seen from llama-server's own
log (``stop processing: n_tokens = N`` with N short of the prompt), since
every /slots read is a task whose result would keep llama-server from
checking its client (see ``Poller.quiet``).
"""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx2
import openai

from tests.support.llamabed import LlamaServer, MakeServer, make_prompt, slots
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifests, proxied

READ_TIMEOUT = 3.0
"""The SDKs' read timeout: shorter than every wait below. Each answer is one token: the gap between two
tokens, which is llama-server's alone, reached 3 s and more on 2 busy cores."""
HELD = 2 * READ_TIMEOUT + 1
LONG_PROMPT = 3000
STOPPED = re.compile(r"task (\d+) \| stop processing: n_tokens = (\d+)")


def _timeout() -> httpx2.Timeout:
    return httpx2.Timeout(120.0, read=READ_TIMEOUT)


def _chat(url: str, text: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=_timeout())
    with client:
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0, stream=True
        )
        finished = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finished, "the chat stream ended with no finish reason"
    return f"chat finished: {finished[-1]}"


def _messages(url: str, text: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=_timeout())
    asked = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    with client, client.messages.stream(**asked) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    assert message.stop_reason is not None, "the message stream ended with no stop reason"
    return f"messages stopped: {message.stop_reason}"


def _responses(url: str, text: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=_timeout())
    with client:
        stream = client.responses.create(model="m", input=text, max_output_tokens=1, stream=True)
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.completed", kinds[-3:]
    return f"responses: {kinds[-1]}"


SDKS: dict[str, Callable[[str, str], str]] = {"chat": _chat, "messages": _messages, "responses": _responses}


def _in_thread(name: str, url: str, text: str, out: dict[str, str | BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = SDKS[name](url, text)
        except BaseException as exc:  # what the client raised is the finding
            out[name] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _completed(out: dict[str, str | BaseException], names: list[str]) -> None:
    """Each of ``names`` got its whole stream (each SDK call checks its own end) and raised nothing."""
    for name in names:
        got = out.get(name)
        assert isinstance(got, str), f"{name}: the SDK raised {got!r}"


def test_sdk_streams_held_longer_than_their_read_timeout_complete_also_across_a_kill9_in_the_prefill(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=1, ctx_size=8192, extra_args=["-b", "32", "-ub", "32"])
    side, url = proxied(sidecar, server, slot_dir)

    # Held at the restore gate for twice the read timeout: llama-server is down.
    server.kill()
    side.wait_for(lambda: side.get("/readyz")[0] != 200, timeout=10, what="the gate closed")
    out: dict[str, str | BaseException] = {}
    threads = [_in_thread(name, url, f"Say hello number {n}.", out) for n, name in enumerate(SDKS)]
    side.wait_for(lambda: side.metric("llama_sidecar_proxy_held_requests") == len(SDKS), timeout=30, what="all held")
    time.sleep(HELD)  # the hold itself is the point: longer than the clients' read timeout
    assert not out, f"a client ended while held: {out}"
    server.start()
    for thread in threads:
        thread.join(timeout=300)
    _completed(out, list(SDKS))
    print(f"held {HELD:g} s with a {READ_TIMEOUT:g} s read timeout: {out}")

    # A prefill longer than the read timeout, killed -9 in its middle: replayed, and the stream completes.
    long = make_prompt(server.url, LONG_PROMPT, seed=31)
    out.clear()
    thread = _in_thread("messages", url, long, out)
    side.wait_for(lambda: _processing(server), timeout=60, what="the prefill")
    time.sleep(READ_TIMEOUT + 0.5)  # past the read timeout, well inside a prefill of 3,000 tokens in 32-token batches
    assert _processing(server), "the prefill ended before the kill"
    assert not out, f"the client ended before the kill: {out}"
    server.kill()
    server.start()
    thread.join(timeout=600)
    _completed(out, ["messages"])
    assert side.log_events("proxy_request_replayed"), "the request was sent once more after the kill"


def _processing(server: LlamaServer) -> bool:
    try:
        return bool(slots(server.url)[0]["is_processing"])
    except (OSError, RuntimeError):
        return False


def _send(url: str, body: dict[str, object]) -> socket.socket:
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall((head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    return sock


def _stops(server: LlamaServer) -> list[tuple[int, int]]:
    """(task, tokens in the slot) of every task llama-server stopped, from its own log (no request to it)."""
    return [(int(task), int(tokens)) for task, tokens in STOPPED.findall(server.log_text())]


def _more_stops(server: LlamaServer, than: int) -> bool:
    return len(_stops(server)) > than


def _cancelled(side: SidecarProcess) -> float:
    return side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="cancelled")


def test_a_client_that_leaves_stops_its_prefill_at_once_and_a_held_one_is_never_sent(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=1, ctx_size=8192, extra_args=["-b", "32", "-ub", "32"])
    side, url = proxied(sidecar, server, slot_dir)
    # A conversation served and saved: the cancelled prefills must leave its snapshot as it is.
    first = {"messages": [{"role": "user", "content": make_prompt(server.url, 300, seed=40)}], "max_tokens": 2}
    sock = _send(url, first)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the first turn was answered"
    sock.close()
    side.wait_saved(1)
    saved = manifests(slot_dir)

    figures = []
    for n, stream in enumerate((True, False)):
        prompt = make_prompt(server.url, LONG_PROMPT, seed=41 + n)
        sock = _send(url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": stream})
        side.wait_for(lambda: _processing(server), timeout=60, what="the prefill")
        time.sleep(1.0)  # well inside a prefill of 3,000 tokens in 32-token batches
        stopped = len(_stops(server))
        sock.close()
        left = time.monotonic()
        side.wait_for(functools.partial(_more_stops, server, stopped), timeout=30, what="llama-server to stop the task")
        idle = time.monotonic() - left
        task, tokens = _stops(server)[-1]
        figures.append(f"{'streamed' if stream else 'whole'}: idle {idle:.2f} s after the client left, {tokens} tokens")
        assert tokens < LONG_PROMPT, f"task {task} ran its whole prefill ({tokens} tokens) after its client left"
        assert not _processing(server)
        assert idle < 5.0, figures  # the goal is 1 s; llama-server ends the batch under way first (see the bench)
        assert _cancelled(side) == n + 1
    print("; ".join(figures))

    # Held at the gate, then gone: never sent once llama-server is back.
    server.kill()
    side.wait_for(lambda: side.get("/readyz")[0] != 200, timeout=10, what="the gate closed")
    held = [
        _send(url, {"messages": [{"role": "user", "content": f"Held {n}"}], "max_tokens": 2, "stream": stream})
        for n, stream in enumerate((True, False))
    ]
    side.wait_for(lambda: side.metric("llama_sidecar_proxy_held_requests") == 2, timeout=30, what="both held")
    for sock in held:
        sock.close()
    side.wait_for(lambda: _cancelled(side) == 4, timeout=10, what="the held requests cancelled")
    assert side.metric("llama_sidecar_proxy_held_requests") == 0
    server.start()
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the gate open")
    launched = server.log_text().rpartition("=== llamabed start")[2]
    assert "launch_slot_" not in launched, "a request whose client had left was sent to the new llama-server"

    assert set(saved) <= set(manifests(slot_dir)), f"the saved snapshot was replaced: {saved} -> {manifests(slot_dir)}"
