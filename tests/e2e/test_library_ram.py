"""The library below llama-server's own RAM prompt cache, against the real server at its defaults.

llama-server keeps a RAM prompt cache (``--cache-ram``, 8192 MiB by default):
a conversation that leaves its slot for another's task is copied there, and
loaded back from there into a slot when it returns. Through the proxy, a
returning conversation is then pinned to an idle slot with nothing restored,
as fast as the server alone; the library's snapshots still bring every
conversation back after a ``kill -9``, which empties that cache.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 600
WARM = 0.9
ROUTES = "llama_sidecar_library_routes_total"
PROMPT_BYTES = "llama_sidecar_library_prompt_bytes_total"


class Chat:
    def __init__(self, n: int, text: str) -> None:
        self.n = n
        self.messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": text}]
        self.prompt_tokens = 0

    def turn(self, url: str) -> tuple[int, int]:
        """(cache_n, the earlier turn's prompt tokens)."""
        body = {"messages": self.messages, "max_tokens": 2, "temperature": 0}
        status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
        assert status == 200, answer
        earlier, self.prompt_tokens = self.prompt_tokens, answer["usage"]["prompt_tokens"]
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"And record {self.n} again?"})
        return int(answer["timings"]["cache_n"]), earlier


def _start(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, *, server_args: list[str], extra: dict[str, str]
) -> tuple[LlamaServer, SidecarProcess, str]:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096, extra_args=server_args)
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}", **extra})
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    return server, side, f"http://127.0.0.1:{port}"


def _round(chats: list[Chat], proxy: str) -> list[tuple[int, int]]:
    return [chat.turn(proxy) for chat in chats]


def _sources(side: SidecarProcess) -> dict[str, float]:
    return {
        s: side.metric("llama_sidecar_conversation_requests_total", source=s)
        for s in ("slot", "ram", "library", "cold")
    }


def test_at_the_servers_defaults_a_returning_conversation_comes_from_its_ram_cache_not_a_file(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server, side, proxy = _start(llama, sidecar, slot_dir, server_args=[], extra={})
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=640 + n)) for n in range(4)]
    _round(chats, proxy)
    asked = 0.0
    for rnd in (1, 2):
        asked = side.metric(PROMPT_BYTES, source="asked")
        for chat, (cache_n, earlier) in zip(chats, _round(chats, proxy), strict=True):
            assert cache_n >= WARM * earlier, f"round {rnd}: conversation {chat.n} came back cold"
    # Each returning turn continued what its conversation left in RAM: placed by that, with no round trip to
    # tokenize it first (none at all in the last round).
    assert side.metric(ROUTES, by="ram_turn") == 2 * len(chats)
    assert side.metric(PROMPT_BYTES, source="asked") == asked
    sources = _sources(side)
    print(f"sources: {sources}; swaps {side.metric('llama_sidecar_swap_duration_seconds_count'):.0f}")
    assert sources["ram"] >= 2 * (len(chats) - 2) - 1  # every returning turn but the first try
    assert side.metric("llama_sidecar_swap_duration_seconds_count") <= 1  # no file read but, at most, the first
    assert len(side.log_events("server_ram_cache_serves")) == 1
    assert side.log_events("server_ram_cache_missed") == []

    side.wait_for(
        lambda: side.metric("llama_sidecar_library_conversations") >= len(chats), timeout=60, what="all in the library"
    )
    server.kill()  # its RAM cache is gone: the library brings every conversation back
    server.start()
    server.wait_healthy()
    # A conversation left its slot unsaved only once it had a snapshot, and while what a crash loses of it (the
    # turns since) re-prefills within --max-unsaved-seconds: each comes back with at least its first turn.
    for chat, (cache_n, earlier) in zip(chats, _round(chats, proxy), strict=True):
        print(f"after kill -9: conversation {chat.n} reused {cache_n} of {earlier} tokens")
        assert cache_n >= PROMPT_TOKENS, f"after kill -9: conversation {chat.n} came back cold"


def test_a_server_without_the_ram_cache_it_was_said_to_have_costs_one_turn_then_the_library_serves(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server, side, proxy = _start(llama, sidecar, slot_dir, server_args=["--cache-ram", "0"], extra={})
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=650 + n)) for n in range(3)]
    _round(chats, proxy)
    cold = 0
    for _ in (1, 2):
        cold += sum(cache_n < WARM * earlier for cache_n, earlier in _round(chats, proxy))
    print(f"cold returning turns: {cold}; sources {_sources(side)}")
    assert cold <= 1
    assert len(side.log_events("server_ram_cache_missed")) == 1
    assert side.metric("llama_sidecar_library_ram_conversations") == 0
    assert _sources(side)["library"] >= 3


def test_with_a_crash_bound_set_a_conversation_leaves_its_slot_for_the_ram_cache_unsaved(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server, side, proxy = _start(llama, sidecar, slot_dir, server_args=[], extra={"--max-unsaved-seconds": "60"})
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=660 + n)) for n in range(3)]
    _round(chats, proxy)
    for _ in (1, 2):
        for cache_n, earlier in _round(chats, proxy):
            assert cache_n >= WARM * earlier
    left = side.metric("llama_sidecar_library_left_unsaved_reprefill_seconds_count")
    assert left >= 1
    # What a crash would cost of them, each within the bound.
    assert side.metric("llama_sidecar_library_left_unsaved_reprefill_seconds_sum") <= 60 * left
    assert side.metric("llama_sidecar_conversation_requests_total", source="ram") >= 2


def test_agents_on_one_system_prompt_keep_their_own_turns_when_another_takes_their_slot(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """Three agents share a long system prompt on 2 slots, at the server's defaults.

    A new agent's request shares only the system prompt with a slot: pinned there, it cuts the slot back to
    that prompt, and llama-server keeps no RAM copy of what it cuts when it keeps more than half of the slot.
    So the slot's own turns are saved first, and each agent comes back warm past the system prompt.
    """
    server, side, proxy = _start(llama, sidecar, slot_dir, server_args=[], extra={})
    system = make_prompt(server.url, 500, seed=670)
    chats = [Chat(n, make_prompt(server.url, 300, seed=680 + n)) for n in range(3)]
    for chat in chats:
        chat.messages[0]["content"] = system
    _round(chats, proxy)
    for rnd in (1, 2):
        for chat, (cache_n, earlier) in zip(chats, _round(chats, proxy), strict=True):
            print(f"round {rnd}: agent {chat.n} reused {cache_n} of {earlier} tokens")
            assert cache_n >= WARM * earlier, f"round {rnd}: agent {chat.n} came back with only the system prompt"
    print(f"sources: {_sources(side)}")
