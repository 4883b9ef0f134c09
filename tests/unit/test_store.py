"""store.SnapshotStore on a real temporary directory: commit, scan, verify, quarantine, delete."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from sidecar import errors, events, manifest, store

FP = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)


class StepClock:
    """Wall clock that moves one second per reading, so every commit gets its own name."""

    def __init__(self, start: float = 1_764_400_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Quarantined:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, name: str, reason: str, detail: str) -> None:
        self.calls.append((name, reason, detail))


@pytest.fixture
def snaps(tmp_path: Path) -> store.SnapshotStore:
    return store.SnapshotStore(tmp_path, clock=StepClock())


def server_writes(snaps: store.SnapshotStore, slot: int, data: bytes) -> str:
    """What llama-server does on POST /slots/{slot}?action=save with the store's temp name."""
    name = snaps.temp_name(slot)
    (snaps.dir / name).write_bytes(data)
    return name


def commit(
    snaps: store.SnapshotStore, slot: int = 0, data: bytes = b"kv" * 500, tokens: int = 300
) -> manifest.Manifest:
    temp = server_writes(snaps, slot, data)
    return snaps.commit(temp, slot=slot, tokens=tokens, written=len(data), task=9, fingerprint=FP)


def names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


# ---- commit --------------------------------------------------------------------------


def test_commit_publishes_file_and_manifest(snaps: store.SnapshotStore) -> None:
    data = os.urandom(4096)
    temp = server_writes(snaps, 1, data)
    record = snaps.commit(temp, slot=1, tokens=321, written=len(data), task=9, fingerprint=FP)
    stem = record.file.removesuffix(".bin")
    assert names(snaps.dir) == {record.file, stem + ".json"}
    assert manifest.NAME_RE.match(record.file)
    assert record.file.startswith("slot1-")
    assert (snaps.dir / record.file).read_bytes() == data
    assert record.sha256 == hashlib.sha256(data).hexdigest()
    assert (record.slot, record.tokens, record.bytes, record.task, record.fingerprint) == (1, 321, 4096, 9, FP)
    assert manifest.Manifest.from_json((snaps.dir / (stem + ".json")).read_text()) == record
    assert snaps.snapshots() == [record]
    assert snaps.snapshots(1) == [record]
    assert snaps.snapshots(0) == []


def test_committed_files_are_mode_0640(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    for name in (record.file, record.file.removesuffix(".bin") + ".json"):
        assert stat.S_IMODE((snaps.dir / name).stat().st_mode) == 0o640, name


def test_size_mismatch_is_refused_and_the_temp_file_removed(snaps: store.SnapshotStore) -> None:
    temp = server_writes(snaps, 0, b"x" * 100)  # a crash mid-save: truncated
    with pytest.raises(errors.SnapshotError) as info:
        snaps.commit(temp, slot=0, tokens=300, written=4096, task=9, fingerprint=FP)
    assert info.value.reason == "size"
    assert "100" in str(info.value)
    assert "4096" in str(info.value)
    assert names(snaps.dir) == set()
    assert snaps.snapshots() == []


def test_zero_tokens_is_refused_as_empty(snaps: store.SnapshotStore) -> None:
    temp = server_writes(snaps, 0, b"x" * 44)  # llama-server "saves" an empty slot as 44 bytes
    with pytest.raises(errors.SnapshotError) as info:
        snaps.commit(temp, slot=0, tokens=0, written=44, task=9, fingerprint=FP)
    assert info.value.reason == "empty"
    assert names(snaps.dir) == set()


def test_missing_temp_file_points_at_slot_dir(snaps: store.SnapshotStore) -> None:
    # The server wrote into its own --slot-save-path, which is not our --slot-dir.
    with pytest.raises(errors.SnapshotError) as info:
        snaps.commit(snaps.temp_name(0), slot=0, tokens=300, written=1000, task=9, fingerprint=FP)
    assert info.value.reason == "missing"
    assert "--slot-dir" in str(info.value)
    assert "--slot-save-path" in str(info.value)
    assert names(snaps.dir) == set()


def test_commits_get_distinct_names_and_newest_first(snaps: store.SnapshotStore) -> None:
    first, second, third = commit(snaps, 0), commit(snaps, 1), commit(snaps, 0)
    assert len({first.file, second.file, third.file}) == 3
    assert snaps.snapshots() == [third, second, first]
    assert snaps.snapshots(0) == [third, first]


# ---- scan ----------------------------------------------------------------------------


def test_scan_clean_removes_leftovers_and_keeps_good_snapshots(tmp_path: Path) -> None:
    good = commit(store.SnapshotStore(tmp_path, clock=StepClock()))
    leftovers = {
        ".tmp-slot0-0123456789ab.bin",  # a save the sidecar never committed
        ".tmp-0123456789ab.json",  # a manifest write cut short
        ".probe-0123456789ab.bin",  # a slot dir probe
        "slot3-20250101T000000000000Z.bin",  # renamed, but its manifest was never written
    }
    for name in leftovers:
        (tmp_path / name).write_bytes(b"junk")
    (tmp_path / "README.txt").write_text("not ours")
    fresh = store.SnapshotStore(tmp_path, clock=StepClock())
    findings = fresh.scan(clean=True)
    assert names(tmp_path) == {good.file, good.file.removesuffix(".bin") + ".json", "README.txt"}
    assert fresh.snapshots() == [good]
    assert len(findings) == len(leftovers)
    for name in leftovers:
        assert any(name in f for f in findings), name


def test_scan_without_clean_keeps_leftovers(tmp_path: Path) -> None:
    good = commit(store.SnapshotStore(tmp_path, clock=StepClock()))
    (tmp_path / ".tmp-slot0-0123456789ab.bin").write_bytes(b"in flight")
    (tmp_path / "slot3-20250101T000000000000Z.bin").write_bytes(b"being committed")
    fresh = store.SnapshotStore(tmp_path, clock=StepClock())
    assert fresh.scan(clean=False) == []
    assert fresh.snapshots() == [good]
    assert ".tmp-slot0-0123456789ab.bin" in names(tmp_path)
    assert "slot3-20250101T000000000000Z.bin" in names(tmp_path)


def test_scan_quarantines_a_truncated_snapshot(tmp_path: Path) -> None:
    keep = commit(store.SnapshotStore(tmp_path, clock=StepClock()), slot=0)
    bad = commit(store.SnapshotStore(tmp_path, clock=StepClock(2e9)), slot=1)
    with (tmp_path / bad.file).open("r+b") as fh:
        fh.truncate(10)
    fresh = store.SnapshotStore(tmp_path, clock=StepClock())
    seen = Quarantined()
    fresh.on_quarantine = seen
    fresh.scan(clean=True)
    assert fresh.snapshots() == [keep]
    assert [(name, reason) for name, reason, _ in seen.calls] == [(bad.file, "size")]
    stem = bad.file.removesuffix(".bin")
    assert {stem + ".bin.quarantined", stem + ".json.quarantined"} <= names(tmp_path)
    assert bad.file not in names(tmp_path)
    assert stem + ".json" not in names(tmp_path)


def test_scan_quarantines_a_corrupt_manifest(tmp_path: Path) -> None:
    bad = commit(store.SnapshotStore(tmp_path, clock=StepClock()), slot=0)
    stem = bad.file.removesuffix(".bin")
    (tmp_path / (stem + ".json")).write_text('{"format": 1, "slot": ')
    fresh = store.SnapshotStore(tmp_path, clock=StepClock())
    seen = Quarantined()
    fresh.on_quarantine = seen
    fresh.scan(clean=True)
    assert fresh.snapshots() == []
    assert [(name, reason) for name, reason, _ in seen.calls] == [(bad.file, "manifest")]
    assert names(tmp_path) == {stem + ".bin.quarantined", stem + ".json.quarantined"}


def test_refresh_drops_a_snapshot_whose_file_vanished(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    (snaps.dir / record.file).unlink()
    snaps.refresh(record.file)
    assert snaps.snapshots() == []


# ---- verify, quarantine, delete ------------------------------------------------------


def test_verify_passes_an_intact_file(snaps: store.SnapshotStore) -> None:
    snaps.verify(commit(snaps))


def test_verify_catches_a_flipped_byte(snaps: store.SnapshotStore) -> None:
    record = commit(snaps, data=bytes(range(256)) * 8)
    path = snaps.dir / record.file
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(errors.SnapshotError) as info:
        snaps.verify(record)
    assert info.value.reason == "checksum"


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_verify_catches_a_size_change(snaps: store.SnapshotStore, damage: str) -> None:
    record = commit(snaps)
    path = snaps.dir / record.file
    if damage == "truncate":
        path.write_bytes(b"short")
    else:
        path.unlink()
    with pytest.raises(errors.SnapshotError) as info:
        snaps.verify(record)
    assert info.value.reason == "size"


def test_quarantine_renames_both_files_and_unindexes(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    seen = Quarantined()
    snaps.on_quarantine = seen
    snaps.quarantine(record.file, "checksum", detail="flipped byte")
    stem = record.file.removesuffix(".bin")
    assert names(snaps.dir) == {stem + ".bin.quarantined", stem + ".json.quarantined"}
    assert snaps.snapshots() == []
    assert seen.calls == [(record.file, "checksum", "flipped byte")]
    snaps.scan(clean=True)  # a quarantined file is never offered again
    assert snaps.snapshots() == []


def test_quarantine_keeps_at_most_quarantine_keep(snaps: store.SnapshotStore) -> None:
    records = [commit(snaps, slot=i % 4) for i in range(store.QUARANTINE_KEEP + 3)]
    for age, record in enumerate(records):  # later records have newer files
        when = 1_700_000_000 + age
        os.utime(snaps.dir / record.file, (when, when))
    for record in records:
        snaps.quarantine(record.file, "checksum")
    kept_bins = {n for n in names(snaps.dir) if n.endswith(".bin.quarantined")}
    kept_jsons = {n for n in names(snaps.dir) if n.endswith(".json.quarantined")}
    newest = records[-store.QUARANTINE_KEEP :]
    assert kept_bins == {r.file + ".quarantined" for r in newest}
    assert kept_jsons == {r.file.removesuffix(".bin") + ".json.quarantined" for r in newest}
    assert names(snaps.dir) == kept_bins | kept_jsons


def test_delete_removes_manifest_and_file(snaps: store.SnapshotStore) -> None:
    keep, gone = commit(snaps, 0), commit(snaps, 0)
    snaps.delete(gone)
    assert names(snaps.dir) == {keep.file, keep.file.removesuffix(".bin") + ".json"}
    assert snaps.snapshots() == [keep]


def test_delete_unpublishes_the_manifest_before_the_file(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    json_name = record.file.removesuffix(".bin") + ".json"
    # Make the .bin impossible to unlink (a directory in its place): the manifest must already be gone.
    (snaps.dir / record.file).unlink()
    (snaps.dir / record.file).mkdir()
    with pytest.raises(IsADirectoryError):
        snaps.delete(record)
    assert json_name not in names(snaps.dir)
    assert snaps.snapshots() == []


def test_usage_counts_bytes_and_files(snaps: store.SnapshotStore) -> None:
    assert snaps.usage().used_bytes == 0
    assert snaps.usage().snapshot_files == 0
    commit(snaps, 0, data=b"a" * 1000)
    commit(snaps, 1, data=b"b" * 3000)
    (snaps.dir / ".tmp-slot2-000000000000.bin").write_bytes(b"c" * 500)
    (snaps.dir / "sub").mkdir()  # not a regular file: not counted
    on_disk = sum(p.stat().st_size for p in snaps.dir.iterdir() if p.is_file())
    usage = snaps.usage()
    assert usage.used_bytes == on_disk
    assert usage.used_bytes >= 4500
    assert usage.snapshot_files == 2
    assert usage.free_bytes > 0


def test_check_writable(tmp_path: Path) -> None:
    assert store.SnapshotStore(tmp_path, clock=StepClock()).check_writable() is None
    problem = store.SnapshotStore(tmp_path / "nope", clock=StepClock()).check_writable()
    assert problem is not None
    assert "does not exist" in problem


def _blocked_manifest_store(tmp_path: Path) -> tuple[store.SnapshotStore, str]:
    """A store whose next manifest cannot be written: a directory squats on its name.

    Stands in for the I/O failures a manifest write meets in production (disk full, EIO,
    a slot dir owned by llama-server's uid); as root, permissions cannot be used to make it fail.
    """
    probe_dir, real_dir = tmp_path / "probe", tmp_path / "real"
    probe_dir.mkdir()
    real_dir.mkdir()
    name = commit(store.SnapshotStore(probe_dir, clock=StepClock())).file
    (real_dir / name.replace(".bin", ".json")).mkdir()
    return store.SnapshotStore(real_dir, clock=StepClock()), name


def test_failed_manifest_write_is_a_snapshot_error_and_publishes_nothing(tmp_path: Path) -> None:
    snaps, name = _blocked_manifest_store(tmp_path)
    with pytest.raises(errors.SnapshotError) as info:
        commit(snaps)
    assert info.value.reason == "io"
    assert isinstance(info.value.__cause__, OSError)
    assert names(snaps.dir) == {name.replace(".bin", ".json")}  # only the squatter: no .bin, no temp files
    assert snaps.snapshots() == []


def test_read_only_store_reports_but_renames_nothing(tmp_path: Path) -> None:
    record = commit(store.SnapshotStore(tmp_path, clock=StepClock()))
    (tmp_path / record.file).write_bytes(b"short")
    before = names(tmp_path)
    seen = Quarantined()
    ro = store.SnapshotStore(tmp_path, clock=StepClock(), read_only=True)
    ro.on_quarantine = seen
    ro.scan(clean=False)
    assert [(name, reason) for name, reason, _ in seen.calls] == [(record.file, "size")]
    assert names(tmp_path) == before
