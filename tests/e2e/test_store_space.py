"""``--min-free-bytes`` with ``--store-dir``, against the real llama-server: the floor counts what a save writes
on the store's disk (its new blocks, not the whole slot file), and a store at the floor deletes its least
recently used snapshots to make room instead of skipping every save from then on.

The store's disk is a 64 MiB tmpfs mounted for the test (``tests.support.mounts``, needs root, which CI has),
brought near the floor with a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import mounts
from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, manifest_records, manifests, proxied

FLOOR = 8 << 20


def _tokens(answer: dict[str, Any]) -> int:
    return int(answer["timings"]["prompt_n"]) + int(answer["timings"]["cache_n"])


def _fill(store: Path, leave: int) -> Path:
    """A file on the store's disk that leaves ``leave`` bytes free."""
    filler = store / "filler"
    filler.write_bytes(bytes(max(0, mounts.free_bytes(store) - leave)))
    return filler


def test_a_store_disk_with_room_for_the_new_blocks_but_not_a_whole_file_takes_the_save(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """Before, the floor held the store's disk against the whole slot file and skipped this save."""
    with mounts.tmpfs(tmp_path / "store", "64m") as store:
        server = llama(slot_dir=slot_dir, ctx_size=4096)
        side = sidecar(server, slot_dir, extra={"--store-dir": str(store), "--min-free-bytes": str(FLOOR)})
        complete(server.url, make_prompt(server.url, 600, seed=120), n_predict=4)  # sizes of two token counts:
        side.wait_saved()  # what grows with the tokens, what a save writes again (the sliding window's rows)
        prompt = make_prompt(server.url, 1400, seed=121)
        complete(server.url, prompt, n_predict=4)
        side.wait_saved(n=2)
        whole = max(m["bytes"] for m in manifest_records(store / "snapshots"))
        _fill(store, FLOOR + whole - whole // 8)  # the next turn's ~100 new tokens write about three quarters
        assert mounts.free_bytes(store) - whole < FLOOR, "a whole file would go below the floor"

        complete(server.url, prompt + " " + make_prompt(server.url, 100, seed=122), n_predict=4)
        side.wait_saved(n=3)
        assert side.log_events("snapshot_skipped_low_disk") == []
        assert side.metric("llama_sidecar_gc_deleted_total", reason="space") == 0
        assert mounts.free_bytes(store) >= FLOOR, "the floor held"
        assert len(manifests(store / "snapshots")) == 3
        side.terminate()


def test_a_store_at_the_floor_deletes_the_least_recently_used_saves_the_new_one_and_the_rest_restore(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """One slot, three conversations in the library, the store's disk at the floor: a fourth evicts the first."""
    with mounts.tmpfs(tmp_path / "store", "64m") as store:
        server = llama(slot_dir=slot_dir, ctx_size=4096)
        side, proxy = proxied(
            sidecar, server, slot_dir, extra={"--store-dir": str(store), "--min-free-bytes": str(FLOOR)}
        )
        prompts = [make_prompt(server.url, 600, seed=seed) for seed in (131, 132, 133)]
        held: list[int] = []
        for n, prompt in enumerate(prompts, start=1):
            held.append(_tokens(complete(proxy, prompt, n_predict=4)))
            side.wait_saved(n=n)
        first, *kept = manifests(store / "snapshots")
        assert len(kept) == 2
        whole = max(m["bytes"] for m in manifest_records(store / "snapshots"))
        filler = _fill(store, FLOOR + whole // 2)  # a new conversation's whole file does not fit above the floor

        newest = make_prompt(server.url, 500, seed=134)  # fewer tokens than the slot's last: not its growth
        held.append(_tokens(complete(proxy, newest, n_predict=4)))
        side.wait_saved(n=4)
        said = side.log_events("snapshots_evicted_for_space")
        assert len(said) == 1, said
        assert (said[0]["count"], said[0]["disk"], said[0]["min_free_bytes"]) == (1, "store", FLOOR)
        assert said[0]["free_bytes_after"] > said[0]["free_bytes_before"]
        assert "--max-bytes" in said[0]["hint"]
        assert side.metric("llama_sidecar_gc_deleted_total", reason="space") == 1
        left = manifests(store / "snapshots")
        assert first not in left
        assert set(kept) < set(left)
        assert len(left) == 3
        assert side.log_events("snapshot_skipped_low_disk") == []
        assert mounts.free_bytes(store) >= FLOOR, "the floor held"

        filler.unlink()  # room again: the turns below save without deleting anything more
        for prompt, tokens in zip([*prompts[1:], newest], held[1:], strict=True):
            warm = complete(proxy, prompt + " and then", n_predict=4)
            assert warm["timings"]["cache_n"] >= 0.9 * tokens, warm["timings"]
        assert side.metric("llama_sidecar_gc_deleted_total", reason="space") == 1
        side.terminate()
