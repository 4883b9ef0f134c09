"""When the sidecar saves against the real server: --snapshot-interval, SIGTERM with a busy slot."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from tests.support.llamabed import MakeServer, build_of, call, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifests

TOKENS = 512
FINAL = 20


def test_snapshot_interval_saves_a_slot_that_never_stays_idle_long_enough(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, llama_binary: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--idle-seconds": "600", "--snapshot-interval": "2"})
    started = time.monotonic()
    complete(server.url, make_prompt(server.url, TOKENS, seed=121))
    side.wait_saved(timeout=30)
    assert time.monotonic() - started >= 1.7, "saved before --snapshot-interval 2 had passed"
    (committed,) = side.log_events("snapshot_committed")
    assert committed["reason"] == "periodic"

    # The manifest records the server it came from, as the server itself reports it.
    (name,) = manifests(slot_dir)
    fingerprint = json.loads((slot_dir / name).read_text())["fingerprint"]
    props = call("GET", server.url + "/props")
    meta = call("GET", server.url + "/v1/models")["data"][0]["meta"]
    assert fingerprint["build_info"] == props["build_info"] == build_of(llama_binary)
    assert fingerprint["model_path"] == props["model_path"] == str(server.model)
    assert fingerprint["model_size"] == meta["size"] > 0
    assert fingerprint["model_params"] == meta["n_params"] > 0
    assert fingerprint["n_ctx"] == server.ctx_size
    assert fingerprint["total_slots"] == 1


def _generate(url: str, prompt: str) -> None:
    """A long generation on slot 1 (the server is killed at teardown, which ends it)."""
    body = {"prompt": prompt, "n_predict": 4000, "ignore_eos": True, "id_slot": 1, "temperature": 0}
    with contextlib.suppress(Exception):
        call("POST", url + "/completion", body)


def _seen(side: SidecarProcess, slot: int, *, busy: bool) -> bool:
    slots = side.status()["slots"]
    return len(slots) > slot and slots[slot]["task"] is not None and slots[slot]["processing"] is busy


def test_sigterm_saves_the_idle_slot_and_sends_nothing_to_the_busy_one(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    side = sidecar(
        server, slot_dir, extra={"--idle-seconds": "600", "--snapshot-interval": "600", "--final-timeout": str(FINAL)}
    )
    complete(server.url, make_prompt(server.url, TOKENS, seed=122), id_slot=0)
    story = make_prompt(server.url, 300, seed=123) + " Now tell a long story."  # above --min-tokens 100
    threading.Thread(target=_generate, args=(server.url, story), daemon=True).start()
    side.wait_for(lambda: _seen(side, 0, busy=False) and _seen(side, 1, busy=True), what="slot 0 used, slot 1 busy")
    assert manifests(slot_dir) == []

    started = time.monotonic()
    code = side.terminate(timeout=30)
    took = time.monotonic() - started
    # llama-server would hold a save of the busy slot until its 4,000-token request ends: the sidecar
    # sends none, so it exits long before --final-timeout, with the idle slot saved.
    assert code == 0, side.tail()
    assert took < FINAL, f"exited after {took:.1f} s with --final-timeout {FINAL}"
    committed = side.log_events("snapshot_committed")
    assert [(e["slot"], e["reason"]) for e in committed] == [(0, "final")]
    assert [e["slot"] for e in side.log_events("snapshot_skipped_busy")] == [1]
    assert side.log_events("final_snapshot_timeout") == []
    assert [json.loads((slot_dir / m).read_text())["slot"] for m in manifests(slot_dir)] == [0]
