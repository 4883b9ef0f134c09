"""Coding agents as they really talk, through the proxy to the real server, with the official SDKs.

Four conversations per API (Chat Completions streamed and not, Anthropic
Messages streamed and not, Responses streamed), each a system prompt, a
~400-token first message, a tool call with its result and a follow-up, on 2
slots with ``--cache-ram 0`` (llama-server keeps nothing outside its slots,
standing for conversations too big for its RAM cache, or for a restart).
They take turns, so every return comes after the others took both slots, and
once more after a ``kill -9``: each return must reuse its whole earlier
prompt (99% of it: a conversation that came back after the kill from the
snapshot of the turn before reused 497 of 539 tokens, 92%). Then a
``kill -9`` lands during the prefill of a streamed request of each streamed
API: its client must get a whole answer, no error, reusing its own
conversation's KV.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support import agents
from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt, slots
from tests.support.sidecarbed import MakeSidecar, manifest_records, proxied

PER_API = 4
PROMPT_TOKENS = 400
LONG_TURN_TOKENS = 2500
"""A new turn long enough that its prefill lasts a few seconds: the kill -9 lands in it."""
WARM = 0.99


def _saved(server: LlamaServer, slot_dir: Path) -> bool:
    """Whether each slot's content (as llama-server lists it now) is in an indexed snapshot.

    A slot's content is told by its last task, not by its length alone: two
    conversations served one after the other on a slot often have the same
    number of tokens, and the earlier one's snapshot would pass for the later.
    """
    kept = set()
    for record in manifest_records(slot_dir):
        if record.get("index") and record.get("task") is not None:
            kept.add((int(record["slot"]), int(record["task"]), int(record["index"]["tokens"])))
    return all(
        (int(s["id"]), int(s["id_task"]), int(s["n_prompt_tokens"])) in kept
        for s in slots(server.url)
        if s.get("n_prompt_tokens")
    )


def _send(api: agents.Api, chat: agents.Conversation, replies: list[agents.Reply | BaseException]) -> None:
    """One turn in a thread of its own; the reply, or what the client raised (the failure is the finding)."""
    try:
        replies.append(api.send(chat))
    except BaseException as exc:
        replies.append(exc)


def _round(pairs: list[tuple[agents.Api, agents.Conversation]], label: str, *, warm: bool) -> None:
    started = time.monotonic()
    figures: dict[str, list[str]] = {}
    for api, chat in pairs:
        earlier = chat.prompt
        reply = api.send(chat)
        assert reply.complete, f"{label}: {api.name} conversation {chat.n} got no whole answer"
        figures.setdefault(api.name, []).append(f"{reply.cached}/{earlier}")
        if warm:
            assert reply.cached >= WARM * earlier, (
                f"{label}: {api.name} conversation {chat.n} reused {reply.cached} of its earlier {earlier} "
                f"tokens (header {reply.header!r})"
            )
        chat.answered(reply, f"And what does record {chat.n} say after turn {chat.turns + 1}?")
    print(f"{label} ({time.monotonic() - started:.1f} s): reused/earlier prompt: {figures}")


@pytest.mark.timeout(900)
def test_agents_of_every_api_come_back_warm_on_two_slots_and_through_a_kill9_during_a_streamed_prefill(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192, extra_args=["--cache-ram", "0"])
    side, url = proxied(sidecar, server, slot_dir, {"--server-cache-ram-bytes": "0"})
    apis = agents.every_api(url)
    pairs = [
        (api, agents.Conversation.start(10 * a + n, make_prompt(server.url, PROMPT_TOKENS, seed=500 + 10 * a + n)))
        for a, api in enumerate(apis)
        for n in range(PER_API)
    ]
    _round(pairs, "first turns (cold)", warm=False)
    for turn in (2, 3):
        _round(pairs, f"turn {turn}", warm=True)
    assert side.metric("llama_sidecar_conversation_unrouted_total") == 0
    assert side.metric("llama_sidecar_conversation_requests_total", source="library") >= 2 * (len(pairs) - 2)

    side.wait_for(lambda: _saved(server, slot_dir), timeout=60, what="both slots' content saved")
    server.kill()
    server.start()
    server.wait_healthy()
    _round(pairs, "after kill -9", warm=True)

    for api, chat in [(api, chat) for api, chat in pairs if api.stream][::PER_API]:
        side.wait_for(lambda: _saved(server, slot_dir), timeout=60, what="both slots' content saved")
        earlier = chat.prompt
        chat.history[-1]["text"] += " " + make_prompt(server.url, LONG_TURN_TOKENS, seed=900 + chat.n)
        replies: list[agents.Reply | BaseException] = []
        client = threading.Thread(target=_send, args=(api, chat, replies))
        client.start()
        side.wait_for(lambda: any(s["is_processing"] for s in slots(server.url)), timeout=30, what="the prefill")
        time.sleep(0.5)  # well inside a prefill of thousands of tokens, long before its first token
        assert any(s["is_processing"] for s in slots(server.url)), "the prefill ended before the kill"
        server.kill()
        server.start()
        server.wait_healthy()
        client.join(timeout=300)
        assert replies, f"{api.name}: no answer"
        reply = replies[0]
        assert not isinstance(reply, BaseException), f"{api.name}: the client saw {reply!r}"
        print(f"kill -9 in the prefill, {api.name}: reused {reply.cached} of its earlier {earlier} ({reply.header})")
        assert reply.complete
        assert reply.cached >= WARM * earlier, f"{api.name}: the replay did not reuse its own conversation's KV"
        chat.answered(reply, "Thanks.")
    replayed = side.log_events("proxy_request_replayed")
    assert len(replayed) >= 3
    status, _ = http_json("GET", url + "/health")
    assert status == 200


def _header(reply: agents.Reply) -> dict[str, str]:
    return dict(part.strip().split("=", 1) for part in reply.header.split(";"))


@pytest.mark.timeout(600)
def test_metrics_and_status_agree_with_each_answers_own_reuse_in_a_mixed_run(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096, extra_args=["--cache-ram", "0"])
    side, url = proxied(sidecar, server, slot_dir, {"--server-cache-ram-bytes": "0"})
    # One conversation of each API and mode, streamed or not: each answer's own reuse figure is read from
    # its own place (usage of the last event, message_delta, response.completed) by the client and the relay.
    pairs = [
        (api, agents.Conversation.start(n, make_prompt(server.url, PROMPT_TOKENS, seed=700 + n)))
        for n, api in enumerate(agents.every_api(url))
    ]
    seen: list[tuple[agents.Reply, int]] = []
    for turn in range(3):
        for api, chat in pairs:
            earlier = chat.prompt
            reply = api.send(chat)
            seen.append((reply, earlier))
            chat.answered(reply, f"And then, after turn {turn + 1}?")
            # A client straight to llama-server, beside the proxy: it takes whichever slot llama-server gives it.
            status, _ = http_json(
                "POST", server.url + "/completion", {"prompt": make_prompt(server.url, 300, seed=800 + turn),
                                                     "n_predict": 2}, timeout=300,
            )  # fmt: skip
            assert status == 200
    by_source: dict[str, int] = {"slot": 0, "library": 0, "shared": 0, "cold": 0}
    library_tokens = 0
    saved_tokens = 0
    for reply, earlier in seen:
        head = _header(reply)
        source, restored = head["source"], int(head["restored_tokens"])
        if source != "cold" and reply.cached < 0.5 * earlier:
            source = "cold"  # placed on a prefix the server then re-prefilled
        by_source[source] += 1
        if source == "library":
            library_tokens += min(restored, reply.cached)
        if restored and reply.cached >= 0.5 * restored:
            saved_tokens += min(restored, reply.cached)
    print(f"per request: {by_source}, library tokens {library_tokens}; figures {[(r.cached, e) for r, e in seen]}")
    assert by_source["library"] >= 4, "the run swapped conversations in"
    for source, count in by_source.items():
        assert side.metric("llama_sidecar_conversation_requests_total", source=source) == count, source
    assert side.metric("llama_sidecar_library_tokens_total") == library_tokens
    assert side.metric("llama_sidecar_conversation_unserved_total") == 0
    saved = side.status()["time_saved"]
    assert saved["tokens"] + saved["unpriced_tokens"] == saved_tokens
    assert side.metric("llama_sidecar_prefill_saved_tokens_total") == saved["tokens"]
