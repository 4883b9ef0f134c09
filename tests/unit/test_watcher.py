"""The disk index follows files changed by anyone, through real watchdog events."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import xxhash
from prometheus_client import CollectorRegistry
from watchdog.observers import Observer

from sidecar.app import storelog
from sidecar.core import events, hashing, metrics, outcomes, protocols
from sidecar.snapshots import dirlock, manifest, store, watcher
from tests.support.wait import until

FP = manifest.Fingerprint("b1", "/m.gguf", 10, 20, 4096, 1)


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[store.SnapshotStore, CollectorRegistry]]:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="test")
    snaps = store.SnapshotStore(tmp_path, clock=protocols.SystemClock(), events=storelog.StoreLog(stats))
    watch = watcher.Watcher(snaps, stats)
    watch.start()
    task = asyncio.create_task(watch.run(), name="watcher")
    try:
        yield snaps, registry
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await watch.stop()


def _write_pair(directory: Path, slot: int, stamp: str, size: int) -> manifest.Manifest:
    """A complete snapshot written by someone else: file first, manifest last."""
    data = os.urandom(size)
    name = f"slot{slot}-{stamp}.bin"
    (directory / name).write_bytes(data)
    record = manifest.Manifest(
        slot=slot,
        file=name,
        tokens=100,
        bytes=size,
        checksum=manifest.Checksum(hashing.Algorithm.XXH3_128, xxhash.xxh3_128_hexdigest(data)),
        generation=1,
        created=time.time(),
        task=1,
        fingerprint=FP,
    )
    (directory / f"slot{slot}-{stamp}.json").write_text(record.to_json())
    return record


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return -1.0 if value is None else value


async def test_created_deleted_truncated_and_renamed_files_update_index_and_gauges(
    watched: tuple[store.SnapshotStore, CollectorRegistry],
) -> None:
    snaps, registry = watched
    a = _write_pair(snaps.dir, 0, "20260101T000000000000Z", 4096)
    _write_pair(snaps.dir, 1, "20260101T000001000000Z", 1000)
    await until(lambda: _value(registry, "llama_sidecar_snapshot_files") == 2, timeout=1.0)
    await until(lambda: _value(registry, "llama_sidecar_disk_used_bytes") >= 5096, timeout=1.0)
    assert [m.file for m in snaps.snapshots(0)] == [a.file]

    # Renamed by someone: the index follows the new name (manifest moved last).
    new = "slot1-20260101T000002000000Z"
    old = "slot1-20260101T000001000000Z"
    body = (snaps.dir / f"{old}.json").read_text().replace(old, new)
    os.replace(snaps.dir / f"{old}.bin", snaps.dir / f"{new}.bin")
    (snaps.dir / f"{new}.json").write_text(body)
    os.remove(snaps.dir / f"{old}.json")
    await until(lambda: [m.file for m in snaps.snapshots(1)] == [f"{new}.bin"], timeout=1.0)

    # Truncated: quarantined, out of the index, counted.
    with open(snaps.dir / a.file, "r+b") as fh:
        fh.truncate(10)
    await until(lambda: _value(registry, "llama_sidecar_snapshots_quarantined_total", reason="size") == 1, timeout=1.0)
    assert snaps.snapshots(0) == []
    await until(lambda: _value(registry, "llama_sidecar_snapshot_files") == 1, timeout=1.0)

    # Deleted: gone from the index and the gauges.
    os.remove(snaps.dir / f"{new}.bin")
    await until(lambda: snaps.snapshots() == [], timeout=1.0)
    await until(lambda: _value(registry, "llama_sidecar_snapshot_files") == 0, timeout=1.0)
    assert _value(registry, "llama_sidecar_disk_free_bytes") > 0


async def test_a_file_written_in_many_writes_wakes_the_watcher_twice_and_a_save_in_progress_never(
    tmp_path: Path,
) -> None:
    """The kernel reports a file's creation and its close after writing, not each write; a file the
    server is still writing for a save (its temp name) is reported only once renamed to a snapshot."""
    names: asyncio.Queue[str] = asyncio.Queue()
    observer = Observer()
    observer.schedule(watcher._Handoff(asyncio.get_running_loop(), names), str(tmp_path), event_filter=watcher.WATCHED)
    observer.start()
    seen: list[str] = []

    async def next_name() -> str:
        seen.append(Path(await asyncio.wait_for(names.get(), timeout=5.0)).name)
        return seen[-1]

    try:
        saving = tmp_path / f"{store.TEMP_PREFIX}slot0-1.bin"
        for path in (saving, tmp_path / "slot0-a.bin"):
            with path.open("wb") as fh:
                for _ in range(64):
                    fh.write(os.urandom(4096))
                    fh.flush()
        os.replace(saving, tmp_path / "slot0-b.bin")
        while await next_name() != "slot0-b.bin":
            pass
        assert seen == ["slot0-a.bin", "slot0-a.bin", "slot0-b.bin"], seen  # created, closed; renamed
    finally:
        observer.stop()
        await asyncio.to_thread(observer.join, 5.0)


def test_result_words_match_the_policy_vocabulary() -> None:
    assert tuple(o.value for o in outcomes.RestoreOutcome) == metrics.RESTORE_RESULTS
    assert tuple(r.value for r in outcomes.GcReason) == metrics.GC_REASONS
    assert events.Health.OK.value == "ok"


@pytest.fixture
async def watched_subdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[store.SnapshotStore, dirlock.DirLock, asyncio.Task[None]]]:
    """A watcher on tmp_path/slots holding its lock, checking the directory every 50 ms."""
    monkeypatch.setattr(watcher, "CHECK_EVERY", 0.05)
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    stats = metrics.Metrics(CollectorRegistry(), version="test")
    snaps = store.SnapshotStore(slot_dir, clock=protocols.SystemClock())
    lock = dirlock.DirLock(slot_dir)
    lock.acquire()
    watch = watcher.Watcher(snaps, stats, lock)
    watch.start()
    task = asyncio.create_task(watch.run(), name="watcher")
    try:
        yield snaps, lock, task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await watch.stop()
        lock.release()


async def test_a_slot_dir_moved_away_is_reported_and_a_new_one_is_taken_over(
    watched_subdir: tuple[store.SnapshotStore, dirlock.DirLock, asyncio.Task[None]], tmp_path: Path
) -> None:
    snaps, lock, task = watched_subdir
    first = _write_pair(snaps.dir, 0, "20260101T000000000000Z", 1000)
    await until(lambda: [m.file for m in snaps.snapshots()] == [first.file], timeout=1.0)
    snaps.dir.rename(tmp_path / "away")
    await until(lambda: "does not exist" in (snaps.disk.check_writable() or ""), timeout=1.0)
    await until(lambda: snaps.snapshots() == [], timeout=1.0)
    assert not task.done()  # the watcher (and with it the process) keeps running
    snaps.dir.mkdir()  # a new, empty directory at the path: a volume mounted again
    await until(lambda: snaps.disk.check_writable() is None and lock.holds(), timeout=1.0)
    second = _write_pair(snaps.dir, 1, "20260101T000001000000Z", 1000)
    await until(lambda: [m.file for m in snaps.snapshots()] == [second.file], timeout=1.0)  # watched again


async def test_a_slot_dir_put_back_brings_its_snapshots_back(
    watched_subdir: tuple[store.SnapshotStore, dirlock.DirLock, asyncio.Task[None]], tmp_path: Path
) -> None:
    snaps, lock, _ = watched_subdir
    first = _write_pair(snaps.dir, 0, "20260101T000000000000Z", 1000)
    await until(lambda: [m.file for m in snaps.snapshots()] == [first.file], timeout=1.0)
    snaps.dir.rename(tmp_path / "away")
    await until(lambda: snaps.disk.check_writable() is not None, timeout=1.0)
    (tmp_path / "away").rename(snaps.dir)
    await until(lambda: snaps.disk.check_writable() is None, timeout=1.0)
    await until(lambda: [m.file for m in snaps.snapshots()] == [first.file], timeout=1.0)
    assert lock.holds()


async def test_a_new_slot_dir_taken_by_another_sidecar_is_left_to_it(
    watched_subdir: tuple[store.SnapshotStore, dirlock.DirLock, asyncio.Task[None]], tmp_path: Path
) -> None:
    snaps, lock, _ = watched_subdir
    snaps.dir.rename(tmp_path / "away")
    snaps.dir.mkdir()
    other = dirlock.DirLock(snaps.dir)
    other.acquire()  # another sidecar got there first
    theirs = _write_pair(snaps.dir, 0, "20260101T000000000000Z", 1000)
    await until(lambda: "another llama-kv-sidecar holds" in (snaps.disk.check_writable() or ""), timeout=1.0)
    assert snaps.snapshots() == []  # its conversations are not ours to restore
    other.release()
    await until(lambda: snaps.disk.check_writable() is None and lock.holds(), timeout=1.0)
    await until(lambda: [m.file for m in snaps.snapshots()] == [theirs.file], timeout=1.0)
