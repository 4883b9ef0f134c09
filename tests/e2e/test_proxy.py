"""The proxy (--proxy-listen) in front of a real llama-server: restarts, streaming, slot actions."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt, slots
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 2000
ADMIN = "admin-7c1d0e5b-e2e"


def _with_proxy(sidecar: MakeSidecar, server: LlamaServer, slot_dir: Path, **extra: str) -> tuple[SidecarProcess, str]:
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}", **extra})
    url = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: _reachable(url), timeout=20, what="the proxy to answer /health")
    return side, url


def _reachable(url: str) -> bool:
    try:
        return http_json("GET", url + "/health", timeout=2)[0] == 200
    except OSError:
        return False


class Agent:
    """A client that sends one turn and retries every 0.1 s until it gets an answer, noting every failure."""

    def __init__(self, url: str, prompt: str) -> None:
        self.url, self.prompt = url, prompt
        self.failures: list[str] = []
        self.turns = 0

    def turn(self, n_predict: int = 8, deadline: float = 300.0) -> dict[str, Any]:
        body = {"prompt": self.prompt, "n_predict": n_predict, "cache_prompt": True, "temperature": 0}
        give_up = time.monotonic() + deadline
        while time.monotonic() < give_up:
            try:
                status, answer = http_json("POST", self.url + "/completion", body, timeout=300)
            except OSError as exc:
                self.failures.append(repr(exc))
            else:
                if status == 200:
                    self.turns += 1
                    result: dict[str, Any] = answer
                    return result
                self.failures.append(f"HTTP {status}: {answer!r}"[:300])
            time.sleep(0.1)
        raise AssertionError(f"no answer within {deadline} s; failures: {self.failures}")

    def turn_in_thread(self, **kw: Any) -> tuple[threading.Thread, list[dict[str, Any]]]:
        out: list[dict[str, Any]] = []
        thread = threading.Thread(target=lambda: out.append(self.turn(**kw)), name="agent", daemon=True)
        thread.start()
        return thread, out


def _saves(side: SidecarProcess) -> float:
    return side.metric("llama_sidecar_snapshots_total", slot="0", result="ok")


def _processing(server: LlamaServer) -> bool:
    try:
        return bool(slots(server.url)[0]["is_processing"])
    except (OSError, RuntimeError):
        return False


def test_agent_retrying_through_three_kill9_restarts_always_reuses_its_kv_and_never_fails(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side, proxy = _with_proxy(sidecar, server, slot_dir)
    agent = Agent(proxy, make_prompt(server.url, PROMPT_TOKENS, seed=91))
    cold = agent.turn()
    n_prompt = cold["timings"]["prompt_n"]
    assert n_prompt >= PROMPT_TOKENS * 0.95
    side.wait_for(lambda: _saves(side) >= 1, what="first snapshot")

    first_answers: list[dict[str, Any]] = []
    for cycle, how in enumerate(("while idle", "mid-request", "and the agent races the restore")):
        saved = _saves(side)
        holds = side.metric("llama_sidecar_proxy_hold_seconds_count")
        if how == "mid-request":
            thread, out = agent.turn_in_thread(n_predict=256)
            side.wait_for(lambda: _processing(server), timeout=30, what="the agent's request running")
            server.kill()
            server.start()
        elif how == "while idle":
            server.kill()
            thread, out = agent.turn_in_thread()
            side.wait_for(
                lambda: side.metric("llama_sidecar_proxy_held_requests") >= 1, what="the agent held at the gate"
            )
            code, body = side.get("/readyz")
            assert code == 503, body
            assert "restore gate closed" in body
            server.start()
        else:
            server.kill()
            server.start()
            server.wait_healthy()  # the new process answers; the sidecar may not have polled it yet
            thread, out = agent.turn_in_thread()
        thread.join(300)
        assert out, f"cycle {cycle}: the agent got no answer"
        first_answers.append(out[0])
        reused = out[0]["timings"]["cache_n"]
        held = side.metric("llama_sidecar_proxy_hold_seconds_count") - holds
        print(f"restart {cycle + 1} ({how}): first answer cache_n={reused} of {n_prompt}; held at the gate: {held > 0}")
        if how != "and the agent races the restore":  # there the restore may be over before the request comes
            assert held >= 1, f"restart {cycle + 1} ({how}): the request was not held at the gate"
        assert reused >= 0.95 * n_prompt, f"restart {cycle + 1} ({how}): cache_n {reused} of {n_prompt}"
        side.wait_for(  # counted once the answer showed the server reused it (a sliding-window model)
            lambda: side.metric("llama_sidecar_restores_total", slot="0", result="ok") == cycle + 1,  # noqa: B023
            what=f"restore {cycle + 1} counted ok",
        )
        side.wait_for(lambda: _saves(side) > saved, what=f"snapshot after restart {cycle + 1}")  # noqa: B023

    assert agent.failures == [], agent.failures
    assert side.metric("llama_sidecar_server_restarts_total") == 3
    assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="ok") == agent.turns
    for outcome in ("error", "held_timeout", "cancelled"):
        assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome=outcome) == 0
    assert side.get("/readyz")[0] == 200
    assert side.log_events("proxy_request_replayed"), "the request cut by the kill was not replayed"
    # One line per outage at most, never one per connection the restarting server drops. A kill that comes within
    # a second or two of the last restart may find the sentinel between two connections (its backoff after the
    # refusals of that restart): the relay's lost connection or the poller sees that one, and the restart is counted.
    dropped = side.log_events("server_connection_dropped")
    assert 1 <= len(dropped) <= 3, f"{len(dropped)} server_connection_dropped lines for 3 kills: {dropped}"


def test_a_restart_between_two_polls_is_seen_before_the_next_completion(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """kill -9 and a new process up and healthy with no request in flight and no poll due (the sidecar
    polls every 600 s, and once at its start): the first completion through the proxy still waits for
    the restore and reuses its KV."""
    server = llama(slot_dir=slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=92)
    n_prompt = Agent(server.url, prompt).turn()["timings"]["prompt_n"]
    side, proxy = _with_proxy(sidecar, server, slot_dir, **{"--poll-interval": "600", "--idle-seconds": "0"})
    side.wait_for(lambda: _saves(side) >= 1, timeout=60, what="the snapshot taken at the sidecar's first poll")
    server.kill()
    server.start()
    server.wait_healthy()
    agent = Agent(proxy, prompt)
    reused = agent.turn()["timings"]["cache_n"]
    print(f"first answer after the restart: cache_n={reused} of {n_prompt}")
    assert reused >= 0.95 * n_prompt, f"cache_n {reused} of {n_prompt}: the completion beat the restore"
    dropped = side.log_events("server_connection_dropped")
    assert len(dropped) == 1, f"one kill -9, {len(dropped)} server_connection_dropped lines: {dropped}"
    assert len(side.log_events("slot_restored")) == 1
    # a sliding-window model's restore is counted once the slot's next request decides: here the proxied
    # answer's own cache_n, with no poll due (polls are 600 s apart)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 1, what="the restore counted ok"
    )
    assert [r["result"] for r in side.status()["last_restore"]] == ["ok"]
    assert side.metric("llama_sidecar_restores_total", slot="0") == 1
    assert agent.failures == [], agent.failures


def test_a_chat_held_across_a_kill9_has_its_ids_read_while_the_slots_are_restored(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """A routed chat turn sent right after a kill -9 waits at the gate through the server's load and the
    restore round; its token ids (no slot's business) are read while the round runs, so its placement does
    not ask for them after the gate opens; and it still runs only after its slot's restore."""
    server = llama(slot_dir=slot_dir)
    side, proxy = _with_proxy(sidecar, server, slot_dir, **{"--idle-seconds": "0.2"})
    messages: list[dict[str, str]] = [{"role": "user", "content": make_prompt(server.url, PROMPT_TOKENS, seed=93)}]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    status, answer = http_json("POST", proxy + "/v1/chat/completions", body, timeout=300)
    assert status == 200, answer
    side.wait_for(lambda: _saves(side) >= 1, timeout=60, what="the conversation's snapshot")
    made = answer["usage"]["prompt_tokens"]
    seen = len(side.log_events("restore_gate_open"))
    server.kill()
    server.start()  # not waited for: the turn below is held while the server loads
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And in one word?"}]
    status, answer = http_json("POST", proxy + "/v1/chat/completions", body, timeout=300)
    assert status == 200, answer
    reused = answer["timings"]["cache_n"]
    opened = side.log_events("restore_gate_open")[seen:]
    print(f"held turn: cache_n {reused} of a {made}-token snapshot; gate opened: {opened}")
    assert reused >= 0.95 * made, f"cache_n {reused} of {made}: the held turn beat the restore"
    assert len(side.log_events("slot_restored")) == 1
    assert [e.get("waiting") for e in opened] == [1], opened  # the turn waited for the round
    assert [e.get("prepared") for e in opened] == [1], opened  # its ids were read before the gate opened


async def _stream(url: str, prompt: str, n_predict: int) -> tuple[list[float], list[str], int, dict[str, Any]]:
    """POST a streamed /completion; return each token event's arrival time, the tokens, the reads and the
    final event's ``timings`` (the server's own figures for this generation)."""
    # No prompt cache: both runs prefill the same way, so greedy sampling gives the same tokens.
    body = {"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0, "cache_prompt": False}
    arrivals: list[float] = []
    tokens: list[str] = []
    timings: dict[str, Any] = {}
    reads = 0
    buffer = b""
    async with aiohttp.ClientSession() as session, session.post(url + "/completion", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in resp.content.iter_any():
            reads += 1
            now = time.monotonic()
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if event.startswith(b":"):
                    continue  # a keep-alive (SSE comment) the proxy sends before the first event
                data = json.loads(event.removeprefix(b"data: "))
                if data.get("content"):
                    arrivals.append(now)
                    tokens.append(data["content"])
                if data.get("stop"):
                    timings = data["timings"]
    assert timings, "the stream ended without its final event"
    return arrivals, tokens, reads, timings


async def test_streaming_through_the_proxy_arrives_token_by_token(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    _, proxy = _with_proxy(sidecar, server, slot_dir)
    prompt = "Write a long story about a river and a stone:"
    _, direct_tokens, _, _ = await _stream(server.url, prompt, 48)
    via, via_tokens, reads, timings = await _stream(proxy, prompt, 48)
    assert len(via_tokens) >= 32
    assert via_tokens == direct_tokens, "the proxy changed the stream"
    assert reads >= len(via_tokens) * 0.8, f"{reads} reads for {len(via_tokens)} tokens: events were batched"
    # One run's own figures: the server spent predicted_ms generating the tokens, one after the other, so
    # the first and last token events leave it (n-1)/n of that apart; the proxy must not gather them.
    generating = timings["predicted_ms"] / 1000 * (timings["predicted_n"] - 1) / timings["predicted_n"]
    spread_via = via[-1] - via[0]
    print(
        f"token events spread over {spread_via:.3f} s via the proxy; the server generated them over "
        f"{generating:.3f} s; {reads} reads"
    )
    assert spread_via >= 0.5 * generating, "the tokens arrived all at once: the proxy buffered the stream"


def test_client_slot_actions_are_refused_and_the_snapshot_stays_intact(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side, proxy = _with_proxy(sidecar, server, slot_dir, **{"--admin-token": ADMIN})
    agent = Agent(proxy, make_prompt(server.url, PROMPT_TOKENS, seed=92))
    cold = agent.turn()
    side.wait_for(lambda: _saves(side) >= 1, what="snapshot")
    manifest = json.loads(next(slot_dir.glob("slot*.json")).read_text())
    snapshot = slot_dir / manifest["file"]
    before = hashlib.sha256(snapshot.read_bytes()).hexdigest()
    tokens_before = slots(server.url)[0]["n_prompt_tokens"]

    for action, body in (
        ("erase", None),
        ("save", {"filename": manifest["file"]}),
        ("restore", {"filename": manifest["file"]}),
    ):
        code, answer = http_json("POST", f"{proxy}/slots/0?action={action}", body)
        assert code == 403, (action, answer)
        assert "reserved to llama-kv-sidecar" in answer["error"]["message"]

    assert hashlib.sha256(snapshot.read_bytes()).hexdigest() == before
    assert slots(server.url)[0]["n_prompt_tokens"] == tokens_before, "a refused erase reached the server"
    assert side.metric("llama_sidecar_proxy_requests_total", route="other", outcome="refused") == 3
    again = agent.turn()
    assert again["timings"]["cache_n"] >= 0.95 * cold["timings"]["prompt_n"]
    assert side.metric("llama_sidecar_snapshots_quarantined_total", reason="checksum") == 0

    code, answer = http_json("POST", f"{proxy}/slots/0?action=erase", None, api_key=ADMIN)
    assert code == 200, answer
    assert answer["n_erased"] > 0, "the admin token passes a slot action through"
