"""Sliding-window models at llama-server's defaults (no ``--swa-full``), against the real server.

Gemma 3 (the bed's model: a window of 512 in 5 of every 6 layers) and a tiny
random-weight gpt-oss (a window of 128 in every other layer, attention sinks,
a mixture of experts; see support.tinymodels). Without ``--swa-full`` a
restored windowed layer holds only the window and llama-server re-prefills
everything after a restore; the sidecar saves each slot at its prompt's
boundary with one masked cell below the window
(``sidecar.snapshots.windowcell``), and the next turn reuses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.snapshots import slotfile
from tests.support import tinymodels
from tests.support.chatturns import Chat
from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt
from tests.support.sidecarbed import MakeSidecar, manifest_records, manifests, proxied

PROMPT_TOKENS = 700
REUSED = 0.99
"""Share of the previous prompt the turn after a kill -9 must reuse."""
MODELS = [tinymodels.DENSE, *tinymodels.Windowed]


def _server(llama: MakeServer, windowed: dict[tinymodels.Windowed, Path], kind: str, slot_dir: Path) -> LlamaServer:
    model: dict[str, Any] = {} if kind == tinymodels.DENSE else {"model": windowed[tinymodels.Windowed(kind)]}
    return llama(slot_dir=slot_dir, ctx_size=4096, swa_full=False, **model)


def _saved_at_boundary(chat: Chat, server: str, folder: Path) -> bool:
    """Whether a snapshot in ``folder`` (the slot dir, or the block store's manifests) holds exactly the chat's
    last prompt less its last 3 tokens."""
    _, templated = http_json("POST", server + "/apply-template", {"messages": chat.messages[:-1]})
    body = {"content": templated["prompt"], "add_special": True, "parse_special": True}
    _, ids = http_json("POST", server + "/tokenize", body)
    want = slotfile.whole_hash(slotfile.pack_ids(ids["tokens"][: chat.prompt_tokens - 3]))
    indexes = [record.get("index") or {} for record in manifest_records(folder)]  # a pruned one left out
    return any(index.get("whole") == want for index in indexes)


def _newest_tokens(slot_dir: Path) -> int:
    newest = max(manifests(slot_dir), key=lambda name: json.loads((slot_dir / name).read_text())["generation"])
    return int(json.loads((slot_dir / newest).read_text())["tokens"])


@pytest.mark.parametrize("kind", MODELS)
def test_beside_the_server_the_turn_after_a_kill9_reuses_the_previous_prompt(
    llama: MakeServer,
    sidecar: MakeSidecar,
    windowed_models: dict[tinymodels.Windowed, Path],
    kind: str,
    slot_dir: Path,
) -> None:
    server = _server(llama, windowed_models, kind, slot_dir)
    side = sidecar(server, slot_dir)
    side.wait_for(lambda: side.status()["server"]["memory"] == "swa", what="the memory kind in /status")
    chat = Chat(1, make_prompt(server.url, PROMPT_TOKENS, seed=61))
    chat.turn(server.url)
    side.wait_saved(1)
    assert _newest_tokens(slot_dir) == chat.prompt_tokens - 3  # at the prompt's boundary, not after the reply
    assert side.log_events("slot_rewound_to_boundary")
    server.restart()
    side.wait_restored(1)
    reused, earlier = chat.turn(server.url)
    print(f"{kind}: after kill -9, {reused} of the previous prompt's {earlier} tokens reused")
    assert reused >= REUSED * earlier, (reused, earlier)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 1,
        what="the restore judged effective",
    )
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
    assert side.metric("llama_sidecar_model_memory_info", memory="swa") == 1
    assert not side.log_events("window_cell_not_added")


@pytest.mark.parametrize("blocks", [False, True], ids=["whole-files", "block-store"])
def test_through_the_proxy_two_chats_on_one_slot_stay_warm_and_come_back_after_kill9(
    llama: MakeServer,
    sidecar: MakeSidecar,
    windowed_models: dict[tinymodels.Windowed, Path],
    slot_dir: Path,
    tmp_path: Path,
    blocks: bool,
) -> None:
    """Gemma 3 at the server's defaults (RAM cache on), two conversations taking turns on one slot."""
    server = _server(llama, windowed_models, tinymodels.DENSE, slot_dir)
    extra = {"--store-dir": str(tmp_path / "store")} if blocks else {}
    side, proxy = proxied(sidecar, server, slot_dir, extra=extra)
    chats = [Chat(n, make_prompt(server.url, PROMPT_TOKENS, seed=70 + n)) for n in range(2)]
    for turn in range(2):
        for chat in chats:
            reused, earlier = chat.turn(proxy)
            print(f"turn {turn + 1}, chat {chat.n}: reused {reused} of the previous prompt's {earlier}")
            if turn:
                assert reused >= REUSED * earlier, (turn, chat.n, reused, earlier)
    folder = tmp_path / "store" / "snapshots" if blocks else slot_dir
    side.wait_for(
        lambda: all(_saved_at_boundary(chat, server.url, folder) for chat in chats),
        what="both conversations saved at their last prompt's boundary",
    )
    server.restart()
    for chat in chats:
        reused, earlier = chat.turn(proxy)
        print(f"after kill -9, chat {chat.n}: reused {reused} of {earlier}")
        assert reused >= REUSED * earlier, (chat.n, reused, earlier)
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
