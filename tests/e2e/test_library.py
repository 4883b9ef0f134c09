"""The conversation library against the real server: six chat conversations taking turns on two slots.

Each conversation is a system prompt, a 600-token user message and short
follow-ups, sent through the proxy to ``/v1/chat/completions``. With
``--cache-ram 0`` llama-server keeps nothing outside its two slots, so a
conversation that comes back warm was swapped in from the library; after a
``kill -9`` every one of the six comes back from disk on demand.
"""

from __future__ import annotations

import time
from pathlib import Path

from sidecar.snapshots import slotfile
from tests.support.llamabed import LlamaServer, MakeServer, complete, http_json, make_prompt
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifest_records

CONVERSATIONS = 6
PROMPT_TOKENS = 600
WARM = 0.9
"""Share of a conversation's earlier prompt its next turn must find cached."""


class Chat:
    def __init__(self, n: int, text: str) -> None:
        self.n = n
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": text},
        ]
        self.prompt_tokens = 0
        """Prompt tokens of the last turn."""

    def turn(self, url: str) -> tuple[int, int]:
        """Send the conversation; returns (cache_n, the earlier turn's prompt tokens)."""
        body = {"messages": self.messages, "max_tokens": 2, "temperature": 0}
        status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
        assert status == 200, answer
        earlier = self.prompt_tokens
        self.prompt_tokens = answer["usage"]["prompt_tokens"]
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"And what does record {self.n} say next?"})
        return int(answer["timings"]["cache_n"]), earlier

    def chain(self, server: str) -> tuple[str, ...]:
        """The hash chain of the conversation up to its last prompt (for the test's own wait)."""
        _, templated = http_json("POST", server + "/apply-template", {"messages": self.messages[:-1]})
        _, ids = http_json(
            "POST", server + "/tokenize", {"content": templated["prompt"], "add_special": True, "parse_special": True}
        )
        return slotfile.prefix_hashes(slotfile.pack_ids(ids["tokens"][: self.prompt_tokens]))


def _library(slot_dir: Path) -> list[tuple[tuple[str, ...], int]]:
    """(chain, tokens) of every indexed snapshot in the slot dir."""
    found = []
    for record in manifest_records(slot_dir):
        index = record.get("index")
        if index:
            found.append((tuple(index["chain"]), int(index["tokens"])))
    return found


def _all_kept(chats: list[Chat], chains: list[tuple[str, ...]], slot_dir: Path) -> bool:
    """Whether the library holds every conversation with all of its last prompt."""
    kept = _library(slot_dir)
    return all(
        any(slotfile.shared_blocks(want, have) >= len(want) and tokens >= chat.prompt_tokens for have, tokens in kept)
        for chat, want in zip(chats, chains, strict=True)
    )


def _round(chats: list[Chat], url: str, label: str) -> list[tuple[int, int]]:
    started = time.monotonic()
    figures = [chat.turn(url) for chat in chats]
    print(
        f"{label}: cache_n / earlier prompt = " + ", ".join(f"{c}/{e}" for c, e in figures),
        f"({time.monotonic() - started:.1f} s)",
    )
    return figures


def _sources(side: SidecarProcess) -> dict[str, float]:
    return {s: side.metric("llama_sidecar_conversation_requests_total", source=s) for s in ("slot", "library", "cold")}


def test_six_conversations_on_two_slots_come_back_warm_as_they_take_turns_and_after_kill9(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server: LlamaServer = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096, extra_args=["--cache-ram", "0"])
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}", "--server-cache-ram-bytes": "0"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=300 + n)) for n in range(CONVERSATIONS)]

    for cache_n, _ in _round(chats, proxy, "first turns (cold)"):
        assert cache_n < 0.1 * PROMPT_TOKENS  # the shared system prompt at most
    for again in (1, 2):
        for chat, (cache_n, earlier) in zip(chats, _round(chats, proxy, f"round {again} (no restart)"), strict=True):
            assert cache_n >= WARM * earlier, f"round {again}: conversation {chat.n} came back cold"
    sources = _sources(side)
    print(f"sources: {sources}; swap seconds: {side.metric('llama_sidecar_swap_duration_seconds_sum'):.3f} "
          f"over {side.metric('llama_sidecar_swap_duration_seconds_count'):.0f} swaps")  # fmt: skip
    assert sources["library"] >= 2 * (CONVERSATIONS - 2)
    assert side.metric("llama_sidecar_conversation_unrouted_total", reason="swap") == 0

    chains = [chat.chain(server.url) for chat in chats]
    side.wait_for(lambda: _all_kept(chats, chains, slot_dir), timeout=60, what="every conversation in the library")
    server.kill()
    server.start()
    server.wait_healthy()
    for chat, (cache_n, earlier) in zip(chats, _round(chats, proxy, "after kill -9"), strict=True):
        assert cache_n >= WARM * earlier, f"after kill -9: conversation {chat.n} came back cold"
    assert side.metric("llama_sidecar_conversation_unrouted_total", reason="tokenize") == 0
    assert side.metric("llama_sidecar_library_conversations") >= CONVERSATIONS
    assert side.metric("llama_sidecar_library_tokens_total") >= CONVERSATIONS * PROMPT_TOKENS * 0.8


def test_a_turn_sent_straight_to_the_server_is_saved_before_a_new_conversation_takes_its_slot(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """A turn the sidecar never saw (between two polls, 120 s apart) is saved before the proxy gives its slot away.

    One slot, so the new conversation must take it; the poll interval is longer than the test, so
    the only view of the direct turn is the one the placer reads right before placing.
    """
    server: LlamaServer = llama(slot_dir=slot_dir, n_slots=1, ctx_size=4096, extra_args=["--cache-ram", "0"])
    port = free_port()
    side = sidecar(
        server,
        slot_dir,
        extra={"--proxy-listen": f"127.0.0.1:{port}", "--poll-interval": "120", "--server-cache-ram-bytes": "0"},
    )
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")

    direct = make_prompt(server.url, PROMPT_TOKENS, seed=401)
    first = complete(server.url, direct, n_predict=4)  # straight to llama-server: no poll sees it end
    other = make_prompt(server.url, PROMPT_TOKENS, seed=402)
    complete(proxy, other, n_predict=4)  # a new conversation through the proxy: the only slot is given away

    _, ids = http_json("POST", server.url + "/tokenize", {"content": direct, "add_special": True})
    want = slotfile.prefix_hashes(slotfile.pack_ids(ids["tokens"]))
    kept = [tokens for have, tokens in _library(slot_dir) if slotfile.shared_blocks(want, have) >= len(want)]
    assert kept, "the direct turn was not saved before its slot was given away"
    again = complete(proxy, direct + " One more line.", n_predict=4)  # its next turn, through the proxy
    print(
        f"direct turn of {first['timings']['prompt_n']} tokens saved before the swap ({kept[0]} tokens kept); "
        f"its next turn through the proxy reused {again['timings']['cache_n']}"
    )
    assert again["timings"]["cache_n"] >= WARM * int(first["timings"]["prompt_n"])
    assert side.metric("llama_sidecar_conversation_unrouted_total", reason="swap") == 0
