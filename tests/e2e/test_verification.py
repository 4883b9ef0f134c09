"""Restore verification against the real model: with and without --swa-full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 1024


def _restart_and_reuse(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, **server_kw: Any
) -> tuple[SidecarProcess, dict[str, Any], dict[str, Any]]:
    """The sidecar, then the answers of the cold first turn and of the turn after a kill -9 and the restore."""
    server = llama(slot_dir=slot_dir, **server_kw)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=21)
    cold = complete(server.url, prompt)
    side.wait_saved()
    server.restart(graceful=False)
    side.wait_restored()
    # Gemma 3 is a sliding-window model: with or without --swa-full the restore waits for the slot's next
    # request, counted neither ok nor anything else yet
    side.wait_for(  # the round's records are published once it ends, just after its restore
        lambda: [r["result"] for r in side.status()["last_restore"]] == ["unverified"], what="an unverified restore"
    )
    assert side.metric("llama_sidecar_restores_total", slot="0") == 0
    warm = complete(server.url, prompt + " and a question")
    return side, cold, warm


def _last_restore(side: SidecarProcess) -> str:
    (record,) = side.status()["last_restore"]
    return str(record["result"])


def test_restore_with_swa_full_is_verified_effective(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    side, _cold, _warm = _restart_and_reuse(llama, sidecar, slot_dir)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 1,
        what="effective verification",
    )
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
    effective = side.wait_for(lambda: side.log_events("restore_effective"), what="the verdict's line")
    assert effective[0]["reused_tokens"] >= 0.95 * PROMPT_TOKENS
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 1  # proven by the request
    assert _last_restore(side) == "ok"


def test_an_effective_restore_saves_the_prefill_the_cold_turn_took(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """The time saved is the reused tokens at the rate the server itself measured on the cold turn."""
    side, cold, warm = _restart_and_reuse(llama, sidecar, slot_dir)
    saved = side.wait_for(
        lambda: side.metric("llama_sidecar_prefill_saved_seconds_total", by="restore") or None,
        what="prefill seconds saved",
    )
    reused = side.metric("llama_sidecar_prefill_saved_tokens_total", by="restore")
    assert reused == warm["timings"]["cache_n"]  # what the warm turn's own answer says it reused
    cold_rate = cold["timings"]["prompt_n"] / (cold["timings"]["prompt_ms"] / 1000)  # the cold turn's prefill
    assert saved == pytest.approx(reused / cold_rate, rel=0.05)
    assert saved > 20 * warm["timings"]["prompt_ms"] / 1000  # far more than the warm turn's own prefill took
    status = side.status()["time_saved"]
    assert status["prefill_seconds"] == pytest.approx(saved, abs=0.001)
    assert status["tokens"] == reused
    assert side.metric("llama_sidecar_prefill_saved_seconds_total", by="swap") == 0


def test_restore_without_swa_full_that_the_next_request_does_not_extend_is_reported_ineffective(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """A raw /completion: the slot holds the prompt and the reply, and the next prompt drops the reply.

    Without --swa-full a restored window serves only a request that extends all of it (a chat's snapshot
    ends at its prompt's boundary, ``test_sliding_window``); this one diverges before its end.
    """
    side, _cold, warm = _restart_and_reuse(llama, sidecar, slot_dir, swa_full=False)
    assert warm["timings"]["cache_n"] == 0  # the server really re-prefilled: the fact being reported
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 1,
        what="ineffective verification",
    )
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 0
    assert side.metric("llama_sidecar_prefill_saved_seconds_total", by="restore") == 0  # it saved nothing
    warnings = side.log_events("restore_ineffective")
    assert len(warnings) == 1
    assert warnings[0]["memory"] == "swa"
    assert "holds every one of its tokens" in warnings[0]["hint"]
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0  # never counted a hit
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ineffective") == 1
    assert _last_restore(side) == "ineffective"
    assert "extends all of its tokens" in side.status()["last_restore"][0]["detail"]


def test_without_server_metrics_verification_is_off_and_said_once(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    side, _, _ = _restart_and_reuse(llama, sidecar, slot_dir, metrics=False)
    side.wait_for(lambda: side.log_events("restore_verification_off"), what="verification-off notice")
    assert len(side.log_events("restore_verification_off")) == 1
    metrics_off = side.wait_for(lambda: side.log_events("server_metrics_off"), what="the metrics-off line")
    assert "--metrics" in metrics_off[0]["hint"]
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 0
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="unverified") == 1  # nothing could decide
    assert _last_restore(side) == "unverified"
