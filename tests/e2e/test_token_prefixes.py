"""The placer's cached tokenizer against the real server: the same ids as ``/tokenize``, turn by turn.

A multi-turn chat (a long first message, the server's own replies, short
follow-ups, one follow-up with text that looks like a template marker but is
not one) is rendered by ``/apply-template`` each turn; :class:`tokens.Cached`
gives its ids, asking the server only for what follows the last remembered
cut. Each turn's ids must equal what ``/tokenize`` gives for the whole text.

Two servers, two outcomes:

* the test model with Gemma 3's own chat template, whose
  ``<start_of_turn>`` is one of the model's special tokens (as a chat
  model's markers are): from the second turn on only the new part is sent,
  under a tenth of the text's bytes;
* the tiny ``qwen35`` hybrid with its own ChatML template: this vocabulary
  (the test model's) has no ``<|im_start|>`` token, so the markers are plain
  text, no cut is exact, and every new turn must be asked whole, until a
  message quotes ``<start_of_turn>``: the server parses it as the special
  token it is in this vocabulary (in a message's content too), and the later
  turns are cut there.

Through the proxy, each API it routes (Chat Completions, Anthropic Messages,
Responses, ``/completion``) takes three turns of two conversations that take
turns on that Gemma 3 server's one slot (so every turn is routed by its ids):
every answer is whole, and from each conversation's second turn on the
sidecar's ``library_prompt_bytes_total`` shows over nine tenths of the
prompt bytes remembered, none asked again.

And a text that starts with a remembered cut but goes on with other bytes
there (the same prefix up to ``the``, then ``ory`` where the special token
was) must be asked whole: joined at the cut its ids differ from the server's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from sidecar.core import config
from sidecar.library import tokens
from sidecar.observe import upstream
from tests.support import tinymodels
from tests.support.llamabed import LlamaServer, MakeServer, gemma3_template, http_json, make_prompt
from tests.support.sidecarbed import MakeSidecar, proxied

TURNS = 5
FOLLOW_UPS = [
    "And what does the second record say next?",
    "Quote it with <b>bold</b> and <start_of_turn> and <|im_start|> as text, then stop.",
    "ünïcödé — and 数字 1234567 next?",
    "One more, please.",
]


def _whole(url: str, text: str, *, parse_special: bool = True, add_special: bool = True) -> list[int]:
    body = {"content": text, "add_special": add_special, "parse_special": parse_special}
    status, answer = http_json("POST", url + "/tokenize", body)
    assert status == 200, answer
    ids: list[int] = answer["tokens"]
    return ids


def _special(url: str, marker: str) -> bool:
    """Whether the server takes ``marker`` for one special token (parsed, it is one id other than plain)."""
    parsed = _whole(url, marker, add_special=False)
    return len(parsed) == 1 and parsed != _whole(url, marker, add_special=False, parse_special=False)


async def _chat(server: LlamaServer) -> tuple[tokens.Cached, list[tuple[int, int]]]:
    """Each turn's (text bytes, bytes asked of /tokenize); every turn's ids checked against /tokenize."""
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": make_prompt(server.url, 2000, 24)},
    ]
    seen: list[tuple[int, int]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        client = upstream.LlamaClient(session, config.UpstreamSettings(url=server.url))
        cached = tokens.Cached(client.prompts)
        for turn in range(TURNS):
            text = await client.prompts.apply_template({"messages": messages})
            before = cached.asked_bytes
            got = await cached.tokenize(text)
            assert got == _whole(server.url, text), f"turn {turn}: the cached ids differ from /tokenize"
            asked = cached.asked_bytes - before
            assert await cached.tokenize(text) == got  # a retry: from memory
            assert cached.asked_bytes - before == asked
            seen.append((len(text.encode()), asked))
            body = {"messages": messages, "max_tokens": 12, "temperature": 0}
            status, answer = http_json("POST", server.url + "/v1/chat/completions", body, timeout=300)
            assert status == 200, answer
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
    assert cached.answered == TURNS, seen
    assert cached.refused == 0, seen
    return cached, seen


def test_cut_at_special_tokens_asks_only_the_new_part(llama: MakeServer, tmp_path: Path) -> None:
    server = llama(n_slots=1, extra_args=gemma3_template(tmp_path))
    assert _special(server.url, "<start_of_turn>")
    _, seen = asyncio.run(_chat(server))
    assert seen[0][0] > 8000  # the whole rendered chat (about 2,000 tokens)
    print("gemma template, (text bytes, asked bytes) per turn:", seen)
    whole, asked = seen[0]
    assert asked == whole  # the first turn: nothing known, the whole text asked
    for turn, (whole, asked) in enumerate(seen[1:], start=1):
        assert 0 < asked < whole / 10, f"turn {turn}: asked {asked} of {whole} bytes"


def test_plain_text_markers_are_asked_whole(llama: MakeServer, tiny_models: dict[tinymodels.Arch, Path]) -> None:
    server = llama(n_slots=1, model=tiny_models[tinymodels.Arch.QWEN35], ctx_size=8192, swa_full=False)
    assert not _special(server.url, "<|im_start|>")  # ChatML's marker is no token of this vocabulary
    _, seen = asyncio.run(_chat(server))
    print("qwen35 ChatML, (text bytes, asked bytes) per turn:", seen)
    quoted = 2  # the first turn whose text holds the follow-up quoting <start_of_turn>
    assert all(asked == whole for whole, asked in seen[: quoted + 1]), seen  # no cut could be sure: each whole
    # The quoted <start_of_turn> is a special token of this vocabulary: llama-server parses it in a message's
    # content too, so the cut there is exact, and the later turns ask only what follows it.
    assert all(0 < asked < whole for whole, asked in seen[quoted + 1 :]), seen


@pytest.mark.parametrize("rest", ["ory of the archive, continued", "se<start_of_turn>model\n"])
def test_a_cut_the_next_text_does_not_go_on_from_is_not_trusted(llama: MakeServer, rest: str) -> None:
    server = llama(n_slots=1)
    head = make_prompt(server.url, 600, 3) + " the"
    first, second = head + "<start_of_turn>model\n", head + rest
    marker = _whole(server.url, "<start_of_turn>", add_special=False)
    ids = _whole(server.url, first)
    at = len(ids) - 1 - ids[::-1].index(marker[0])
    joined = ids[:at] + _whole(server.url, second[len(head) :], add_special=False)
    assert joined != _whole(server.url, second)  # trusting the cut would give other ids than the server's

    async def run() -> tuple[list[int], int, tokens.Cached]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            cached = tokens.Cached(upstream.LlamaClient(session, config.UpstreamSettings(url=server.url)).prompts)
            await cached.tokenize(first)
            before = cached.asked_bytes
            got = await cached.tokenize(second)
            return got, cached.asked_bytes - before, cached

    got, asked, cached = asyncio.run(run())
    assert got == _whole(server.url, second)
    assert asked == len(second.encode())  # asked whole
    assert cached.refused == 0  # turned down from the bytes, before a round trip


REPLY = "The record lists a river, a stone and a market."


def _turns(path: str, first: str, turns: int) -> list[dict[str, object]]:
    """The bodies of ``turns`` turns of one conversation on the route ``path`` (replies as fixed text)."""
    asked = [first] + [f"And what does record {n} say?" for n in range(1, turns)]
    bodies: list[dict[str, object]] = []
    for n in range(1, turns + 1):
        said = asked[:n]
        if path == "/v1/chat/completions":
            messages: list[dict[str, object]] = [{"role": "system", "content": "Answer in one sentence."}]
            for k, text in enumerate(said):
                messages += [{"role": "assistant", "content": REPLY}] if k else []
                messages.append({"role": "user", "content": text})
            bodies.append({"messages": messages, "max_tokens": 4, "temperature": 0})
        elif path == "/v1/messages":
            turns_ = []
            for k, text in enumerate(said):
                turns_ += [{"role": "assistant", "content": REPLY}] if k else []
                turns_.append({"role": "user", "content": text})
            bodies.append({"model": "m", "system": "Answer in one sentence.", "messages": turns_, "max_tokens": 4})
        elif path == "/v1/responses":
            items: list[dict[str, object]] = []
            for k, text in enumerate(said):
                if k:
                    items.append({"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": REPLY}]})  # fmt: skip
                items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
            bodies.append({"model": "m", "input": items, "max_output_tokens": 4})
        else:
            prompt = "".join(
                ("" if k == 0 else f"{REPLY}<end_of_turn>\n")
                + f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
                for k, text in enumerate(said)
            )
            bodies.append({"prompt": prompt, "n_predict": 4, "temperature": 0})
    return bodies


@pytest.mark.timeout(600)
def test_every_routed_api_asks_only_the_new_part_through_the_proxy(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    # Without llama-server's RAM prompt cache: with it, a conversation that left the slot for it comes back
    # needing no ids at all (test_library_ram.py), and the token cache is for the turns that do need them.
    server = llama(slot_dir=slot_dir, n_slots=1, extra_args=[*gemma3_template(tmp_path), "--cache-ram", "0"])
    side, proxy = proxied(sidecar, server, slot_dir, {"--server-cache-ram-bytes": "0"})
    name = "llama_sidecar_library_prompt_bytes_total"
    shares: dict[str, list[float]] = {}
    for seed, path in enumerate(["/v1/chat/completions", "/v1/messages", "/v1/responses", "/completion"]):
        # Two conversations take turns on the one slot: a turn never continues the slot's last one, so each
        # is routed by its ids (a slot's own next turn needs none: test_next_turns.py).
        talks = [_turns(path, make_prompt(server.url, 600, 40 + 2 * seed + k), 3) for k in range(2)]
        for turn in range(3):
            for bodies in talks:
                asked, remembered = side.metric(name, source="asked"), side.metric(name, source="remembered")
                status, answer = http_json("POST", proxy + path, bodies[turn], timeout=300)
                assert status == 200, (path, turn, answer)
                asked = side.metric(name, source="asked") - asked
                remembered = side.metric(name, source="remembered") - remembered
                assert asked + remembered > 2000, (path, turn, asked, remembered)  # this turn's prompt was tokenized
                shares.setdefault(path, []).append(remembered / (asked + remembered))
    assert side.metric("llama_sidecar_library_routes_total", by="turn") == 0
    print("remembered share of the prompt bytes per turn:", shares)
    for path, share in shares.items():
        assert share[:2] == [0.0, 0.0], (path, share)  # new conversations: the whole text asked
        assert all(s > 0.9 for s in share[2:]), (path, share)


@pytest.mark.timeout(600)
def test_a_restart_of_the_same_model_keeps_the_ids_and_another_model_forgets_them(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path, tiny_models: dict[tinymodels.Arch, Path]
) -> None:
    """After a kill -9 the first turn through the proxy asks only its new part, as before the crash, when the
    server comes back with the same model file and build; with another model file it is asked whole."""
    server = llama(slot_dir=slot_dir, n_slots=1, extra_args=gemma3_template(tmp_path))
    side, proxy = proxied(sidecar, server, slot_dir)
    name = "llama_sidecar_library_prompt_bytes_total"
    bodies = _turns("/v1/chat/completions", make_prompt(server.url, 600, 60), 4)

    def remembered_share(body: dict[str, object]) -> float:
        asked, remembered = side.metric(name, source="asked"), side.metric(name, source="remembered")
        status, answer = http_json("POST", proxy + "/v1/chat/completions", body, timeout=300)
        assert status == 200, answer
        asked = side.metric(name, source="asked") - asked
        remembered = side.metric(name, source="remembered") - remembered
        assert asked + remembered > 2000, (asked, remembered)  # this turn's prompt was tokenized
        return remembered / (asked + remembered)

    def crash(model: Path | None = None) -> None:
        restarts = side.metric("llama_sidecar_server_restarts_total")
        server.kill()
        if model is not None:
            server.model, server.swa_full = model, False
        server.start()
        server.wait_healthy(timeout=300)
        side.wait_for(
            lambda: side.metric("llama_sidecar_server_restarts_total") > restarts and side.get("/readyz")[0] == 200,
            timeout=60,
            what="the restart seen and the restore gate open",
        )

    shares = [remembered_share(bodies[0])]
    turns = side.metric("llama_sidecar_library_routes_total", by="turn")
    status, _ = http_json("POST", proxy + "/v1/chat/completions", bodies[1], timeout=300)
    assert status == 200
    assert side.metric("llama_sidecar_library_routes_total", by="turn") == turns + 1  # its slot's next turn: no ids
    crash()
    shares.append(remembered_share(bodies[2]))  # the same model file and build: the ids kept
    crash(tiny_models[tinymodels.Arch.QWEN35])
    shares.append(remembered_share(bodies[3]))  # another model file: asked whole
    print("remembered share of the prompt bytes of turns 1, 3 and 4 (crash after the 2nd and the 3rd):", shares)
    assert shares[0] == 0.0, shares
    assert shares[1] > 0.9, shares
    assert shares[2] == 0.0, shares
