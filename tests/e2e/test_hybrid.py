"""Hybrid models (a recurrent state beside attention) against the real server, beside it and through the proxy.

The models are tiny random-weight GGUFs of the `qwen35` (Gated DeltaNet) and
`lfm2` (short convolutions) architectures (see support.tinymodels): their
state can be extended but not cut back, as on Qwen3.5/3.6 and LFM2. Chat
turns re-render the previous reply through the chat template, so a snapshot
taken after the reply is useless to the next turn; a snapshot at the
previous prompt's boundary serves it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.snapshots import slotfile
from tests.support import tinymodels
from tests.support.chatturns import WARM, Chat
from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifest_records, manifests

PROMPT_TOKENS = 900
ARCHS = [tinymodels.Arch.QWEN35, tinymodels.Arch.LFM2]


def _server(llama: MakeServer, tiny_models: dict[tinymodels.Arch, Path], arch: tinymodels.Arch, slot_dir: Path,
            **kw: Any) -> LlamaServer:  # fmt: skip
    return llama(slot_dir=slot_dir, model=tiny_models[arch], ctx_size=4096, swa_full=False, **kw)


def _newest_tokens(slot_dir: Path) -> int:
    newest = max(manifests(slot_dir), key=lambda name: json.loads((slot_dir / name).read_text())["generation"])
    return int(json.loads((slot_dir / newest).read_text())["tokens"])


@pytest.mark.parametrize("arch", ARCHS)
def test_beside_the_server_the_next_chat_turn_after_a_kill9_is_warm(
    llama: MakeServer,
    sidecar: MakeSidecar,
    tiny_models: dict[tinymodels.Arch, Path],
    arch: tinymodels.Arch,
    slot_dir: Path,
) -> None:
    server = _server(llama, tiny_models, arch, slot_dir)
    side = sidecar(server, slot_dir)
    chat = Chat(1, make_prompt(server.url, PROMPT_TOKENS, seed=11))
    chat.turn(server.url)
    side.wait_saved(1)
    side.wait_for(lambda: side.status()["server"]["memory"] == "hybrid", what="the memory kind in /status")
    # The snapshot ends 3 tokens before the prompt's end, not after the reply.
    assert _newest_tokens(slot_dir) == chat.prompt_tokens - 3
    server.restart()
    side.wait_restored(1)
    reused, earlier = chat.turn(server.url)
    assert reused >= WARM * earlier, (reused, earlier)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 1,
        what="the restore judged effective",
    )
    assert side.metric("llama_sidecar_model_memory_info", memory="hybrid") == 1


def _saved_at_boundary(chat: Chat, server: str, slot_dir: Path) -> bool:
    """Whether a snapshot holds exactly the chat's last prompt less its last 3 tokens."""
    _, templated = http_json("POST", server + "/apply-template", {"messages": chat.messages[:-1]})
    body = {"content": templated["prompt"], "add_special": True, "parse_special": True}
    _, ids = http_json("POST", server + "/tokenize", body)
    want = slotfile.whole_hash(slotfile.pack_ids(ids["tokens"][: chat.prompt_tokens - 3]))
    indexes = [record.get("index") or {} for record in manifest_records(slot_dir)]  # a pruned one left out
    return any(index.get("whole") == want for index in indexes)


def _verdicts(side: SidecarProcess) -> tuple[float, float]:
    return (
        side.metric("llama_sidecar_restore_verifications_total", outcome="effective"),
        side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective"),
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_through_the_proxy_two_chats_taking_turns_on_one_slot_stay_warm_and_come_back_after_kill9(
    llama: MakeServer,
    sidecar: MakeSidecar,
    tiny_models: dict[tinymodels.Arch, Path],
    arch: tinymodels.Arch,
    slot_dir: Path,
) -> None:
    server = _server(llama, tiny_models, arch, slot_dir)
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=40 + n)) for n in range(2)]
    for turn in range(4):
        for chat in chats:
            reused, earlier = chat.turn(proxy)
            print(f"turn {turn + 1}, chat {chat.n}: reused {reused} of the previous prompt's {earlier}")
            if turn:
                assert reused >= WARM * earlier, (turn, chat.n, reused, earlier)
    side.wait_for(
        lambda: all(_saved_at_boundary(chat, server.url, slot_dir) for chat in chats),
        what="both conversations saved at their last prompt's boundary",
    )
    server.restart()
    for chat in chats:
        reused, earlier = chat.turn(proxy)
        print(f"after kill -9, chat {chat.n}: reused {reused} of {earlier}")
        assert reused >= WARM * earlier, (chat.n, reused, earlier)

    # A regenerate (the last turn sent again) and an edited history (the last message changed):
    # each is served by what the model can use, never by a snapshot it cannot.
    last = chats[1].messages[:-2]
    regenerate = chats[1].send(proxy, last)
    assert regenerate["timings"]["cache_n"] >= WARM * chats[1].prompt_tokens
    edited = [*chats[0].messages[:-3], {"role": "user", "content": chats[0].messages[-3]["content"] + " Briefly."}]
    answer = chats[0].send(proxy, edited)
    assert answer["timings"]["cache_n"] > 0
    side.wait_for(lambda: not side.status()["slots"][0]["processing"], what="the slot idle")
    assert side.metric("llama_sidecar_conversation_unrouted_total", reason="swap") == 0
    side.wait_for(lambda: _verdicts(side)[0] >= 1, what="a restore judged")
    assert _verdicts(side)[1] == 0


def test_through_the_proxy_a_request_no_snapshot_serves_gets_the_servers_own_cache(
    llama: MakeServer,
    sidecar: MakeSidecar,
    tiny_models: dict[tinymodels.Arch, Path],
    slot_dir: Path,
    tmp_path: Path,
) -> None:
    """Two conversations on two slots of a qwen35 server; the first one's only message is then edited.

    No snapshot is an exact prefix of the edited request (each holds the whole first message), so none may
    be swapped in: it must run where llama-server alone would run it, in the slot that holds the conversation,
    whose context checkpoints serve part of it, and leave the other conversation in its own slot. Pinned to
    the other slot (tried: routing that ignores the slots' prefixes and gives the most recently used slot),
    the server still found the prefix in its RAM cache but the other conversation was evicted, and its next
    turn needed a swap. The figure to match is llama-server alone's, on the same requests in the same test.
    """
    alone_dir = tmp_path / "alone"
    alone_dir.mkdir()
    alone = _server(llama, tiny_models, tinymodels.Arch.QWEN35, alone_dir, n_slots=2)
    texts = [make_prompt(alone.url, PROMPT_TOKENS, seed=70 + n) for n in range(2)]
    edited = [{"role": "user", "content": texts[0] + " Briefly, please."}]

    def first_turns(url: str) -> list[Chat]:
        chats = [Chat(n, text) for n, text in enumerate(texts)]
        for chat in chats:
            chat.turn(url)
        return chats

    first_turns(alone.url)
    expected = int(Chat(0, "").send(alone.url, edited)["timings"]["cache_n"])
    alone.kill()
    assert expected > 0, "llama-server alone reuses part of the edited request from its checkpoints"

    server = _server(llama, tiny_models, tinymodels.Arch.QWEN35, slot_dir, n_slots=2)
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    chats = first_turns(proxy)
    side.wait_for(
        lambda: all(_saved_at_boundary(chat, server.url, slot_dir) for chat in chats),
        what="both conversations saved at their prompt's boundary",
    )
    swaps = side.metric("llama_sidecar_swap_duration_seconds_count")
    answer = chats[0].send(proxy, edited)
    reused = int(answer["timings"]["cache_n"])
    print(f"edited request: reused {reused} through the proxy, {expected} with llama-server alone")
    assert reused >= expected, (reused, expected)
    # The other conversation kept its slot: its next turn is warm without a swap.
    again, earlier = chats[1].turn(proxy)
    assert again >= WARM * earlier, (again, earlier)
    assert side.metric("llama_sidecar_swap_duration_seconds_count") == swaps
    assert _verdicts(side)[1] == 0
