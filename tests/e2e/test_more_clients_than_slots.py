"""More conversations at once than slots, through the proxy on the real server: no conversation is lost.

Three clients each run one conversation of several turns on a server of 2 slots (its RAM prompt cache
at its default), with answers long enough that turns overlap: most of the time both slots run and a
third request arrives. Such a request must not go to llama-server unpinned: the server would give it
the first slot to free, over a conversation no snapshot holds yet (only its RAM cache then keeps it,
until a crash). It is held (a streamed one keeps its keep-alives) and placed once a slot frees, that
slot's content saved first (``--max-unsaved-seconds 0``: always). Once every slot's content is saved,
llama-server is killed (``kill -9``: its RAM cache goes with it) and started again. Every conversation's
next turn, before and after the kill, must reuse at least 99% of its previous prompt (``timings.cache_n``).
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.llamabed import MakeServer, http_json, make_prompt
from tests.support.sidecarbed import MakeSidecar, proxied

CLIENTS = 3
TURNS = 2
ANSWER = 32
"""Tokens each answer generates: long enough that two turns run while a third arrives."""
FOLLOW_UP = 160
"""Tokens of each follow-up (a tool's output): past one block (128 tokens), so a conversation's newest snapshot
always holds a block more of its next prompt than its older ones (the library tells snapshots apart by blocks)."""
WARM = 0.99
UNSAVED = "llama_sidecar_slot_unsaved_since_timestamp_seconds"


def _talk(
    url: str,
    messages: list[dict[str, Any]],
    follow_ups: list[str],
    n: int,
    turns: range,
    seen: list[tuple[int, int, int]],
    errors: list[str],
) -> None:
    """Turns ``turns`` of one client's conversation ``messages``, in a row, each answer followed by the next of
    ``follow_ups``; ``seen`` gets (turn, cache_n, prompt tokens) of each."""
    for turn in turns:
        body = {"model": "m", "messages": messages, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
        try:
            status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
        except OSError as exc:
            errors.append(f"conversation {n} turn {turn}: {exc}")
            return
        if status != 200:
            errors.append(f"conversation {n} turn {turn}: {status} {answer}")
            return
        timings = answer["timings"]
        seen.append((turn, int(timings["cache_n"]), int(timings["cache_n"]) + int(timings["prompt_n"])))
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        messages.append({"role": "user", "content": follow_ups[turn]})


@pytest.mark.timeout(300)
def test_three_conversations_on_two_slots_each_next_turn_reuses_its_previous_prompt_even_after_a_kill9(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    side, url = proxied(sidecar, server, slot_dir, {"--max-unsaved-seconds": "0"})
    chats: list[list[dict[str, Any]]] = [
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": make_prompt(server.url, 500, seed=580 + n)},
        ]
        for n in range(CLIENTS)
    ]
    follow_ups = [
        [make_prompt(server.url, FOLLOW_UP, seed=600 + 10 * n + t) for t in range(TURNS + 1)] for n in range(CLIENTS)
    ]
    seen: list[list[tuple[int, int, int]]] = [[] for _ in range(CLIENTS)]
    errors: list[str] = []
    clients = [
        threading.Thread(
            target=_talk, args=(url, chats[n], follow_ups[n], n, range(TURNS), seen[n], errors), daemon=True
        )
        for n in range(CLIENTS)
    ]
    began = time.monotonic()
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=200)
    joined = time.monotonic()
    assert not any(client.is_alive() for client in clients), "a conversation did not end in 200 s"
    assert errors == []
    side.wait_for(
        lambda: all(side.metric(UNSAVED, slot=str(slot)) == 0 for slot in (0, 1)),
        what="every slot's content saved",
    )
    saved = time.monotonic()
    server.restart(graceful=False)
    side.wait_restored(slot=0)
    side.wait_restored(slot=1)
    restored = time.monotonic()
    for n in range(CLIENTS):  # one more turn each, in a row: two come back from the restore, one from the library
        _talk(url, chats[n], follow_ups[n], n, range(TURNS, TURNS + 1), seen[n], errors)
    assert errors == []
    print(
        f"turns {joined - began:.1f} s, saved {saved - joined:.1f} s, restart and restore {restored - saved:.1f} s, "
        f"last turns {time.monotonic() - restored:.1f} s"
    )
    lost: list[str] = []
    for n, turns in enumerate(seen):
        assert len(turns) == TURNS + 1, turns
        for (_, _, before), (turn, cached, prompt) in itertools.pairwise(turns):
            print(f"conversation {n} turn {turn}: reused {cached} of {prompt} (previous prompt {before})")
            if cached < WARM * before:
                lost.append(f"conversation {n} turn {turn}: reused {cached}, its previous prompt {before}")
    assert lost == []
    assert side.metric("llama_sidecar_conversation_unrouted_total", reason="swap") == 0
