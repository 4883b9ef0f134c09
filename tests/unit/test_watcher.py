"""The disk index follows files changed by anyone, through real watchdog events."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar import events, manifest, metrics, policy, store, watcher
from support.wait import until

FP = manifest.Fingerprint("b1", "/m.gguf", 10, 20, 4096, 1)


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[store.SnapshotStore, CollectorRegistry]]:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="test")
    snaps = store.SnapshotStore(tmp_path, clock=time.time)
    snaps.on_quarantine = lambda file, reason, detail: stats.quarantined.labels(reason).inc()
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
        sha256=hashlib.sha256(data).hexdigest(),
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


def test_result_words_match_the_policy_vocabulary() -> None:
    assert tuple(o.value for o in policy.RestoreOutcome) == metrics.RESTORE_RESULTS
    assert tuple(r.value for r in policy.GcReason) == metrics.GC_REASONS
    assert events.Health.OK.value == "ok"
