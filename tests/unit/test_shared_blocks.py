"""The shared store moving blocks (nodes with --store-dir), on a real S3 server (SeaweedFS) and a directory."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import structlog.testing

from sidecar.core import events, location
from sidecar.shared import fence, gc, keys, objstore
from tests.support.sharednodes import IDENTITY, committed, node, slot_file, url_of

KV = 3 << 20


def _kinds(listed: list[objstore.ObjectInfo]) -> set[str]:
    return {i.key.split("/")[-2] if "/recipes/" not in i.key else "recipes" for i in listed}


async def test_a_second_snapshot_sharing_a_prefix_uploads_and_fetches_only_new_blocks(
    objects: objstore.ObjectStore, tmp_path: Path
) -> None:
    where = location.parse(url_of(objects, tmp_path), os.environ)
    snaps_a, shared_a, stats_a = node(tmp_path / "a", where, store_dir=tmp_path / "store-a")
    snaps_b, shared_b, stats_b = node(tmp_path / "b", where, store_dir=tmp_path / "store-b")
    first_bytes = slot_file(list(range(600)), KV)
    second_bytes = first_bytes + os.urandom(KV // 8)  # the same conversation, further on
    first = committed(snaps_a, first_bytes)
    assert await shared_a.uploader.publish(first)
    sent_first = stats_a("shared_store_block_bytes_total", direction="up", outcome="transferred")
    assert sent_first >= first.bytes  # every block was new, plus the recipe
    ns = shared_a.namespace(IDENTITY)
    assert _kinds(await objects.list_objects(keys.join(where.key_prefix, ns) + "/")) == {
        "blocks",
        "recipes",
        "manifests",
    }  # no blob: the file is only ever in blocks
    second = committed(snaps_a, second_bytes, tokens=700)
    assert await shared_a.uploader.publish(second)
    sent_second = stats_a("shared_store_block_bytes_total", direction="up", outcome="transferred") - sent_first
    assert sent_second < 0.3 * second.bytes, (sent_second, second.bytes)
    assert stats_a("shared_store_block_bytes_total", direction="up", outcome="skipped") > 0.7 * second.bytes
    assert stats_a("shared_store_objects_total", direction="up") == 2

    found = {r.snapshot.checksum: r for r in await shared_b.catalog.records(ns)}
    assert all(r.recipe and not r.blob for r in found.values())
    assert await shared_b.transfer_bytes(found[second.checksum]) > 0.95 * second.bytes  # node B holds nothing yet
    got_first = await shared_b.fetch(found[first.checksum], slot=0)
    assert got_first is not None
    priced = await shared_b.transfer_bytes(found[second.checksum])  # what a fetch-or-prefill decision weighs
    assert 0 < priced < 0.3 * second.bytes, priced
    fetched_first = stats_b("shared_store_bytes_total", direction="down")
    got_second = await shared_b.fetch(found[second.checksum], slot=1)
    assert got_second is not None
    fetched_second = stats_b("shared_store_bytes_total", direction="down") - fetched_first
    assert fetched_second < 0.3 * second.bytes, (fetched_second, second.bytes)
    for got, data in ((got_first, first_bytes), (got_second, second_bytes)):
        name = snaps_b.staged.stage(got)
        assert (snaps_b.staging / name).read_bytes() == data
        snaps_b.staged.unstage(name, got)
    assert not [p for p in snaps_b.staging.iterdir()]  # nothing of the fetch left in the slot dir
    await shared_a.close()
    await shared_b.close()


async def test_nodes_with_and_without_a_block_store_read_each_others_snapshots(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_blocks, shared_blocks, _ = node(tmp_path / "a", where, store_dir=tmp_path / "store-a")
    snaps_whole, shared_whole, _ = node(tmp_path / "b", where)
    from_blocks = slot_file(list(range(300)), 1 << 20)
    from_whole = slot_file(list(range(5000, 5300)), 1 << 20)
    assert await shared_blocks.uploader.publish(committed(snaps_blocks, from_blocks))
    assert await shared_whole.uploader.publish(committed(snaps_whole, from_whole))
    ns = shared_blocks.namespace(IDENTITY)
    listed = await shared_blocks.catalog.records(ns)
    (blocks_record,) = [r for r in listed if r.recipe]
    (whole_record,) = [r for r in listed if r.blob]
    got_whole = await shared_whole.fetch(blocks_record, slot=1)  # a node without --store-dir, a block snapshot
    assert got_whole is not None
    assert (snaps_whole.dir / got_whole.file).read_bytes() == from_blocks
    assert not [p for p in snaps_whole.dir.iterdir() if p.name.startswith(".")]  # its temporary blocks are gone
    got_blocks = await shared_blocks.fetch(whole_record, slot=1)  # a node with --store-dir, a whole blob
    assert got_blocks is not None
    name = snaps_blocks.staged.stage(got_blocks)
    assert (snaps_blocks.staging / name).read_bytes() == from_whole
    snaps_blocks.staged.unstage(name, got_blocks)
    await shared_blocks.close()
    await shared_whole.close()


async def test_a_corrupt_block_in_the_shared_store_refuses_only_the_snapshots_naming_it(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_a, shared_a, _ = node(tmp_path / "a", where, store_dir=tmp_path / "store-a")
    snaps_b, shared_b, stats_b = node(tmp_path / "b", where, store_dir=tmp_path / "store-b")
    bad = committed(snaps_a, slot_file(list(range(300)), 1 << 20))
    good = committed(snaps_a, slot_file(list(range(7000, 7300)), 1 << 20))
    assert await shared_a.uploader.publish(bad)
    assert snaps_a.blocks is not None
    good_digests = {d for d, _ in snaps_a.blocks.digests(good)}
    victim = next(d for d, _ in snaps_a.blocks.digests(bad) if d not in good_digests)
    (path,) = (tmp_path / "shared").rglob(f"{victim}.blk")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await shared_a.uploader.publish(good)
    found = {r.snapshot.checksum: r for r in await shared_b.catalog.records(shared_b.namespace(IDENTITY))}
    with structlog.testing.capture_logs() as logs:
        assert await shared_b.fetch(found[bad.checksum], slot=0) is None
    (refused,) = [e for e in logs if e["event"] == "shared_snapshot_refused"]
    assert refused["reason"] == "corrupt"
    assert victim in refused["detail"]
    assert stats_b("shared_store_refused_total", reason="corrupt") == 1
    assert snaps_b.snapshots() == []
    got = await shared_b.fetch(found[good.checksum], slot=1)  # every snapshot not naming the block still comes
    assert got is not None
    assert [m.checksum for m in snaps_b.snapshots()] == [good.checksum]
    await shared_a.close()
    await shared_b.close()


async def test_an_upload_waits_for_a_collection_in_progress_and_sends_again_what_it_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fence, "POLL", 0.05)
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_a, shared_a, _ = node(tmp_path / "a", where, store_dir=tmp_path / "store-a")
    snaps_b, shared_b, _ = node(tmp_path / "b", where, store_dir=tmp_path / "store-b")
    data = slot_file(list(range(300)), 1 << 20)
    first = committed(snaps_a, data)
    assert await shared_a.uploader.publish(first)
    ns = shared_a.namespace(IDENTITY)
    # The same file again on node B while a collection runs: its blocks are all there already ...
    marker = keys.gc_marker(where.key_prefix, time.time(), "test")
    objects = shared_a.objects
    await objects.put_bytes(marker, b"")
    await objects.delete([keys.shared_manifest(where.key_prefix, ns, first.checksum)])
    again = committed(snaps_b, data)
    publishing = asyncio.create_task(shared_b.uploader.publish(again))
    await asyncio.sleep(0.5)
    assert not publishing.done()  # ... and it waits for the collection before publishing
    # ... which deletes blocks it listed as unreferenced before node B's recipe existed.
    block_keys = [i.key for i in await objects.list_objects(keys.join(where.key_prefix, ns, keys.BLOCKS) + "/")]
    await objects.delete(block_keys)
    await objects.delete([marker])
    assert await asyncio.wait_for(publishing, 30)
    found = await shared_b.catalog.records(ns)
    _, shared_c, _ = node(tmp_path / "c", where, store_dir=tmp_path / "store-c")
    got = await shared_c.fetch(found[0], slot=0)  # every block is there: the upload sent them again
    assert got is not None
    for shared in (shared_a, shared_b, shared_c):
        await shared.close()


# ---- gc plan with blocks ------------------------------------------------------------------

NS = "team/m-0123"
HOUR = 3600.0
NOW = 100 * HOUR


def _o(key: str, *, age: float, size: int = 0) -> objstore.ObjectInfo:
    return objstore.ObjectInfo(f"{NS}/{key}", size, NOW - age)


def _plan(objs: list[objstore.ObjectInfo], recipes: gc.Blocks, **kw: float) -> gc.Plan:
    return gc.plan(
        objs,
        now=NOW,
        max_age=kw.get("max_age", 0),
        max_bytes=int(kw.get("max_bytes", 0)),
        grace=HOUR,
        recipes={f"{NS}/{k}": v for k, v in recipes.items()},
    )


def test_gc_never_deletes_a_block_a_published_or_pending_recipe_names() -> None:
    objs = [
        _o("manifests/s1.json", age=50 * HOUR),
        _o("recipes/s1/1-a.json", age=50 * HOUR),
        _o("recipes/s2/2-b.json", age=0.1 * HOUR),  # an upload in progress: no manifest yet
        _o("blocks/aa.blk", age=50 * HOUR, size=10),
        _o("blocks/bb.blk", age=50 * HOUR, size=10),
        _o("blocks/cc.blk", age=50 * HOUR, size=10),  # named by nothing, old
        _o("blocks/dd.blk", age=0.5 * HOUR, size=10),  # named by nothing, younger than the grace
    ]
    plan = _plan(objs, {"recipes/s1/1-a.json": frozenset({"aa"}), "recipes/s2/2-b.json": frozenset({"bb"})})
    assert plan.unpublish == ()
    assert plan.delete == (f"{NS}/blocks/cc.blk",)
    assert plan.kept_bytes == 10


def test_gc_deletes_a_dead_uploads_recipe_and_then_its_blocks() -> None:
    objs = [_o("recipes/s2/2-b.json", age=2 * HOUR), _o("blocks/bb.blk", age=2 * HOUR, size=10)]
    plan = _plan(objs, {"recipes/s2/2-b.json": frozenset({"bb"})})
    assert plan.delete == (f"{NS}/blocks/bb.blk", f"{NS}/recipes/s2/2-b.json")


def test_gc_keeps_every_block_of_a_namespace_with_an_unreadable_recipe() -> None:
    objs = [_o("recipes/s2/2-b.json", age=0.1 * HOUR), _o("blocks/cc.blk", age=50 * HOUR, size=10)]
    assert _plan(objs, {"recipes/s2/2-b.json": None}).delete == ()


def test_gc_unpublishes_blocks_then_deletes_them_after_the_tombstones_grace() -> None:
    objs = [
        _o("manifests/old.json", age=50 * HOUR),
        _o("recipes/old/1-a.json", age=50 * HOUR),
        _o("manifests/new.json", age=HOUR),
        _o("recipes/new/2-a.json", age=HOUR),
        _o("blocks/shared.blk", age=50 * HOUR, size=10),
        _o("blocks/oldonly.blk", age=50 * HOUR, size=10),
    ]
    recipes = {"recipes/old/1-a.json": frozenset({"shared", "oldonly"}), "recipes/new/2-a.json": frozenset({"shared"})}
    first = _plan(objs, recipes, max_age=24 * HOUR)
    assert first.unpublish == (f"{NS}/manifests/old.json",)
    assert first.delete == ()  # a node may be fetching it: its recipe and blocks wait for the grace
    later = [o for o in objs if o.key != f"{NS}/manifests/old.json"] + [_o("gone/old@1", age=2 * HOUR)]
    second = _plan(later, recipes, max_age=24 * HOUR)
    assert second.delete == (f"{NS}/blocks/oldonly.blk", f"{NS}/gone/old@1", f"{NS}/recipes/old/1-a.json")


def test_gc_byte_cap_counts_a_block_shared_by_snapshots_once() -> None:
    objs = [
        _o("manifests/s1.json", age=3 * HOUR),
        _o("recipes/s1/1.json", age=3 * HOUR),
        _o("manifests/s2.json", age=2 * HOUR),
        _o("recipes/s2/2.json", age=2 * HOUR),
        _o("blocks/p.blk", age=3 * HOUR, size=100),
        _o("blocks/x.blk", age=3 * HOUR, size=10),
        _o("blocks/y.blk", age=2 * HOUR, size=10),
    ]
    recipes = {"recipes/s1/1.json": frozenset({"p", "x"}), "recipes/s2/2.json": frozenset({"p", "y"})}
    assert _plan(objs, recipes, max_bytes=120).unpublish == ()  # 100 shared + 10 + 10
    capped = _plan(objs, recipes, max_bytes=115)
    assert capped.unpublish == (f"{NS}/manifests/s1.json",)
    assert capped.kept_bytes == 110


async def test_warm_fetches_block_snapshots_into_empty_slots_of_a_store_dir_node(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_a, shared_a, _ = node(tmp_path / "a", where, store_dir=tmp_path / "store-a")
    _, shared_b, stats_b = node(tmp_path / "b", where, store_dir=tmp_path / "store-b")
    head = slot_file(list(range(300)), 1 << 20)
    for data in (head, head + os.urandom(1 << 16)):
        assert await shared_a.uploader.publish(committed(snaps_a, data))
    slots = (events.SlotView(0, 4096, False, None, 0), events.SlotView(1, 4096, False, None, 0))
    got = await shared_b.warm(IDENTITY, slots)
    assert sorted(m.slot for m in got) == [0, 1]
    assert stats_b("shared_store_block_bytes_total", direction="down", outcome="skipped") > 0.5 * len(head)
    await shared_a.close()
    await shared_b.close()


def test_gc_leaves_an_upload_in_progress_alone_whatever_its_grace() -> None:
    """A short --grace, and a snapshot unpublished long ago being uploaded again: its new recipe and blocks stay."""
    objs = [
        _o("gone/s1@1", age=2 * HOUR),
        _o("recipes/s1/9-new.json", age=300),  # written 5 minutes ago, its manifest not yet
        _o("blocks/aa.blk", age=50 * HOUR, size=10),  # found in the store by that upload, and relied on
    ]
    plan = gc.plan(
        objs, now=NOW, max_age=0, max_bytes=0, grace=60, recipes={f"{NS}/recipes/s1/9-new.json": frozenset({"aa"})}
    )
    assert plan.delete == (f"{NS}/gone/s1@1",)
