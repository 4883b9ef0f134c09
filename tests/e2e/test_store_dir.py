"""``--store-dir``: snapshots kept as blocks, the slot dir only staging, against the real llama-server."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.core import protocols
from sidecar.snapshots import staging, store
from tests.support import mounts, widekv
from tests.support.llamabed import LlamaServer, MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, proxied

PROMPT_TOKENS = 2048


def _store_manifests(store: Path) -> list[dict[str, object]]:
    found = []
    for path in sorted((store / "snapshots").glob("slot*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except FileNotFoundError:
            continue
    return found


def _blocks(store: Path) -> list[Path]:
    return [p for p in (store / "blocks").glob("*/*") if not p.name.startswith(".")]


def _recipe_digests(store: Path, name: str) -> set[str]:
    made = json.loads((store / "recipes" / f"{name}.json").read_text())
    text = json.dumps(made)
    return {
        word
        for word in text.replace('"', " ").split()
        if len(word) == 64 and all(c in "0123456789abcdef" for c in word)
    }


def _staged(slot_dir: Path) -> list[str]:
    """Files of the slot dir the sidecar would have left: slot files, staged rebuilds."""
    return sorted(p.name for p in slot_dir.iterdir() if p.suffix == ".bin")


def test_a_save_goes_into_blocks_and_comes_back_after_kill9(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    store = tmp_path / "store"
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--store-dir": str(store)})
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=1)
    cold = complete(server.url, prompt)
    side.wait_saved()
    side.wait_for(lambda: len(_store_manifests(store)) == 1, what="a manifest in the store")
    record = _store_manifests(store)[0]
    assert record["recipe"], record
    assert _staged(slot_dir) == [], "the staged slot file is deleted once ingested"
    assert not list(slot_dir.glob("slot*.json")), "no manifest in the slot dir"
    blocks = _blocks(store)
    assert blocks
    side.wait_for(
        lambda: side.metric("llama_sidecar_store_written_bytes_total", kind="blocks") > 0, what="blocks counted"
    )
    assert side.metric("llama_sidecar_store_written_bytes_total", kind="manifests") > 0
    unique = side.wait_for(lambda: side.metric("llama_sidecar_store_unique_bytes"), what="unique bytes")
    assert unique == sum(p.stat().st_size for p in blocks)
    assert side.metric("llama_sidecar_store_represented_bytes") == record["bytes"]

    server.restart(graceful=False)
    side.wait_restored()
    warm = complete(server.url, prompt + " and then a few more words")
    n_prompt = cold["timings"]["prompt_n"]
    figure(
        f"--store-dir, after kill -9: {warm['timings']['cache_n']} of {n_prompt} tokens reused from a slot "
        f"rebuilt from {len(blocks)} blocks ({record['bytes']} bytes)"
    )
    assert warm["timings"]["cache_n"] >= 0.95 * n_prompt
    side.wait_for(lambda: _staged(slot_dir) == [], what="the staged rebuild deleted after the restore")


def _spoil(block: Path, how: str) -> None:
    """Flip a byte (same size: only the checksum can tell), cut the block in half, or delete it."""
    data = bytearray(block.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
        block.write_bytes(bytes(data))
    elif how == "truncate":
        block.write_bytes(bytes(data[: len(data) // 2]))
    else:
        block.unlink()


@pytest.mark.parametrize(("how", "reason"), [("flip", "checksum"), ("truncate", "size"), ("missing", "size")])
def test_a_corrupt_truncated_or_missing_block_refuses_that_snapshot_only(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path, how: str, reason: str
) -> None:
    store = tmp_path / "store"
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir, extra={"--store-dir": str(store)})
    prompts = [make_prompt(server.url, PROMPT_TOKENS, seed=20 + i) for i in range(2)]
    colds = []
    for slot, prompt in enumerate(prompts):
        colds.append(complete(server.url, prompt, id_slot=slot))
        side.wait_saved(slot=slot)
    side.wait_for(lambda: len(_store_manifests(store)) == 2, what="two manifests in the store")
    by_slot = {int(str(m["slot"])): str(m["recipe"]) for m in _store_manifests(store)}
    own = sorted(_recipe_digests(store, by_slot[0]) - _recipe_digests(store, by_slot[1]))
    assert own, "slot 0's snapshot has blocks of its own"
    _spoil(store / "blocks" / own[len(own) // 2][:2] / own[len(own) // 2], how)

    server.restart(graceful=False)
    side.wait_restored(slot=1)
    side.wait_for(lambda: side.log_events("snapshot_corrupt"), what="the corrupt snapshot refused")
    corrupt = side.log_events("snapshot_corrupt")[0]
    assert corrupt["slot"] == 0, corrupt
    assert own[len(own) // 2] in corrupt["error"], corrupt  # names the block
    assert side.metric("llama_sidecar_snapshots_quarantined_total", reason=reason) == 1
    assert not [e for e in side.log_events("slot_restored") if e.get("slot") == 0]
    warm = complete(server.url, prompts[1] + " continued", id_slot=1)
    assert warm["timings"]["cache_n"] >= 0.95 * colds[1]["timings"]["prompt_n"]
    side.wait_for(lambda: _staged(slot_dir) == [], what="the staged rebuild deleted after the restore")


def test_whole_file_snapshots_of_an_earlier_run_are_moved_into_the_store(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    server = llama(slot_dir=slot_dir)
    before = sidecar(server, slot_dir)  # without --store-dir: a whole file in the slot dir
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=3)
    cold = complete(server.url, prompt)
    before.wait_saved()
    assert len(_staged(slot_dir)) == 1
    assert before.log_events("block_store_off"), "the cost of running without --store-dir is logged"
    before.kill()
    server.restart(graceful=False)
    after = sidecar(server, slot_dir, extra={"--store-dir": str(store)})
    after.wait_restored()
    converted = after.log_events("snapshots_converted")
    assert len(converted) == 1
    assert converted[0]["files"] == 1, converted
    after.wait_for(lambda: _staged(slot_dir) == [], what="the restore's rebuild given back (off its path)")
    assert not list(slot_dir.glob("slot*.json"))
    assert len(_store_manifests(store)) == 1
    warm = complete(server.url, prompt + " again")
    assert warm["timings"]["cache_n"] >= 0.95 * cold["timings"]["prompt_n"]


def test_the_library_swaps_conversations_through_the_store(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """Two conversations on one slot through the proxy, the server's RAM cache off: each return is a swap."""
    store = tmp_path / "store"
    server: LlamaServer = llama(slot_dir=slot_dir, n_slots=1, ctx_size=4096, extra_args=["--cache-ram", "0"])
    side, proxy = proxied(sidecar, server, slot_dir, extra={"--store-dir": str(store), "--server-cache-ram-bytes": "0"})
    prompts = [make_prompt(server.url, 600, seed=40 + i) for i in range(2)]
    firsts = [complete(proxy, p, n_predict=4) for p in prompts]
    again = complete(proxy, prompts[0] + " One more line.", n_predict=4)
    print(f"swap from the store: {again['timings']['cache_n']} of {firsts[0]['timings']['prompt_n']} tokens reused")
    assert again["timings"]["cache_n"] >= 0.9 * firsts[0]["timings"]["prompt_n"]
    assert side.metric("llama_sidecar_conversation_requests_total", source="library") >= 1
    side.wait_for(lambda: _staged(slot_dir) == [], what="the staged rebuild deleted after the swap")


def test_on_a_tmpfs_of_small_pages_each_swap_rebuilds_over_the_pages_of_the_last(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    """The rebuild a swap gave back stays as the one spare; the next swap's rebuild overwrites it, warm each time."""
    store = tmp_path / "store"
    with mounts.tmpfs(tmp_path / "slots", "256m") as slot_dir:
        server = llama(slot_dir=slot_dir, n_slots=1, ctx_size=4096, extra_args=["--cache-ram", "0"])
        side, proxy = proxied(
            sidecar, server, slot_dir, extra={"--store-dir": str(store), "--server-cache-ram-bytes": "0"}
        )
        assert side.log_events("slot_dir_small_pages"), "the slot dir is a tmpfs of small pages"
        prompts = [make_prompt(server.url, 600, seed=60 + i) for i in range(2)]
        firsts = [complete(proxy, p, n_predict=4) for p in prompts]
        inodes = []
        for turn in range(3):  # the first back, the second back, the first again: each a swap from the store
            back = turn % 2
            again = complete(proxy, prompts[back] + f" Line {turn}.", n_predict=4)
            assert again["timings"]["cache_n"] >= 0.9 * firsts[back]["timings"]["prompt_n"], (turn, again["timings"])
            side.wait_for(lambda: _staged(slot_dir) == [staging.SPARE], what="the rebuild kept as the one spare")
            inodes.append(os.stat(slot_dir / staging.SPARE).st_ino)
        assert len(set(inodes)) == 1, "every later rebuild wrote over the spare's pages"
        assert side.metric("llama_sidecar_conversation_requests_total", source="library") >= 3
        side.terminate()


def test_two_conversations_sharing_a_long_prefix_take_less_store_than_two_files_on_an_8b_class_kv(
    llama: MakeServer, sidecar: MakeSidecar, model: Path, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    slot_dir, store = tmp_path / "slots", tmp_path / "store"
    slot_dir.mkdir()
    wide = widekv.model(tokenizer_from=model)
    server = llama(slot_dir=slot_dir, n_slots=2, model=wide, ctx_size=4096, swa_full=False)
    side = sidecar(server, slot_dir, extra={"--store-dir": str(store)})
    prefix = make_prompt(server.url, 1500, seed=41)
    for slot, seed in enumerate((42, 43)):
        complete(server.url, prefix + " " + make_prompt(server.url, 250, seed=seed), n_predict=8, id_slot=slot)
        side.wait_saved(slot=slot, timeout=180)
    side.wait_for(lambda: len(_store_manifests(store)) == 2, what="two manifests in the store")
    files = sum(int(str(m["bytes"])) for m in _store_manifests(store))
    unique = sum(p.stat().st_size for p in _blocks(store))
    side.wait_for(
        lambda: side.metric("llama_sidecar_store_deduplicated_bytes_total") > 0, what="deduplicated bytes counted"
    )
    written = side.metric("llama_sidecar_store_written_bytes_total", kind="blocks")
    skipped = side.metric("llama_sidecar_store_deduplicated_bytes_total")
    figure(
        f"--store-dir, 8B-class KV, two conversations sharing a 1,500-word prompt: the store holds "
        f"{unique / 1e6:.0f} MB for {files / 1e6:.0f} MB of slot files ({unique / files:.1%}); blocks written "
        f"{written / 1e6:.0f} MB, not written {skipped / 1e6:.0f} MB"
    )
    assert unique < 0.8 * files
    assert written == unique
    assert _staged(slot_dir) == []


def test_a_restart_restores_the_files_rebuilt_while_the_server_loaded_unless_a_newer_snapshot_came(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """After a kill -9 the sidecar rebuilds each slot's snapshot while the server is down; the round uses them.

    A newer snapshot of slot 0 committed after that rebuild (here by another writer of the store: slot 1's
    file committed as slot 0's) is the one restored into slot 0, and the stale rebuild is deleted unused.
    """
    store_dir = tmp_path / "store"
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir, extra={"--store-dir": str(store_dir)})
    prompts = [make_prompt(server.url, 600, seed=60 + i) for i in range(2)]
    colds = []
    for slot, prompt in enumerate(prompts):
        colds.append(complete(server.url, prompt, id_slot=slot))
        side.wait_saved(slot=slot)
    side.wait_for(lambda: len(_store_manifests(store_dir)) == 2, what="two manifests in the store")

    server.kill()  # kill -9; started again below, once the rebuild ahead is done
    built = side.wait_for(lambda: side.log_events("restore_ahead_built"), what="the snapshots rebuilt ahead")
    assert built[0]["files"] == 2, built
    ahead_names = {n for n in _staged(slot_dir) if n.startswith(".tmp-restore-")}
    assert len(ahead_names) == 2, _staged(slot_dir)
    server.start()
    server.wait_healthy()
    side.wait_restored(slot=0)
    side.wait_restored(slot=1)
    assert side.metric("llama_sidecar_restore_ahead_total", outcome="used") == 2
    restored = {e["slot"]: e for e in side.log_events("slot_restored")}
    for slot, prompt in enumerate(prompts):
        warm = complete(server.url, prompt + " and a few more words", id_slot=slot)
        assert warm["timings"]["cache_n"] >= 0.95 * colds[slot]["timings"]["prompt_n"], (slot, restored[slot])
    side.wait_for(lambda: _staged(slot_dir) == [], what="the rebuilt files deleted after their restores")

    server.kill()
    side.wait_for(lambda: len(side.log_events("restore_ahead_built")) == 2, what="a second rebuild ahead")
    writer = store.SnapshotStore(slot_dir, clock=protocols.SystemClock(), store_dir=store_dir)
    writer.loader.scan(clean=False)
    theirs = next(m for m in writer.snapshots() if m.slot == 1)
    staged = writer.staged.stage(theirs)
    newer = writer.writer.commit(
        staged, slot=0, tokens=theirs.tokens, written=theirs.bytes, task=theirs.task, fingerprint=theirs.fingerprint
    )
    side.wait_for(lambda: side.metric("llama_sidecar_snapshot_files") == 3, what="the newer snapshot seen")
    server.start()
    server.wait_healthy()
    side.wait_restored(n=2, slot=0)
    side.wait_restored(n=2, slot=1)
    latest = [e for e in side.log_events("slot_restored") if e.get("slot") == 0][-1]
    assert latest["file"] == newer.file, latest
    assert side.metric("llama_sidecar_restore_ahead_total", outcome="used") == 3  # slot 1's, this time too
    assert side.metric("llama_sidecar_restore_ahead_total", outcome="unused") == 1  # slot 0's stale rebuild
    warm = complete(server.url, prompts[1] + " once more", id_slot=0)  # slot 0 holds conversation 1 now
    assert warm["timings"]["cache_n"] >= 0.95 * colds[1]["timings"]["prompt_n"]
    side.wait_for(lambda: _staged(slot_dir) == [], what="every staged file deleted")
