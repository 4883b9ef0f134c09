"""store.SnapshotStore with a block store (``--store-dir``) on real directories: commit, stage, scan, upgrade."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from sidecar.core import errors, events, outcomes
from sidecar.snapshots import manifest, retention, slotdir, staging, store, upgrade
from tests.support import clocks, wait
from tests.support.told import Told

FP = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)
SIZE = 1 << 20


def _bytes(seed: int, size: int = SIZE) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    slot_dir, store_dir = tmp_path / "slots", tmp_path / "store"
    slot_dir.mkdir()
    store_dir.mkdir()
    return slot_dir, store_dir


def _open(dirs: tuple[Path, Path], told: Told | None = None) -> store.SnapshotStore:
    return store.SnapshotStore(dirs[0], clock=clocks.stepping(), events=told or Told(), store_dir=dirs[1])


def _commit(snaps: store.SnapshotStore, data: bytes, slot: int = 0) -> manifest.Manifest:
    temp = snaps.writer.temp_name(slot)
    (snaps.staging / temp).write_bytes(data)  # what llama-server's save does
    return snaps.writer.commit(temp, slot=slot, tokens=300, written=len(data), task=1, fingerprint=FP)


def test_a_commit_is_ingested_its_staged_file_deleted_and_its_manifest_names_the_recipe(
    dirs: tuple[Path, Path],
) -> None:
    snaps = _open(dirs)
    record = _commit(snaps, _bytes(1))
    assert record.recipe == Path(record.file).stem
    assert record.bytes == SIZE
    assert list(dirs[0].iterdir()) == []  # nothing of ours stays in the slot dir
    assert (dirs[1] / "snapshots" / (record.recipe + ".json")).exists()
    assert (dirs[1] / "recipes" / (record.recipe + ".json")).exists()
    assert snaps.snapshots() == [record]
    assert snaps.blocks is not None
    first = snaps.blocks.figures
    assert first.block_bytes_written == SIZE
    assert first.manifest_bytes_written > 0
    _commit(snaps, _bytes(1), slot=1)  # the same bytes again: no block written
    assert snaps.blocks.figures.block_bytes_written == SIZE
    assert snaps.blocks.figures.deduplicated_bytes == SIZE
    usage = snaps.disk.usage()
    assert usage.unique_bytes == SIZE
    assert usage.represented_bytes == 2 * SIZE


def test_stage_rebuilds_the_exact_file_under_a_fresh_name_and_unstage_deletes_it(dirs: tuple[Path, Path]) -> None:
    snaps = _open(dirs)
    data = _bytes(2)
    record = _commit(snaps, data)
    name = snaps.staged.stage(record)
    assert name != record.file
    assert (dirs[0] / name).read_bytes() == data
    assert snaps.disk.usage().staged_bytes == SIZE
    snaps.staged.unstage(name, record)
    assert list(dirs[0].iterdir()) == []
    assert snaps.disk.usage().staged_bytes == 0


def test_a_corrupt_block_refuses_its_snapshot_and_names_the_block_while_others_stage(dirs: tuple[Path, Path]) -> None:
    snaps = _open(dirs)
    good, bad = _commit(snaps, _bytes(3)), _commit(snaps, _bytes(4), slot=1)
    digests = {d for d, _ in snaps.blocks.digests(bad)} - {d for d, _ in snaps.blocks.digests(good)}  # type: ignore[union-attr]
    victim = sorted(digests)[0]
    path = dirs[1] / "blocks" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(errors.SnapshotError) as refused:
        snaps.staged.stage(bad)
    assert refused.value.reason == outcomes.SnapshotProblem.CHECKSUM
    assert victim in str(refused.value)
    assert list(dirs[0].iterdir()) == []  # no partial file
    name = snaps.staged.stage(good)
    snaps.staged.unstage(name, good)
    path.unlink()
    with pytest.raises(errors.SnapshotError) as missing:
        snaps.curator.check(bad)
    assert missing.value.reason == outcomes.SnapshotProblem.SIZE


def test_a_restarted_store_finds_its_snapshots_and_cleans_what_died_midway(dirs: tuple[Path, Path]) -> None:
    first = _open(dirs)
    record = _commit(first, _bytes(5))
    assert first.blocks is not None
    source = dirs[1] / "source.bin"
    source.write_bytes(_bytes(11, 4096))
    first.blocks.store.ingest("slot3-20250101T000000000000Z", source)  # an ingest killed before its manifest
    (dirs[0] / ".tmp-restore-abc.bin").write_bytes(b"x")  # a staged rebuild of a killed sidecar
    second = _open(dirs)
    findings = second.loader.scan(clean=True)
    assert [m.file for m in second.snapshots()] == [record.file]
    assert any("slot3-20250101T000000000000Z" in f for f in findings)
    assert not (dirs[1] / "recipes" / "slot3-20250101T000000000000Z.json").exists()
    assert list(dirs[0].iterdir()) == []


def test_a_missing_recipe_quarantines_its_manifest_at_scan(dirs: tuple[Path, Path]) -> None:
    told = Told()
    snaps = _open(dirs, told)
    record = _commit(snaps, _bytes(6))
    (dirs[1] / "recipes" / f"{record.recipe}.json").unlink()
    snaps.loader.scan(clean=False)
    assert snaps.snapshots() == []
    assert (dirs[1] / "snapshots" / (Path(record.file).stem + ".json.quarantined")).exists()


def test_delete_drops_the_recipe_and_collection_frees_only_unshared_blocks(dirs: tuple[Path, Path]) -> None:
    snaps = _open(dirs)
    shared = _bytes(7)
    one = _commit(snaps, shared + _bytes(8))
    two = _commit(snaps, shared + _bytes(9), slot=1)
    assert snaps.blocks is not None
    before = snaps.disk.usage().unique_bytes
    assert before < 4 * SIZE  # the shared first MiB is stored once (give or take a chunk at the seam)
    assert snaps.curator.delete(one)
    snaps.curator.collect_blocks()
    after = snaps.disk.usage()
    assert after.represented_bytes == two.bytes
    assert two.bytes <= after.unique_bytes < before
    name = snaps.staged.stage(two)
    assert (dirs[0] / name).read_bytes() == shared + _bytes(9)


def test_whole_file_snapshots_are_converted_into_the_store(dirs: tuple[Path, Path]) -> None:
    plain = store.SnapshotStore(dirs[0], clock=clocks.stepping())
    data = _bytes(10)
    temp = plain.writer.temp_name(0)
    (dirs[0] / temp).write_bytes(data)
    old = plain.writer.commit(temp, slot=0, tokens=300, written=len(data), task=1, fingerprint=FP)
    assert "recipe" not in json.loads((dirs[0] / (Path(old.file).stem + ".json")).read_text())
    snaps = _open(dirs)
    assert snaps.blocks is not None
    report = Told()
    done = upgrade.convert(
        slotdir.SlotDir(dirs[0], report.io_error), slotdir.SlotDir(snaps.dir, report.io_error), snaps.blocks
    )
    assert (done.files, done.bytes, done.findings) == (1, SIZE, ())
    assert list(dirs[0].iterdir()) == []
    snaps.loader.scan(clean=True)
    [moved] = snaps.snapshots()
    assert (moved.file, moved.generation, moved.recipe) == (old.file, old.generation, Path(old.file).stem)
    name = snaps.staged.stage(moved)
    assert (dirs[0] / name).read_bytes() == data


def test_retention_counts_shared_blocks_once() -> None:
    a = retention.Kept("a", ("x",), 300, 1, 1.0, blocks=(("s", 200), ("a", 100)))
    b = retention.Kept("b", ("y",), 300, 2, 2.0, blocks=(("s", 200), ("b", 100)))
    c = retention.Kept("c", ("z",), 300, 3, 3.0)  # a whole file
    assert retention.held_bytes([a, b, c]) == 200 + 100 + 100 + 300
    doomed = retention.select([a, b, c], in_use=(), max_bytes=600, max_age=0, now=10.0)
    assert [(k.file, why) for k, why in doomed] == [("a", outcomes.GcReason.BYTES)]  # 700 → 600 once a goes


def test_a_rebuild_given_back_is_the_spare_the_next_rebuild_reuses_and_there_is_one_at_most(
    dirs: tuple[Path, Path],
) -> None:
    snaps = _open(dirs)
    snaps.staged.keeps_spare = True  # as on a tmpfs of small pages
    one = _commit(snaps, _bytes(7))
    two = _commit(snaps, _bytes(8, 5000))

    first = snaps.staged.stage(one)
    inode = os.stat(dirs[0] / first).st_ino
    snaps.staged.unstage(first, one)
    assert sorted(p.name for p in dirs[0].iterdir()) == [staging.SPARE]
    assert snaps.disk.usage().staged_bytes == SIZE  # the spare's RAM is shown

    second = snaps.staged.stage(two)
    assert (dirs[0] / second).read_bytes() == _bytes(8, 5000)
    assert os.stat(dirs[0] / second).st_ino == inode
    third = snaps.staged.stage(one)  # no spare left: a new file
    assert (dirs[0] / third).read_bytes() == _bytes(7)
    snaps.staged.unstage(second, two)
    snaps.staged.unstage(third, one)  # a spare is there already: deleted
    assert sorted(p.name for p in dirs[0].iterdir()) == [staging.SPARE]
    assert snaps.staged.drop_spare()
    assert list(dirs[0].iterdir()) == []
    assert not snaps.staged.drop_spare()


def test_no_spare_is_kept_where_pages_are_cheap(dirs: tuple[Path, Path]) -> None:
    snaps = _open(dirs)
    snaps.staged.keeps_spare = False
    record = _commit(snaps, _bytes(9))
    name = snaps.staged.stage(record)
    snaps.staged.unstage(name, record)
    assert list(dirs[0].iterdir()) == []


def test_a_spare_no_rebuild_takes_is_deleted_so_an_idle_slot_dir_holds_nothing(dirs: tuple[Path, Path]) -> None:
    """RAM staging is empty once idle: the spare waits ``spare_seconds`` for a rebuild, then goes."""
    snaps = _open(dirs)
    snaps.staged.keeps_spare = True  # as on a tmpfs of small pages
    snaps.staged.spare_seconds = 0.2
    one = _commit(snaps, _bytes(7))
    two = _commit(snaps, _bytes(8, 5000))

    snaps.staged.unstage(snaps.staged.stage(one), one)
    assert sorted(p.name for p in dirs[0].iterdir()) == [staging.SPARE]
    taken = snaps.staged.stage(two)  # a rebuild within the wait takes the spare's pages
    assert sorted(p.name for p in dirs[0].iterdir()) == [taken]
    snaps.staged.unstage(taken, two)  # kept again, waiting anew
    wait.wait_until(lambda: not any(dirs[0].iterdir()), timeout=10, what="the spare deleted once unused")
    assert snaps.disk.usage().staged_bytes == 0
