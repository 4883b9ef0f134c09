"""The shared store against a real S3 server (SeaweedFS) and a directory: objects, upload, fetch, outage, gc."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import time
import typing
from pathlib import Path

import pytest
import structlog
import structlog.testing
from prometheus_client import CollectorRegistry

from sidecar.core import apikeys, errors, events, location, metrics, protocols
from sidecar.shared import connect, gc, keys, objstore, service
from sidecar.snapshots import manifest, slotfile, store
from tests.support.s3bed import S3Server
from tests.support.sharednodes import FP, IDENTITY, Samples, committed, node, slot_file, url_of
from tests.support.wait import eventually


async def test_create_only_writes_stream_back_byte_for_byte(objects: objstore.ObjectStore, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(objstore.PART_BYTES * 2 + 12345))  # three parts on S3
    prefix = f"conf-{os.getpid()}"
    assert await objects.put_file(f"{prefix}/a/big.bin", big) is objstore.Written.CREATED
    other = tmp_path / "other.bin"
    other.write_bytes(b"another writer")
    assert await objects.put_file(f"{prefix}/a/big.bin", other) is objstore.Written.EXISTED
    got = b"".join([chunk async for chunk in objects.stream(f"{prefix}/a/big.bin")])
    assert got == big.read_bytes()
    assert await objects.put_bytes(f"{prefix}/a/small.json", b"{}") is objstore.Written.CREATED
    assert await objects.put_bytes(f"{prefix}/a/small.json", b"[]") is objstore.Written.EXISTED
    assert await objects.get_bytes(f"{prefix}/a/small.json", limit=2) == b"{}"
    with pytest.raises(errors.SharedObjectRefused) as oversized:
        await objects.get_bytes(f"{prefix}/a/small.json", limit=1)
    assert oversized.value.reason == "oversized"
    head = await objects.head(f"{prefix}/a/big.bin")
    assert head is not None
    assert head.size == big.stat().st_size
    assert await objects.head(f"{prefix}/a/none.bin") is None
    listed = [i.key for i in await objects.list_objects(f"{prefix}/a/")]
    assert listed == [f"{prefix}/a/big.bin", f"{prefix}/a/small.json"]
    await objects.delete([f"{prefix}/a/big.bin", f"{prefix}/a/gone-already.bin"])
    assert [i.key for i in await objects.list_objects(f"{prefix}/")] == [f"{prefix}/a/small.json"]
    with pytest.raises(errors.SharedStoreError) as missing:
        await objects.get_bytes(f"{prefix}/a/big.bin", limit=1 << 20)
    assert missing.value.missing


async def test_a_commit_is_published_and_another_node_fetches_and_finds_it(
    objects: objstore.ObjectStore, tmp_path: Path
) -> None:
    where = location.parse(url_of(objects, tmp_path), os.environ)
    snaps_a, shared_a, stats_a = node(tmp_path / "a", where)
    snaps_b, shared_b, stats_b = node(tmp_path / "b", where)
    ids = list(range(1000, 1600))
    uploads = asyncio.create_task(shared_a.run())
    try:
        await asyncio.sleep(0)
        record = await asyncio.to_thread(committed, snaps_a, slot_file(ids, 3 << 20))

        async def published() -> bool:
            return stats_a("shared_store_objects_total", direction="up") == 1 and shared_a.uploader.pending() == 0

        await eventually(published, timeout=30, what="the upload")
    finally:
        uploads.cancel()
    ns = shared_a.namespace(IDENTITY)
    names = [i.key.rsplit("/", 2)[-2:] for i in await objects.list_objects(keys.join(where.key_prefix, ns) + "/")]
    assert names == [
        ["blobs", f"xxh3-128-{record.checksum.digest}.bin"],
        ["manifests", f"xxh3-128-{record.checksum.digest}.json"],
    ]
    assert stats_a("shared_store_bytes_total", direction="up") == record.bytes

    request = slotfile.prefix_hashes(slotfile.pack_ids([*ids[:520], 7, 7, 7]))
    # With API keys, a request of another key than the one whose conversation it is finds nothing.
    assert await shared_b.lookup(IDENTITY, request, max_tokens=8192, owner=apikeys.owner_of(key="sk-b")) is None
    match = await shared_b.lookup(IDENTITY, request, max_tokens=8192)
    assert match is not None
    assert match.tokens == 512
    fetched = await shared_b.fetch(match.record, slot=1)
    assert fetched is not None
    assert (fetched.slot, fetched.tokens, fetched.checksum, fetched.fingerprint) == (1, 600, record.checksum, FP)
    assert (snaps_b.dir / fetched.file).read_bytes() == (snaps_a.dir / record.file).read_bytes()
    assert snaps_b.snapshots(1) == [fetched]
    assert not [p for p in snaps_b.dir.iterdir() if p.name.startswith(store.TEMP_PREFIX)]
    assert stats_b("shared_store_bytes_total", direction="down") == record.bytes

    # the fetched snapshot is not uploaded again: its shared manifest exists
    assert await shared_b.uploader.publish(fetched) is False
    await shared_a.close()
    await shared_b.close()


async def test_a_blob_that_does_not_match_its_manifest_is_never_committed(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_a, shared_a, _ = node(tmp_path / "a", where)
    snaps_b, shared_b, stats_b = node(tmp_path / "b", where)
    record = committed(snaps_a, slot_file(list(range(300)), 1 << 20))
    assert await shared_a.uploader.publish(record)
    (blob,) = (tmp_path / "shared").rglob("*.bin")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    found = await shared_b.catalog.records(shared_b.namespace(IDENTITY))
    with structlog.testing.capture_logs() as logs:
        assert await shared_b.fetch(found[0], slot=0) is None
        assert await shared_b.lookup(IDENTITY, record.index.chain if record.index else (), max_tokens=8192) is None
    assert snaps_b.snapshots() == []
    assert list(snaps_b.dir.iterdir()) == []
    (refused,) = [e for e in logs if e["event"] == "shared_snapshot_refused"]
    assert refused["reason"] == "corrupt"
    assert "checksum" in refused["detail"]
    assert refused["effect"]
    assert refused["hint"]
    assert not [e for e in logs if e["event"] == "shared_store_unavailable"]  # the store answered: no outage
    assert stats_b("shared_store_refused_total", reason="corrupt") == 1
    assert stats_b("shared_store_errors_total") == 0


async def test_a_snapshot_of_other_weights_under_this_servers_prefix_is_refused_unfetched(tmp_path: Path) -> None:
    """The key prefix is no proof: the manifest must fit the running server, as in a restore round."""
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    other = dataclasses.replace(IDENTITY, weights="xxh3-128:" + "4" * 32)
    snaps_a, shared_a, _ = node(tmp_path / "a", where)
    snaps_b, shared_b, stats_b = node(tmp_path / "b", where)
    ids = list(range(2000, 2600))
    temp = snaps_a.writer.temp_name(0)
    (snaps_a.dir / temp).write_bytes(slot_file(ids, 4096))
    foreign = snaps_a.writer.commit(
        temp,
        slot=0,
        tokens=600,
        written=(snaps_a.dir / temp).stat().st_size,
        task=1,
        fingerprint=manifest.Fingerprint.of(other, n_ctx=4096),
    )
    assert await shared_a.uploader.publish(foreign)
    shared_root = Path(where.prefix)
    theirs = shared_root / keys.join(where.key_prefix, shared_a.namespace(other))
    shutil.copytree(theirs, shared_root / keys.join(where.key_prefix, shared_b.namespace(IDENTITY)))
    request = slotfile.prefix_hashes(slotfile.pack_ids([*ids[:520], 7]))
    slots = (events.SlotView(0, 4096, False, None, 0),)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert await shared_b.lookup(IDENTITY, request, max_tokens=4096) is None
        assert await shared_b.warm(IDENTITY, slots) == []
    (refused,) = [e for e in logs if e["event"] == "shared_snapshot_refused"]  # said once
    assert refused["reason"] == "incompatible"
    assert refused["detail"].startswith("weights: snapshot xxh3-128:4444")
    assert stats_b("shared_store_refused_total", reason="incompatible") == 1
    assert stats_b("shared_store_objects_total", direction="down") == 0
    assert list(snaps_b.dir.iterdir()) == []  # nothing fetched


class _Reads:
    """An object store that records the objects read whole."""

    def __init__(self, inner: objstore.ObjectStore) -> None:
        self.inner = inner
        self.read: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def get_bytes(self, key: str, *, limit: int) -> bytes:
        self.read.append(key)
        return await self.inner.get_bytes(key, limit=limit)


async def test_a_manifest_object_larger_than_a_manifest_is_refused_unread(
    objects: objstore.ObjectStore, tmp_path: Path
) -> None:
    where = location.parse(url_of(objects, tmp_path), os.environ)
    reads = _Reads(objects)
    (tmp_path / "b").mkdir()
    registry = CollectorRegistry()
    stats = Samples(registry)
    shared = service.SharedStore(
        where,
        snapshots=store.SnapshotStore(tmp_path / "b", clock=protocols.SystemClock()),
        stats=metrics.Metrics(registry, version="test"),
        objects=typing.cast(objstore.ObjectStore, reads),
    )
    ns = shared.namespace(IDENTITY)
    key = keys.join(where.key_prefix, ns, keys.MANIFESTS, "xxh3-128-" + "5" * 32 + ".json")
    await objects.put_bytes(key, b" " * (manifest.MAX_BYTES + 1))
    with structlog.testing.capture_logs() as logs:
        assert await shared.lookup(IDENTITY, ("ab" * 16,), max_tokens=4096) is None
        shared.catalog.forget(ns)
        assert await shared.lookup(IDENTITY, ("ab" * 16,), max_tokens=4096) is None
    assert reads.read == []  # refused by the listing's size: not one byte read
    (refused,) = [e for e in logs if e["event"] == "shared_snapshot_refused"]
    assert (refused["reason"], refused["key"]) == ("oversized", key)
    assert refused["effect"]
    assert refused["hint"]
    assert stats("shared_store_refused_total", reason="oversized") == 1
    await objects.delete([key])


async def test_a_nodes_own_manifests_are_known_without_reading_them_back(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    (tmp_path / "a").mkdir()
    snaps_a = store.SnapshotStore(tmp_path / "a", clock=protocols.SystemClock())
    reads = _Reads(connect.open_store(where))
    shared_a = service.SharedStore(
        where,
        snapshots=snaps_a,
        stats=metrics.Metrics(CollectorRegistry(), version="test"),
        objects=typing.cast(objstore.ObjectStore, reads),
    )
    snaps_b, shared_b, _ = node(tmp_path / "b", where)
    ids = list(range(2000, 2300))
    request = slotfile.prefix_hashes(slotfile.pack_ids(ids))
    assert await shared_a.lookup(IDENTITY, request, max_tokens=4096) is None  # listed once, empty
    assert await shared_a.uploader.publish(committed(snaps_a, slot_file(ids, 1 << 20)))
    assert await shared_b.uploader.publish(committed(snaps_b, slot_file(list(range(300)), 1 << 20)))
    match = await shared_a.lookup(IDENTITY, request, max_tokens=4096)
    assert match is not None  # its own, found without a listing
    assert reads.read == []  # nor a read of what it wrote itself
    shared_a.catalog.forget(shared_a.namespace(IDENTITY))  # the listing expires: the other node's is read
    assert len(await shared_a.catalog.records(shared_a.namespace(IDENTITY))) == 2
    assert len(reads.read) == 1


async def test_warm_fills_only_empty_slots_without_a_local_snapshot(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    where = location.parse(f"file://{tmp_path / 'shared'}", {})
    snaps_a, shared_a, _ = node(tmp_path / "a", where)
    snaps_b, shared_b, _ = node(tmp_path / "b", where)
    for ids in (list(range(300)), list(range(5000, 5300))):
        assert await shared_a.uploader.publish(committed(snaps_a, slot_file(ids, 4096)))
    local = committed(snaps_b, slot_file(list(range(900, 1200)), 4096), slot=0)
    slots = (events.SlotView(0, 4096, False, None, 0), events.SlotView(1, 4096, False, None, 0))
    got = await shared_b.warm(IDENTITY, slots)
    assert [m.slot for m in got] == [1]
    assert snaps_b.snapshots(0) == [local]
    assert await shared_b.warm(IDENTITY, slots) == []  # slot 1 has a local snapshot now


async def test_store_outage_counts_errors_and_uploads_catch_up(
    s3_server: S3Server, s3_url: str, tmp_path: Path
) -> None:
    where = location.parse(s3_url, os.environ)
    snaps, shared, stats = node(tmp_path / "a", where)
    shared.uploader.backoff = 0.0
    uploads = asyncio.create_task(shared.run())
    try:
        await asyncio.sleep(0)
        s3_server.stop()
        records = [
            await asyncio.to_thread(committed, snaps, slot_file(list(range(n, n + 300)), 4096)) for n in (0, 1000)
        ]

        async def failing() -> bool:
            return (
                stats("shared_store_errors_total", operation="get")
                + stats("shared_store_errors_total", operation="put")
                >= 1
            )

        await eventually(failing, timeout=60, what="a counted error while the store is down")
        assert shared.uploader.pending() == 2
        assert stats("shared_store_pending_uploads") == 2
        assert len(snaps.snapshots()) == 2  # local commits went on
        await asyncio.to_thread(s3_server.start)

        async def caught_up() -> bool:
            return shared.uploader.pending() == 0

        await eventually(caught_up, timeout=120, what="the uploads after the outage")
    finally:
        uploads.cancel()
    ns = shared.namespace(IDENTITY)
    listed = {
        i.key.rsplit("/", 1)[-1] for i in await shared.objects.list_objects(keys.join(where.key_prefix, ns) + "/")
    }
    assert {f"xxh3-128-{r.checksum.digest}.json" for r in records} <= listed
    await shared.close()


async def test_gc_unpublishes_then_deletes_after_the_grace(objects: objstore.ObjectStore, tmp_path: Path) -> None:
    where = location.parse(url_of(objects, tmp_path), os.environ)
    snaps, shared, _ = node(tmp_path / "a", where)
    record = committed(snaps, slot_file(list(range(300)), 4096))
    assert await shared.uploader.publish(record)
    prefix = where.key_prefix
    now = time.time() + 7200
    first = await gc.collect(objects, prefix, now=now, max_age=3600, max_bytes=0, grace=600)
    assert len(first.unpublish) == 1
    assert first.delete == ()
    shared.catalog.forget(shared.namespace(IDENTITY))
    assert await shared.catalog.records(shared.namespace(IDENTITY)) == []
    left = sorted(i.key.split("/")[-2] for i in await objects.list_objects(keys.join(prefix) + "/" if prefix else ""))
    assert left == ["blobs", "gone"]
    second = await gc.collect(objects, prefix, now=now + 1200, max_age=3600, max_bytes=0, grace=600)
    assert len(second.delete) == 2
    assert await objects.list_objects(keys.join(prefix) + "/" if prefix else "") == []
    await shared.close()


async def test_a_hung_s3_server_holds_the_restore_rounds_warm_up_only_for_its_listing_bound(
    s3_url: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "WARM_LIST_SECONDS", 1.0)
    where = location.parse(s3_url, os.environ)
    _, shared, _ = node(tmp_path / "a", where)
    slots = (events.SlotView(0, 4096, False, None, 0),)
    assert s3_server.proc is not None
    os.killpg(s3_server.proc.pid, signal.SIGSTOP)  # frozen: every call hangs
    try:
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            got = await shared.warm(IDENTITY, slots)
        took = time.monotonic() - started
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
        await shared.close()
    assert got == []
    assert took < 10, f"the warm-up waited {took:.1f} s on a hung store (was {service.WARM_TIMEOUT:g} s)"
    said = [line for line in logs if line["event"] == "shared_warm_timeout"]
    assert [line["doing"] for line in said] == ["listing the shared snapshots"]
