"""The product's main path against a real llama-server and a real model."""

from __future__ import annotations

from pathlib import Path

from conftest import MakeServer, MakeSidecar
from llamabed import complete, make_prompt

PROMPT_TOKENS = 2048


def _snapshot_count(slot_dir: Path) -> int:
    return len(list(slot_dir.glob("slot*.json")))


def test_kill9_restart_is_restored_without_client_action(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=1)
    cold = complete(server.url, prompt)
    assert cold["timings"]["prompt_n"] >= PROMPT_TOKENS * 0.95
    side.wait_for(lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") >= 1,
                  what="first snapshot")
    assert _snapshot_count(slot_dir) == 1

    server.restart(graceful=False)
    side.wait_for(lambda: side.metric("llama_sidecar_restores_total", slot="0", result="ok") >= 1,
                  what="restore after kill -9")
    assert side.metric("llama_sidecar_server_restarts_total") == 1

    warm = complete(server.url, prompt + " and then a few more words")
    n_prompt = cold["timings"]["prompt_n"]
    print(f"cold prompt_ms={cold['timings']['prompt_ms']:.0f} warm prompt_ms={warm['timings']['prompt_ms']:.0f} "
          f"cache_n={warm['timings']['cache_n']} of {n_prompt}")
    assert warm["timings"]["cache_n"] >= 0.95 * n_prompt
