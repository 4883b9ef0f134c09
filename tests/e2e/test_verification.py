"""Restore verification against the real model: with and without --swa-full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.llamabed import MakeServer, complete, make_prompt
from support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 1024


def _restart_and_reuse(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, **server_kw: Any
) -> tuple[SidecarProcess, dict[str, Any]]:
    server = llama(slot_dir=slot_dir, **server_kw)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=21)
    complete(server.url, prompt)
    side.wait_saved()
    server.restart(graceful=False)
    side.wait_restored()
    warm = complete(server.url, prompt + " and a question")
    return side, warm


def test_restore_with_swa_full_is_verified_effective(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    side, _warm = _restart_and_reuse(llama, sidecar, slot_dir)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 1,
        what="effective verification",
    )
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
    assert side.log_events("restore_effective")[0]["reused_tokens"] >= 0.95 * PROMPT_TOKENS


def test_restore_without_swa_full_is_reported_ineffective_naming_the_flag(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    side, warm = _restart_and_reuse(llama, sidecar, slot_dir, swa_full=False)
    assert warm["timings"]["cache_n"] == 0  # the server really re-prefilled: the fact being reported
    side.wait_for(
        lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 1,
        what="ineffective verification",
    )
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 0
    warnings = side.log_events("restore_ineffective")
    assert len(warnings) == 1
    assert "--swa-full" in warnings[0]["hint"]


def test_without_server_metrics_verification_is_off_and_said_once(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    side, _ = _restart_and_reuse(llama, sidecar, slot_dir, metrics=False)
    side.wait_for(lambda: side.log_events("restore_verification_off"), what="verification-off notice")
    assert len(side.log_events("restore_verification_off")) == 1
    assert "--metrics" in side.log_events("server_metrics_off")[0]["hint"]
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="effective") == 0
    assert side.metric("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
