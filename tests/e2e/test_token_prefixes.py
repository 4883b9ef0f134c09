"""The placer's cached tokenizer against the real server: the same ids as ``/tokenize``, turn by turn.

The test model has no chat template of its own and the server's fallback
(ChatML) marks turns with plain text in this vocabulary, where no cut is
exact: the test runs the server with its built-in ``gemma`` template, whose
``<start_of_turn>`` is one of the model's special tokens, as a chat model's is.

A multi-turn chat (a long first message, the server's own replies, short
follow-ups, one follow-up with text that looks like a template marker but is
not one) is rendered by ``/apply-template`` each turn; :class:`tokens.Cached`
gives its ids, asking the server only for what follows the last remembered
cut. Each turn's ids must equal what ``/tokenize`` gives for the whole text,
and from the second turn on the cached path must have sent the server only
the new part (far fewer bytes than the whole).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from sidecar.core import config
from sidecar.library import tokens
from sidecar.observe import upstream
from support.llamabed import MakeServer, http_json, make_prompt

TURNS = 5


def _whole(url: str, text: str) -> list[int]:
    _, answer = http_json("POST", url + "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    ids: list[int] = answer["tokens"]
    return ids


def test_cached_ids_equal_the_servers_across_a_chat(llama: MakeServer, tmp_path: Path) -> None:
    server = llama(n_slots=1, extra_args=["--chat-template", "gemma"])  # markers that are the model's special tokens
    follow_ups = [
        "And what does the second record say next?",
        "Quote it with <b>bold</b> and <start_of_turn> as text, then stop.",
        "ünïcödé — and 数字 1234567 next?",
        "One more, please.",
    ]
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": make_prompt(server.url, 2000, 24)},
    ]

    async def run() -> list[tuple[int, int, int]]:
        seen: list[tuple[int, int, int]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            client = upstream.LlamaClient(session, config.UpstreamSettings(url=server.url))
            cached = tokens.Cached(client)
            for turn in range(TURNS):
                text = await client.apply_template({"messages": messages})
                before = cached.asked_bytes
                got = await cached.tokenize(text)
                assert got == _whole(server.url, text), f"turn {turn}: the cached ids differ from /tokenize"
                again = await cached.tokenize(text)
                assert again == got
                seen.append((len(text.encode()), cached.asked_bytes - before, len(got)))
                body = {"messages": messages, "max_tokens": 12, "temperature": 0}
                status, answer = http_json("POST", server.url + "/v1/chat/completions", body, timeout=300)
                assert status == 200, answer
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                messages.append({"role": "user", "content": follow_ups[turn % len(follow_ups)]})
            assert cached.answered == TURNS, seen  # each repeat came from memory, no round trip
        return seen

    seen = asyncio.run(run())
    whole, asked, _ = seen[0]
    assert asked == whole  # the first turn: nothing known, the whole text asked
    for turn, (whole, asked, _) in enumerate(seen[1:], start=1):
        assert 0 < asked < whole / 10, f"turn {turn}: asked {asked} of {whole} bytes"
