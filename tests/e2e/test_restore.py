"""The product's main path against a real llama-server and a real model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, manifests

PROMPT_TOKENS = 2048


def _snapshot_count(slot_dir: Path) -> int:
    return len(manifests(slot_dir))


def test_kill9_restart_is_restored_without_client_action(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, figure: Callable[[str], None]
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=1)
    cold = complete(server.url, prompt)
    assert cold["timings"]["prompt_n"] >= PROMPT_TOKENS * 0.95
    side.wait_saved()
    assert _snapshot_count(slot_dir) == 1

    server.restart(graceful=False)
    side.wait_restored()
    assert side.metric("llama_sidecar_server_restarts_total") == 1

    warm = complete(server.url, prompt + " and then a few more words")
    n_prompt = cold["timings"]["prompt_n"]
    figure(
        f"after kill -9: {warm['timings']['cache_n']} of {n_prompt} tokens reused from the restored slot;"
        f" prompt_ms cold {cold['timings']['prompt_ms']:.0f}, warm {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.95 * n_prompt


def test_graceful_restart_is_restored(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=2)
    cold = complete(server.url, prompt)
    side.wait_for(lambda: _snapshot_count(slot_dir) == 1, what="snapshot")
    server.restart(graceful=True)
    side.wait_restored()
    warm = complete(server.url, prompt + " once more")
    assert warm["timings"]["cache_n"] >= 0.95 * cold["timings"]["prompt_n"]


def test_sidecar_started_after_server_came_back_restores_at_startup(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    first = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=3)
    cold = complete(server.url, prompt)
    first.wait_for(lambda: _snapshot_count(slot_dir) == 1, what="snapshot")
    first.kill()
    server.restart(graceful=False)
    second = sidecar(server, slot_dir)
    second.wait_restored()
    assert second.metric("llama_sidecar_server_restarts_total") == 0
    warm = complete(server.url, prompt + " again")
    assert warm["timings"]["cache_n"] >= 0.95 * cold["timings"]["prompt_n"]


def test_two_slots_two_conversations_both_come_back(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir)
    prompts = [make_prompt(server.url, PROMPT_TOKENS, seed=10 + i) for i in range(2)]
    colds = []
    for slot, prompt in enumerate(prompts):
        colds.append(complete(server.url, prompt, id_slot=slot))
        side.wait_saved(slot=slot)
    server.restart(graceful=False)
    for slot in range(2):
        side.wait_restored(slot=slot)
    for slot, prompt in enumerate(prompts):
        warm = complete(server.url, prompt + " continued", id_slot=slot)
        assert warm["timings"]["cache_n"] >= 0.95 * colds[slot]["timings"]["prompt_n"], slot


def test_one_save_per_change_none_while_busy_none_when_unchanged(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--idle-seconds": "1.0"})
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=4)
    complete(server.url, prompt, n_predict=64)
    side.wait_for(lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 1, what="save")
    # Unchanged slot: no further save however long we wait.
    time.sleep(3)
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 1
    # A new turn changes the slot: exactly one more save.
    complete(server.url, prompt + " next turn", n_predict=8)
    side.wait_for(lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 2, what="2nd save")
    time.sleep(3)
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 2
    for entry in side.log_events("snapshot_committed"):
        assert entry["tokens"] >= PROMPT_TOKENS * 0.95
    # Saves never happened while the slot was busy: each committed snapshot holds a finished turn
    # (prompt plus all its generated tokens), never a partial one.
    committed = side.log_events("snapshot_committed")
    assert len(committed) == 2


def test_request_that_reaches_restarted_server_first_is_not_overwritten(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    first = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, PROMPT_TOKENS, seed=5))
    first.wait_for(lambda: _snapshot_count(slot_dir) == 1, what="snapshot")
    first.kill()
    server.restart(graceful=False)
    other = make_prompt(server.url, PROMPT_TOKENS, seed=6)
    complete(server.url, other)  # a user's request lands before the sidecar is back
    second = sidecar(server, slot_dir)
    second.wait_for(
        lambda: second.metric("llama_sidecar_restores_total", slot="0", result="slot_busy") >= 1,
        what="restore refused for the occupied slot",
    )
    assert second.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    again = complete(server.url, other + " follow-up")
    assert again["timings"]["cache_n"] >= 0.95 * PROMPT_TOKENS


def test_restart_detected_but_slot_taken_by_a_request_is_left_alone(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, PROMPT_TOKENS, seed=15))
    side.wait_for(lambda: _snapshot_count(slot_dir) == 1, what="snapshot")
    side.pause()  # the sidecar misses the whole restart and the user's first request
    server.restart(graceful=False)
    other = make_prompt(server.url, PROMPT_TOKENS, seed=16)
    complete(server.url, other)
    side.resume()
    side.wait_for(lambda: side.metric("llama_sidecar_server_restarts_total") == 1, what="restart detected")
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="slot_busy") == 1,
        what="restore refused for the occupied slot",
    )
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    again = complete(server.url, other + " follow-up")
    assert again["timings"]["cache_n"] >= 0.95 * PROMPT_TOKENS


def test_restarted_sidecar_keeps_snapshots_and_does_not_resave(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    first = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, PROMPT_TOKENS, seed=7))
    first.wait_for(lambda: _snapshot_count(slot_dir) == 1, what="snapshot")
    before = sorted(p.name for p in slot_dir.iterdir())
    first.terminate()
    second = sidecar(server, slot_dir)
    second.wait_for(lambda: second.log_events("slot_already_saved"), what="adoption of the existing snapshot")
    time.sleep(2)
    assert second.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 0
    assert sorted(p.name for p in slot_dir.iterdir()) == before


def test_final_snapshot_on_sigterm(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--idle-seconds": "600", "--snapshot-interval": "600"})
    complete(server.url, make_prompt(server.url, PROMPT_TOKENS, seed=8))
    side.wait_for(lambda: side.status()["slots"][0]["task"] is not None, what="slot seen busy/used")
    assert _snapshot_count(slot_dir) == 0
    assert side.terminate() == 0
    assert _snapshot_count(slot_dir) == 1
    assert side.log_events("snapshot_committed")[0]["reason"] == "final"
