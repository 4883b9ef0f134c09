"""The status page at `/`, loaded by headless Chromium against a real llama-server and sidecar after a restore.

What a person would see: llama-server up, the restore listed with its verdict and the time it saved,
the headline numbers equal to what /metrics says at the same moment, the conversation in the library,
nothing loaded from elsewhere, and no word of the conversation itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support import browser
from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.readers import parse_metrics, sample
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 1500
SHOTS = "STATUS_PAGE_SCREENSHOTS"
"""A directory to copy the screenshots into (how docs/status-page.png is made)."""


def test_the_page_shows_the_restore_its_verdict_and_the_time_saved_as_metrics_count_them(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=25)
    complete(server.url, prompt)
    side.wait_saved()
    server.restart(graceful=False)
    side.wait_restored()
    warm = complete(server.url, prompt + " and one more question")
    assert warm["timings"]["cache_n"] >= 0.95 * PROMPT_TOKENS
    side.wait_for(
        lambda: side.metric("llama_sidecar_prefill_saved_seconds_total") > 0, what="the time saved to be counted"
    )
    side.wait_saved(2)  # the warm turn's save, before the page and /metrics are read (else it lands between)

    dom = browser.Dom(browser.dump_dom(side.url + "/"))
    code, text = side.get("/metrics")
    assert code == 200
    metrics = parse_metrics(text)

    assert "llama-server ok" in dom.text
    saved = sample(metrics, "llama_sidecar_prefill_saved_seconds_total")
    assert dom.figures["saved_seconds"] == pytest.approx(saved, rel=1e-5)
    assert f"{saved:.1f} s" in dom.figure_text["saved_seconds"] or f"{saved:.0f} s" in dom.figure_text["saved_seconds"]
    assert dom.figures["restores_ok"] == sample(metrics, "llama_sidecar_restores_total", result="ok") == 1
    assert dom.figures["verified_effective"] == 1
    assert dom.figures["snapshots_ok"] == sample(metrics, "llama_sidecar_snapshots_total", result="ok")
    assert dom.figures["restarts"] == sample(metrics, "llama_sidecar_server_restarts_total") == 1

    (act,) = dom.rows("acts")  # the restore, listed with its verdict and what it saved
    restored = int(sample(metrics, "llama_sidecar_restored_tokens_total"))
    assert (act["by"], act["slot"], act["tokens"], act["verdict"]) == ("restore", "0", f"{restored:,}", "effective")
    assert act["reused"] == f"{int(sample(metrics, 'llama_sidecar_prefill_saved_tokens_total')):,}"
    assert act["saved"].endswith(" s")
    (slot,) = dom.rows("slots")
    assert slot["slot"] == "0"
    assert slot["holds"].startswith("restore of ")  # the slot still holds what the restore put there
    library = dom.rows("library")
    assert library, "the restored conversation is in the library"
    status = side.status()
    snapshots = [s for per_slot in status["snapshots"].values() for s in per_slot]
    assert {row["tokens"] for row in library} <= {f"{s['tokens']:,}" for s in snapshots}
    assert all(row["where"] == "local" for row in library)
    assert len(dom.rows("round")) == 1

    # Everything it loads is its own, and nothing of the conversation is on it.
    assert [ref for ref in dom.references if not ref.startswith("data:")] == []
    content = {word for word in prompt.split() if len(word) > 3}  # the conversation's words, not "of" or "the"
    assert content & set(dom.text.lower().split()) == set(), "the page shows words of the conversation"

    desktop = browser.screenshot(side.url + "/", tmp_path / "status-page.png", width=1000, height=1700)
    phone = browser.screenshot(side.url + "/", tmp_path / "status-page-phone.png", width=412, height=1800)
    assert browser.png_size(desktop)[0] >= 1000
    assert browser.png_size(phone)[0] >= 412
    if os.environ.get(SHOTS):
        for shot in (desktop, phone):
            shutil.copy(shot, Path(os.environ[SHOTS]) / shot.name)


def test_a_password_in_the_server_url_shows_nowhere_the_sidecar_shows_the_url(
    llama: MakeServer, slot_dir: Path, tmp_path: Path
) -> None:
    """``--server http://user:password@host``: /status, /readyz, the page and the log name the server without it."""
    server = llama(slot_dir=slot_dir)
    secret = "pw-Hq72mVx0s1Kd"
    with_password = server.url.replace("http://", f"http://watcher:{secret}@")
    side = SidecarProcess(with_password, slot_dir, tmp_path / "sidecar-password.log").start()
    try:
        side.wait_for(lambda: side.status()["server"]["health"] == "ok", what="llama-server seen up")
        shown = side.status()["server"]["url"]
        assert shown == server.url.replace("http://", "http://watcher:[redacted]@")
        pages = [side.get(path)[1] for path in ("/status", "/readyz", "/")] + [side.log_path.read_text()]
        assert all(secret not in text for text in pages)
        assert "watcher:[redacted]@" in pages[2]  # the page names the server, user included
    finally:
        side.kill()
