"""``--store-dir`` under faults, against the real llama-server: a full or read-only store disk, a slot dir
(tmpfs) too small for a slot file, and a second sidecar on the same store dir.

The disks are real: a small tmpfs mounted for the test (``tests.support.mounts``, needs root, which CI has),
filled with a file for "full" and remounted ``ro`` for "read-only". Root ignores file modes, so a
``chmod`` would prove nothing here; a remount makes the kernel refuse every write with ``EROFS``.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from tests.support import mounts, streams
from tests.support.llamabed import LlamaServer, MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, proxied

TOKENS = 1024


def _manifests(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "snapshots").glob("slot*.json"))


def _blocks(store: Path) -> set[str]:
    return {p.name for p in (store / "blocks").glob("*/*")}


def _leftovers(*dirs: Path) -> list[str]:
    """Staged files, links and temp files the sidecar would have left behind."""
    return sorted(str(p) for d in dirs if d.is_dir() for p in d.iterdir() if p.name.startswith(".tmp-"))


def _turn(proxy: str, prompt: str) -> dict[str, Any]:
    answer = complete(proxy, prompt, n_predict=4)
    assert answer["content"] is not None
    return answer


def _tokens(answer: dict[str, Any]) -> int:
    """Tokens of the prompt the answer was for (prefilled and reused)."""
    return int(answer["timings"]["prompt_n"]) + _cached(answer)


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["timings"]["cache_n"])


def _wait_errors(side: SidecarProcess, reason: str, n: int) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshot_write_errors_total", reason=reason) >= n,
        what=f"{n} save(s) refused by the store disk ({reason})",
    )


def test_a_full_then_read_only_store_disk_skips_saves_keeps_serving_and_resumes_by_itself(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """A 64 MiB tmpfs as the store: filled with a file (ENOSPC), then remounted read-only (EROFS).

    The disk fills behind the free-space estimate's back (a full disk the estimate sees is the
    ``snapshot_skipped_low_disk`` case): slot 0's save is made while slot 1 generates, its commit
    waits for the generation, and the disk is filled meanwhile.
    """
    with mounts.tmpfs(tmp_path / "store", "64m") as store:
        server: LlamaServer = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
        side, proxy = proxied(sidecar, server, slot_dir, extra={"--store-dir": str(store), "--save-hold-seconds": "0"})
        first = make_prompt(server.url, TOKENS, seed=81)
        complete(server.url, first, n_predict=4, id_slot=0)
        side.wait_saved()
        committed, held = _manifests(store), _blocks(store)
        assert committed
        assert held

        # Full: a new conversation's blocks (about 10 MB) do not fit in the 1 MiB left.
        stream = streams.Stream(server.port, 1, make_prompt(server.url, 100, seed=80))
        try:
            side.wait_for(
                lambda: any(v["id"] == 1 and v["processing"] for v in side.status()["slots"]),
                what="slot 1 generating",
            )
            other = make_prompt(server.url, TOKENS, seed=82)
            complete(server.url, other, n_predict=4, id_slot=0)
            side.wait_for(lambda: side.log_events("snapshot_commit_deferred"), what="slot 0 saved, commit waiting")
            assert stream.running, "the generation ended before the disk was filled"
            filler = store / "filler"
            filler.write_bytes(bytes(max(0, mounts.free_bytes(store) - (1 << 20))))
        finally:
            stream.stop()
        _wait_errors(side, "no_space", 1)
        said = side.log_events("snapshot_store_unwritable")
        assert [e["reason"] for e in said] == ["no_space"], said
        assert "free space" in said[0]["hint"], said[0]
        assert "still restore" in said[0]["effect"], said[0]
        assert _manifests(store) == committed
        assert _blocks(store) == held, "the failed ingest's blocks are collected, the committed ones kept"
        assert side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") == 1

        # Still full: the next save is skipped without asking llama-server to save; serving goes on.
        other += " " + make_prompt(server.url, 64, seed=83)
        _turn(proxy, other)
        side.wait_for(
            lambda: side.metric("llama_sidecar_snapshots_total", result="skipped") >= 1, what="a save skipped"
        )
        assert side.metric("llama_sidecar_snapshot_write_errors_total", reason="no_space") == 1
        assert len(side.log_events("snapshot_store_unwritable")) == 1, "one line per episode"
        assert _leftovers(slot_dir, store / "staging") == []

        # Space back: the next save commits, and says so.
        filler.unlink()
        other += " " + make_prompt(server.url, 64, seed=84)
        answer = _turn(proxy, other)
        held_tokens = _tokens(answer)
        side.wait_for(lambda: side.log_events("snapshot_store_writable_again"), what="saves resumed")
        side.wait_for(
            lambda: any(e["tokens"] >= held_tokens for e in side.log_events("snapshot_committed")),
            what="the conversation's latest turn committed",
        )

        # Read-only: the save fails with read_only, and what was committed still restores after a kill -9.
        mounts.remount(store, "ro")
        try:
            committed = _manifests(store)
            _turn(proxy, other + " " + make_prompt(server.url, 64, seed=85))
            side.wait_for(
                lambda: (
                    [e["reason"] for e in side.log_events("snapshot_store_unwritable")] == ["no_space", "read_only"]
                ),
                what="the read-only disk said",
            )
            assert side.metric("llama_sidecar_snapshot_write_errors_total", reason="read_only") == 1
            server.restart(graceful=False)
            side.wait_restored()
            warm = _turn(proxy, other + " and the next question")
            assert _cached(warm) >= 0.9 * held_tokens, warm["timings"]
            assert _manifests(store) == committed, "nothing committed was lost"
        finally:
            mounts.remount(store, "rw")
        _turn(proxy, other + " " + make_prompt(server.url, 64, seed=86))
        side.wait_for(lambda: len(side.log_events("snapshot_store_writable_again")) == 2, what="saves resumed after rw")
        assert side.get("/healthz")[0] == 200
        assert _leftovers(slot_dir) == []
        side.terminate()


def test_a_slot_dir_too_small_for_the_slot_file_stages_it_on_the_store_disk(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    """A 12 MiB tmpfs as the slot dir: a 2,048-token slot file (about 14 MB) cannot be staged in it.

    Before, llama-server's write into the slot dir failed (the save failed) and a restore could not be
    rebuilt there; now both go through a link to ``STORE/staging`` and work.
    """
    store = tmp_path / "store"
    with mounts.tmpfs(tmp_path / "slots", "12m") as slots:
        server = llama(slot_dir=slots, ctx_size=4096)
        side = sidecar(server, slots, extra={"--store-dir": str(store), "--min-free-bytes": "0"})
        complete(server.url, make_prompt(server.url, 300, seed=91))  # about 6 MB: staged in RAM
        side.wait_saved()
        assert side.metric("llama_sidecar_store_staged_on_disk_total", reason="no_room") == 0
        prompt = make_prompt(server.url, 2 * TOKENS, seed=92)
        cold = complete(server.url, prompt)
        side.wait_saved(n=2)
        staged = side.log_events("snapshot_staged_on_disk")
        assert [e["reason"] for e in staged] == ["no_room"], staged
        assert side.metric("llama_sidecar_store_staged_on_disk_total", reason="no_room") == 1
        newest = json.loads((store / "snapshots" / _manifests(store)[-1]).read_text())
        assert newest["bytes"] > mounts.free_bytes(slots), "the file is larger than the slot dir could hold"
        assert _leftovers(slots, store / "staging") == []
        assert side.metric("llama_sidecar_store_staged_bytes") == 0

        server.restart(graceful=False)  # the restore's rebuild does not fit in the slot dir either
        side.wait_restored()
        assert side.metric("llama_sidecar_store_staged_on_disk_total", reason="no_room") == 2
        warm = complete(server.url, prompt + " and then")
        assert warm["timings"]["cache_n"] >= 0.95 * cold["timings"]["prompt_n"]
        assert _leftovers(slots, store / "staging") == []
        assert side.metric("llama_sidecar_store_staged_bytes") == 0
        side.terminate()


def test_a_second_sidecar_on_the_same_store_dir_is_refused_and_drops_nothing(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """Two sidecars, each with a slot dir of its own, one store dir: the second exits 2 naming the first.

    Its start-up would have dropped a recipe the first had committed without its manifest yet (an ingest
    in flight looks like one that died); here such a recipe stays.
    """
    store = tmp_path / "store"
    server = llama(slot_dir=slot_dir)
    first = sidecar(server, slot_dir, extra={"--store-dir": str(store)})
    assert first.proc is not None
    complete(server.url, make_prompt(server.url, TOKENS, seed=93))
    first.wait_saved()
    in_flight = store / "recipes" / "slot0-20260101T000000.000000Z.json"  # as if mid-ingest: no manifest yet
    in_flight.write_text((store / "recipes" / (Path(_manifests(store)[0]).stem + ".json")).read_text())

    other_slots = tmp_path / "other-slots"
    other_slots.mkdir()
    second = SidecarProcess(server.url, other_slots, tmp_path / "second.log", extra={"--store-dir": str(store)})
    assert second.run_to_exit(30) == 2
    said = second.log_path.read_text()
    assert "another llama-kv-sidecar holds the store dir" in said, said
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in said
    assert "--store-dir of its own" in said
    assert in_flight.exists(), "the second's start-up never ran"
    assert second.get("/healthz")[0] == 0  # it never listened

    complete(server.url, make_prompt(server.url, TOKENS * 2, seed=94))
    first.wait_saved(n=2)
    assert first.get("/readyz")[0] == 200
