"""Facts about the real llama-server that the sidecar relies on."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.llamabed import MakeServer, build_of, call, complete, http_json, make_prompt, slot_action, tokenize

TAIL = " and then the caravan went home"


def test_prompt_cache_reuses_a_long_prefix(llama: MakeServer) -> None:
    server = llama()
    prompt = make_prompt(server.url, 2100, seed=1)
    n = len(tokenize(server.url, prompt))
    assert n >= 2000
    first = complete(server.url, prompt)
    assert first["timings"]["prompt_n"] >= n  # cold: everything prefilled
    second = complete(server.url, prompt + TAIL)
    assert second["timings"]["cache_n"] >= 0.95 * n


def test_save_kill9_restart_restore_reuses_kv(llama: MakeServer, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    prompt = make_prompt(server.url, 2100, seed=2)
    n = len(tokenize(server.url, prompt))
    complete(server.url, prompt, id_slot=0)
    saved = slot_action(server.url, 0, "save", "conv.bin")
    assert saved["n_saved"] >= n
    assert (slot_dir / "conv.bin").stat().st_size == saved["n_written"]

    server.restart(graceful=False)
    restored = slot_action(server.url, 0, "restore", "conv.bin")
    assert restored["n_restored"] == saved["n_saved"]
    after = complete(server.url, prompt + TAIL, id_slot=0)
    assert after["timings"]["cache_n"] >= 0.95 * n


@pytest.mark.parametrize("name", ["a/b.bin", "../x.bin", "..", "sub/../x.bin"])
def test_filename_with_path_is_rejected(llama: MakeServer, slot_dir: Path, name: str) -> None:
    server = llama(slot_dir=slot_dir)
    for action in ("save", "restore"):
        status, body = http_json("POST", f"{server.url}/slots/0?action={action}", {"filename": name})
        assert status == 400, (action, body)
    assert not list(slot_dir.parent.rglob("x.bin"))


def test_slot_actions_need_slot_save_path(llama: MakeServer) -> None:
    server = llama(slot_dir=None)
    for action in ("save", "restore", "erase"):
        status, body = http_json("POST", f"{server.url}/slots/0?action={action}", {"filename": "a.bin"})
        assert status == 501, (action, body)


def test_saving_an_empty_slot_saves_zero_tokens(llama: MakeServer, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    saved = slot_action(server.url, 0, "save", "empty.bin")
    assert saved["n_saved"] == 0
    assert (slot_dir / "empty.bin").stat().st_size == saved["n_written"]


def _start_time(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return int(resp.headers["Process-Start-Time-Unix"])


def test_the_server_is_the_checked_build_and_its_start_time_header_changes_with_the_process(
    llama: MakeServer, llama_binary: Path
) -> None:
    # Despite its name the header is ggml_time_us() at start: CLOCK_MONOTONIC microseconds, not
    # Unix time. Only its equality within one process, and change across processes, can be used.
    before = time.monotonic()
    server = llama()
    assert call("GET", server.url + "/props")["build_info"] == build_of(llama_binary)
    first = _start_time(server.url)
    assert before * 1e6 <= first <= time.monotonic() * 1e6
    assert _start_time(server.url) == first  # the same process: the same value
    restarted_at = time.monotonic()
    server.restart(graceful=False)
    second = _start_time(server.url)
    assert restarted_at * 1e6 <= second <= time.monotonic() * 1e6
    assert second > first
