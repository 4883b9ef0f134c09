"""The free-space floor in the snapshotter: what it checks on which disk, and the room it makes (LRU).

The disk is faked at its seams, ``Disk.usage`` and ``free_bytes`` (and ``staging_room`` for the slot dir
of a block store): a filesystem of ``capacity`` bytes whose free space is what the files really on it leave.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar.core import config, events, metrics, outcomes
from sidecar.save import diskroom, policy, records, snapshotter
from sidecar.slots import actions
from sidecar.snapshots import store
from tests.support import clocks
from tests.unit import memllama

R, C = outcomes.SaveResult, outcomes.SaveCause
TOKENS = 100_000
"""Tokens of each save: a 1 MB file at MemLlama's 10 bytes a token."""
FLOOR = 1 << 20


@dataclasses.dataclass
class Bed:
    server: memllama.MemLlama
    snapshots: store.SnapshotStore
    saver: snapshotter.Snapshotter
    registry: CollectorRegistry
    capacity: int = 1 << 40
    staging_free: int = 1 << 40

    async def save(self, slot: int, task: int, tokens: int = TOKENS) -> records.SaveRecord:
        self.server.set_slot(slot, task=task, tokens=tokens)
        action = policy.Save(slot, events.SlotContent(task, tokens), tokens, policy.SaveReason.IDLE)
        record = await self.saver.save(action, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX)
        assert isinstance(record, records.SaveRecord)
        return record

    def files(self) -> list[str]:
        return sorted(m.file for m in self.snapshots.snapshots())

    def used(self) -> int:
        return self.snapshots.disk.usage().used_bytes

    def evicted(self) -> float:
        return self.registry.get_sample_value("llama_sidecar_gc_deleted_total", {"reason": "space"}) or 0.0


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, blocks: bool) -> Bed:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    server = memllama.MemLlama(slot_dir)
    # Commits and uses each a second after the one before, ahead of the manifests' real mtimes (a use read back).
    clock = clocks.FakeClock(epoch=time.time() + 3600, tick=1.0)
    snapshots = store.SnapshotStore(slot_dir, clock=clock, store_dir=tmp_path / "store" if blocks else None)
    registry = CollectorRegistry()
    saver = snapshotter.Snapshotter(
        slot_actions=actions.SlotActions(client=server, snapshots=snapshots),
        snapshots=snapshots,
        stats=metrics.Metrics(registry, version="t"),
        settings=config.SnapshotSettings(slot_dir=slot_dir, min_free_bytes=FLOOR, keep_per_slot=100),
        clock=clock,
    )
    bed = Bed(server, snapshots, saver, registry)
    measure = snapshots.disk.usage

    def usage() -> store.Usage:
        real = measure()
        return dataclasses.replace(real, free_bytes=max(0, bed.capacity - real.used_bytes))

    monkeypatch.setattr(snapshots.disk, "usage", usage)
    monkeypatch.setattr(snapshots.disk, "free_bytes", lambda: usage().free_bytes)
    monkeypatch.setattr(snapshots.disk, "staging_room", lambda: (bed.staging_free, False) if blocks else None)
    return bed


async def test_a_block_store_takes_a_save_whose_new_tail_fits_though_its_whole_file_would_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed = make(tmp_path, monkeypatch, blocks=True)
    assert (await bed.save(1, task=1, tokens=TOKENS // 2)).result is R.OK  # two sizes: what grows with the tokens
    assert (await bed.save(0, task=2)).result is R.OK
    grown = TOKENS + TOKENS // 10  # 1.1 MB whole, about 0.13 MB new
    bed.capacity = bed.used() + FLOOR + 600_000
    with capture_logs() as logs:
        record = await bed.save(0, task=3, tokens=grown)
    assert (record.result, record.cause) == (R.OK, None), record.detail
    assert not [e for e in logs if e["event"] == "snapshot_skipped_low_disk"]
    assert bed.evicted() == 0


async def test_a_block_store_counts_the_staged_file_when_the_slot_dir_lacks_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed = make(tmp_path, monkeypatch, blocks=True)
    await bed.save(1, task=1, tokens=TOKENS // 2)
    await bed.save(0, task=2)
    bed.capacity = bed.used() + FLOOR + 600_000
    bed.staging_free = 500_000  # the 1.1 MB file spills onto the store's disk
    with capture_logs() as logs:
        record = await bed.save(0, task=3, tokens=TOKENS + TOKENS // 10)
    assert (record.result, record.cause) == (R.SKIPPED, C.LOW_DISK)
    said = [e for e in logs if e["event"] == "snapshot_skipped_low_disk"]
    assert [(e["disk"], e["staged_file_counted"]) for e in said] == [("store", True)]
    assert said[0]["estimated_bytes"] > 1_100_000
    assert said[0]["directory"] == str(tmp_path / "store")
    assert "store disk" in record.detail


@pytest.mark.parametrize("blocks", [False, True], ids=["whole-files", "block-store"])
async def test_a_disk_at_the_floor_deletes_the_least_recently_used_and_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: bool
) -> None:
    bed = make(tmp_path, monkeypatch, blocks=blocks)
    for slot, task in ((0, 1), (1, 2), (0, 3), (1, 4)):  # four conversations, two per slot
        assert (await bed.save(slot, task)).result is R.OK
    oldest, second, newest0, newest1 = (bed.snapshots.snapshots()[i].file for i in (3, 2, 1, 0))
    bed.snapshots.recency.touch(oldest)  # restored since: used more recently than the slot-1 conversation
    bed.capacity = bed.used() + FLOOR + 400_000  # a new 1 MB conversation: one snapshot must go
    with capture_logs() as logs:
        record = await bed.save(0, task=5)
    assert record.result is R.OK, record.detail
    assert second not in bed.files()
    assert {oldest, newest0, newest1} < set(bed.files())
    assert bed.evicted() == 1
    said = [e for e in logs if e["event"] == "snapshots_evicted_for_space"]
    assert len(said) == 1
    line = said[0]
    assert (line["count"], line["min_free_bytes"], line["disk"]) == (1, FLOOR, "store" if blocks else "slot_dir")
    assert line["free_bytes_after"] - line["free_bytes_before"] >= line["freed_bytes"] > 400_000
    assert "--max-bytes" in line["hint"]
    for m in bed.snapshots.snapshots():
        bed.snapshots.curator.check(m)  # what stays is whole


@pytest.mark.parametrize("blocks", [False, True], ids=["whole-files", "block-store"])
async def test_nothing_is_deleted_when_deleting_all_would_not_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: bool
) -> None:
    bed = make(tmp_path, monkeypatch, blocks=blocks)
    for slot, task in ((0, 1), (0, 2), (1, 3)):
        await bed.save(slot, task)
    before = bed.files()
    bed.capacity = bed.used() + FLOOR - 200_000  # only slot 0's older one may go: 1 MB, 1.2 MB short
    with capture_logs() as logs:
        record = await bed.save(1, task=4)
    assert (record.result, record.cause) == (R.SKIPPED, C.LOW_DISK)
    assert bed.files() == before
    assert bed.evicted() == 0
    assert not [e for e in logs if e["event"] == "snapshots_evicted_for_space"]
    assert [e["disk"] for e in logs if e["event"] == "snapshot_skipped_low_disk"] == ["store" if blocks else "slot_dir"]


async def test_a_snapshot_in_use_is_never_deleted_for_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bed = make(tmp_path, monkeypatch, blocks=False)
    for slot, task in ((0, 1), (0, 2), (0, 3)):
        await bed.save(slot, task)
    oldest, middle, _ = (m.file for m in reversed(bed.snapshots.snapshots()))
    bed.capacity = bed.used() + FLOOR + 400_000
    with bed.snapshots.recency.using(oldest):
        assert (await bed.save(0, task=4)).result is R.OK
    assert oldest in bed.files()
    assert middle not in bed.files()


async def test_the_check_before_a_save_measures_free_space_only_and_never_lists_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing the block store looks at the block files of every changed folder (0.5-0.9 s at 100,000 of them
    when all changed): not on a save's path."""
    bed = make(tmp_path, monkeypatch, blocks=True)
    assert (await bed.save(0, task=1)).result is R.OK
    listed: list[int] = []
    measure = bed.snapshots.disk.usage

    def usage() -> store.Usage:
        listed.append(1)
        return measure()

    monkeypatch.setattr(bed.snapshots.disk, "usage", usage)
    free = bed.snapshots.disk.free_bytes
    monkeypatch.setattr(bed.snapshots.disk, "free_bytes", lambda: bed.capacity - measure().used_bytes)
    assert (await bed.save(0, task=2, tokens=TOKENS * 2)).result is R.OK
    assert listed == []
    bed.capacity = measure().used_bytes + FLOOR  # no room above the floor: skipped, still without a listing
    record = await bed.save(1, task=3)
    assert (record.result, record.cause) == (R.SKIPPED, C.LOW_DISK)
    assert listed == []
    monkeypatch.setattr(bed.snapshots.disk, "free_bytes", free)
    assert isinstance(free(), int)  # the real one: a statvfs of the store's filesystem


def test_before_any_snapshot_the_staged_file_is_estimated_from_the_launchers_bytes_per_token(tmp_path: Path) -> None:
    """A first save too large for the RAM staging dir is staged on disk: its size is known before any snapshot."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    snapshots = store.SnapshotStore(slot_dir, clock=clocks.FakeClock(), store_dir=tmp_path / "store")
    stats = metrics.Metrics(CollectorRegistry(), version="t")
    hinted = config.SnapshotSettings(slot_dir=slot_dir, staging_bytes_per_token=18_436)
    room = diskroom.DiskRoom(snapshots=snapshots, stats=stats, settings=hinted)
    assert room.estimate_bytes(1000) == 0, "the floor's estimate is unchanged: no snapshot, no figure"
    assert room.staging_bytes(1000) == 18_436_000
    plain = diskroom.DiskRoom(snapshots=snapshots, stats=stats, settings=config.SnapshotSettings(slot_dir=slot_dir))
    assert plain.staging_bytes(1000) == 0
