"""store.SnapshotStore on a real temporary directory: commit, scan, verify, quarantine, delete."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from pathlib import Path

import pytest
import xxhash

from sidecar.core import errors, events, hashing, outcomes, safeio
from sidecar.restore import plan
from sidecar.save import policy
from sidecar.snapshots import commit as checks
from sidecar.snapshots import manifest, store, storeevents
from tests.support import clocks
from tests.support.told import Told

FP = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)


@pytest.fixture
def told() -> Told:
    return Told()


@pytest.fixture
def snaps(tmp_path: Path, told: Told) -> store.SnapshotStore:
    return store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)


def server_writes(snaps: store.SnapshotStore, slot: int, data: bytes) -> str:
    """What llama-server does on POST /slots/{slot}?action=save with the store's temp name."""
    name = snaps.writer.temp_name(slot)
    (snaps.dir / name).write_bytes(data)
    return name


def commit(
    snaps: store.SnapshotStore, slot: int = 0, data: bytes = b"kv" * 500, tokens: int = 300
) -> manifest.Manifest:
    temp = server_writes(snaps, slot, data)
    return snaps.writer.commit(temp, slot=slot, tokens=tokens, written=len(data), task=9, fingerprint=FP)


def names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


# ---- commit --------------------------------------------------------------------------


def test_commit_publishes_file_and_manifest(snaps: store.SnapshotStore) -> None:
    data = os.urandom(4096)
    temp = server_writes(snaps, 1, data)
    record = snaps.writer.commit(temp, slot=1, tokens=321, written=len(data), task=9, fingerprint=FP)
    stem = record.file.removesuffix(".bin")
    assert names(snaps.dir) == {record.file, stem + ".json"}
    assert manifest.NAME_RE.match(record.file)
    assert record.file.startswith("slot1-")
    assert (snaps.dir / record.file).read_bytes() == data
    assert record.checksum == manifest.Checksum(hashing.Algorithm.XXH3_128, xxhash.xxh3_128_hexdigest(data))
    assert record.generation == 1
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
        snaps.writer.commit(temp, slot=0, tokens=300, written=4096, task=9, fingerprint=FP)
    assert info.value.reason == "size"
    assert "100" in str(info.value)
    assert "4096" in str(info.value)
    assert names(snaps.dir) == set()
    assert snaps.snapshots() == []


def test_zero_tokens_is_refused_as_empty(snaps: store.SnapshotStore) -> None:
    temp = server_writes(snaps, 0, b"x" * 44)  # llama-server "saves" an empty slot as 44 bytes
    with pytest.raises(errors.SnapshotError) as info:
        snaps.writer.commit(temp, slot=0, tokens=0, written=44, task=9, fingerprint=FP)
    assert info.value.reason == "empty"
    assert names(snaps.dir) == set()


def test_missing_temp_file_points_at_slot_dir(snaps: store.SnapshotStore) -> None:
    # The server wrote into its own --slot-save-path, which is not our --slot-dir.
    with pytest.raises(errors.SnapshotError) as info:
        snaps.writer.commit(snaps.writer.temp_name(0), slot=0, tokens=300, written=1000, task=9, fingerprint=FP)
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
    good = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    leftovers = {
        ".tmp-slot0-0123456789ab.bin",  # a save the sidecar never committed
        ".tmp-0123456789ab.json",  # a manifest write cut short
        ".probe-0123456789ab.bin",  # a slot dir probe
        "slot3-20250101T000000000000Z.bin",  # renamed, but its manifest was never written
    }
    for name in leftovers:
        (tmp_path / name).write_bytes(b"junk")
    (tmp_path / "README.txt").write_text("not ours")
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    findings = fresh.loader.scan(clean=True)
    assert names(tmp_path) == {good.file, good.file.removesuffix(".bin") + ".json", "README.txt"}
    assert fresh.snapshots() == [good]
    assert len(findings) == len(leftovers)
    for name in leftovers:
        assert any(name in f for f in findings), name


def test_scan_without_clean_keeps_leftovers(tmp_path: Path) -> None:
    good = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    (tmp_path / ".tmp-slot0-0123456789ab.bin").write_bytes(b"in flight")
    (tmp_path / "slot3-20250101T000000000000Z.bin").write_bytes(b"being committed")
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    assert fresh.loader.scan(clean=False) == []
    assert fresh.snapshots() == [good]
    assert ".tmp-slot0-0123456789ab.bin" in names(tmp_path)
    assert "slot3-20250101T000000000000Z.bin" in names(tmp_path)


def test_scan_quarantines_a_truncated_snapshot(tmp_path: Path) -> None:
    keep = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()), slot=0)
    bad = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping(2e9)), slot=1)
    with (tmp_path / bad.file).open("r+b") as fh:
        fh.truncate(10)
    told = Told()
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)
    seen = told.bad
    fresh.loader.scan(clean=True)
    assert fresh.snapshots() == [keep]
    assert [(name, reason) for name, reason, _ in seen.calls] == [(bad.file, "size")]
    stem = bad.file.removesuffix(".bin")
    assert {stem + ".bin.quarantined", stem + ".json.quarantined"} <= names(tmp_path)
    assert bad.file not in names(tmp_path)
    assert stem + ".json" not in names(tmp_path)


def test_scan_quarantines_a_corrupt_manifest(tmp_path: Path) -> None:
    bad = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()), slot=0)
    stem = bad.file.removesuffix(".bin")
    (tmp_path / (stem + ".json")).write_text('{"format": 1, "slot": ')
    told = Told()
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)
    seen = told.bad
    fresh.loader.scan(clean=True)
    assert fresh.snapshots() == []
    assert [(name, reason) for name, reason, _ in seen.calls] == [(bad.file, "manifest")]
    assert names(tmp_path) == {stem + ".bin.quarantined", stem + ".json.quarantined"}


def test_refresh_drops_a_snapshot_whose_file_vanished(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    (snaps.dir / record.file).unlink()
    snaps.loader.refresh(record.file)
    assert snaps.snapshots() == []


# ---- verify, quarantine, delete ------------------------------------------------------


def test_verify_passes_an_intact_file(snaps: store.SnapshotStore) -> None:
    snaps.curator.check(commit(snaps))


def test_verify_catches_a_flipped_byte(snaps: store.SnapshotStore) -> None:
    record = commit(snaps, data=bytes(range(256)) * 8)
    path = snaps.dir / record.file
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(errors.SnapshotError) as info:
        snaps.curator.check(record)
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
        snaps.curator.check(record)
    assert info.value.reason == "size"


def test_quarantine_renames_both_files_and_unindexes(snaps: store.SnapshotStore, told: Told) -> None:
    record = commit(snaps)
    seen = told.bad
    snaps.curator.quarantine(record.file, "checksum", detail="flipped byte")
    stem = record.file.removesuffix(".bin")
    assert names(snaps.dir) == {stem + ".bin.quarantined", stem + ".json.quarantined"}
    assert snaps.snapshots() == []
    assert seen.calls == [(record.file, "checksum", "flipped byte")]
    snaps.loader.scan(clean=True)  # a quarantined file is never offered again
    assert snaps.snapshots() == []


def test_quarantine_keeps_at_most_quarantine_keep(snaps: store.SnapshotStore) -> None:
    records = [commit(snaps, slot=i % 4) for i in range(store.QUARANTINE_KEEP + 3)]
    for age, record in enumerate(records):  # later records have newer files
        when = 1_700_000_000 + age
        os.utime(snaps.dir / record.file, (when, when))
    for record in records:
        snaps.curator.quarantine(record.file, "checksum")
    kept_bins = {n for n in names(snaps.dir) if n.endswith(".bin.quarantined")}
    kept_jsons = {n for n in names(snaps.dir) if n.endswith(".json.quarantined")}
    newest = records[-store.QUARANTINE_KEEP :]
    assert kept_bins == {r.file + ".quarantined" for r in newest}
    assert kept_jsons == {r.file.removesuffix(".bin") + ".json.quarantined" for r in newest}
    assert names(snaps.dir) == kept_bins | kept_jsons


def test_delete_removes_manifest_and_file(snaps: store.SnapshotStore) -> None:
    keep, gone = commit(snaps, 0), commit(snaps, 0)
    snaps.curator.delete(gone)
    assert names(snaps.dir) == {keep.file, keep.file.removesuffix(".bin") + ".json"}
    assert snaps.snapshots() == [keep]


def test_delete_unpublishes_the_manifest_before_the_file(snaps: store.SnapshotStore, told: Told) -> None:
    record = commit(snaps)
    json_name = record.file.removesuffix(".bin") + ".json"
    errors_seen = told.io
    # Make the .bin impossible to unlink (a directory in its place): the manifest must already be gone.
    (snaps.dir / record.file).unlink()
    (snaps.dir / record.file).mkdir()
    assert snaps.curator.delete(record) is False  # reported, not raised: retention must not end the process
    assert [(op, name) for op, name, _ in errors_seen.calls] == [("write", record.file)]
    assert json_name not in names(snaps.dir)
    assert snaps.snapshots() == []


def test_usage_counts_bytes_and_files(snaps: store.SnapshotStore) -> None:
    assert snaps.disk.usage().used_bytes == 0
    assert snaps.disk.usage().snapshot_files == 0
    commit(snaps, 0, data=b"a" * 1000)
    commit(snaps, 1, data=b"b" * 3000)
    (snaps.dir / ".tmp-slot2-000000000000.bin").write_bytes(b"c" * 500)
    (snaps.dir / "sub").mkdir()  # not a regular file: not counted
    on_disk = sum(p.stat().st_size for p in snaps.dir.iterdir() if p.is_file())
    usage = snaps.disk.usage()
    assert usage.used_bytes == on_disk
    assert usage.used_bytes >= 4500
    assert usage.snapshot_files == 2
    assert usage.free_bytes > 0


def test_check_writable(tmp_path: Path) -> None:
    assert store.SnapshotStore(tmp_path, clock=clocks.stepping()).disk.check_writable() is None
    problem = store.SnapshotStore(tmp_path / "nope", clock=clocks.stepping()).disk.check_writable()
    assert problem is not None
    assert "does not exist" in problem


def test_failed_manifest_write_is_a_snapshot_error_and_publishes_nothing(
    snaps: store.SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Disk full while the manifest is written: as root, permissions cannot be used to make it fail.
    real_fdopen = os.fdopen

    def full(fd: int, *args: object, **kwargs: object) -> object:
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", full)
    with pytest.raises(errors.SnapshotError) as info:
        commit(snaps)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert info.value.reason == "io"
    assert isinstance(info.value.__cause__, OSError)
    assert "No space left on device" in str(info.value)
    assert names(snaps.dir) == set()  # no .bin, no temp files
    assert snaps.snapshots() == []


def test_read_only_store_reports_but_renames_nothing(tmp_path: Path) -> None:
    record = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    (tmp_path / record.file).write_bytes(b"short")
    before = names(tmp_path)
    told = Told()
    seen = told.bad
    ro = store.SnapshotStore(tmp_path, clock=clocks.stepping(), read_only=True, events=told)
    ro.loader.scan(clean=False)
    assert [(name, reason) for name, reason, _ in seen.calls] == [(record.file, "size")]
    assert names(tmp_path) == before


# ---- ordering by generation, whatever the clock does -----------------------------------


def test_a_clock_stepped_back_neither_deletes_nor_hides_the_new_snapshot(tmp_path: Path) -> None:
    clock = clocks.FakeClock(epoch=0.0, now=2_000_000_000.0)
    snaps = store.SnapshotStore(tmp_path, clock=clock)
    before = commit(snaps, 0)
    clock.now -= 3600.0  # the clock steps back an hour
    after = commit(snaps, 0)
    assert after.created < before.created
    assert after.generation == before.generation + 1
    assert snaps.snapshots(0) == [after, before]
    # Retention keeps the one just committed, and a restore plan tries it first.
    doomed = policy.select_for_deletion(snaps.snapshots(), keep_per_slot=1, max_bytes=0, max_age=0, now=clock.now)
    assert [(m.file, reason) for m, reason in doomed] == [(before.file, outcomes.GcReason.KEEP)]
    view = events.SlotView(id=0, n_ctx=4096, processing=False, task=None, tokens=0)
    identity = events.Identity("b1", "/m.gguf", 4, 8192, 1000, 10)
    assert plan.plan_restore(view, snaps.snapshots(0), identity).candidates == (after, before)
    # The byte cap too takes the older generation first.
    capped = policy.select_for_deletion(
        [before, dataclasses.replace(after, slot=0), commit(snaps, 1)],
        keep_per_slot=5,
        max_bytes=1,
        max_age=0,
        now=clock.now,
    )
    assert [m.file for m, _ in capped] == [before.file]


def test_generations_continue_after_a_sidecar_restart(tmp_path: Path) -> None:
    clock = clocks.FakeClock(epoch=0.0, now=2_000_000_000.0)
    first = store.SnapshotStore(tmp_path, clock=clock)
    records = [commit(first, slot) for slot in (0, 1, 0)]
    assert [r.generation for r in records] == [1, 2, 3]
    first.curator.delete(records[0])
    clock.now = 1_000_000_000.0  # and the clock is far behind at the next start
    again = store.SnapshotStore(tmp_path, clock=clock)
    again.loader.scan(clean=True)
    newer = commit(again, 1)
    assert newer.generation == 4
    assert again.snapshots(1) == [newer, records[1]]


def test_the_same_instant_twice_gets_a_new_name_and_overwrites_nothing(tmp_path: Path) -> None:
    clock = clocks.FakeClock(epoch=0.0, now=2_000_000_000.0)
    snaps = store.SnapshotStore(tmp_path, clock=clock)
    first = commit(snaps, 0, data=b"a" * 100)
    second = commit(snaps, 0, data=b"b" * 100)  # the clock did not move (or came back to the same microsecond)
    assert first.file != second.file
    assert (tmp_path / first.file).read_bytes() == b"a" * 100
    assert (tmp_path / second.file).read_bytes() == b"b" * 100
    assert snaps.snapshots(0) == [second, first]


# ---- format 1 manifests: read, restorable, left as they are --------------------------


def _format_1(directory: Path, slot: int, stamp: str, data: bytes, created: float) -> str:
    """A snapshot committed by the previous release (manifest format 1, sha256)."""
    name = f"slot{slot}-{stamp}.bin"
    (directory / name).write_bytes(data)
    body = {
        "format": 1,
        "slot": slot,
        "file": name,
        "tokens": 300,
        "bytes": len(data),
        "sha256": hashlib_sha256(data),
        "created": created,
        "task": 9,
        "fingerprint": {
            "build_info": "b1",
            "model_path": "/m.gguf",
            "model_size": 1000,
            "model_params": 10,
            "n_ctx": 4096,
            "total_slots": 4,
        },
    }
    (directory / f"slot{slot}-{stamp}.json").write_text(json.dumps(body, indent=2))
    return name


def hashlib_sha256(data: bytes) -> str:
    import hashlib  # noqa: PLC0415 - only the format-1 fixtures need it

    return hashlib.sha256(data).hexdigest()


def test_format_1_snapshots_stay_restorable_and_untouched_and_new_ones_sort_above(tmp_path: Path) -> None:
    data = os.urandom(2048)
    old = _format_1(tmp_path, 0, "20991231T235959000000Z", data, created=4_000_000_000.0)  # a future clock
    text_before = (tmp_path / old.replace(".bin", ".json")).read_text()
    snaps = store.SnapshotStore(tmp_path, clock=clocks.FakeClock(epoch=0.0, now=2_000_000_000.0))
    assert snaps.loader.scan(clean=True) == []
    (loaded,) = snaps.snapshots()
    assert (loaded.generation, loaded.checksum.algorithm) == (0, hashing.Algorithm.SHA256)
    snaps.curator.check(loaded)  # checked with its own sha256
    new = commit(snaps, 0)
    assert snaps.snapshots(0) == [new, loaded]  # generation 1 beats generation 0 whatever the clocks said
    assert (tmp_path / old.replace(".bin", ".json")).read_text() == text_before  # never rewritten
    with (tmp_path / old).open("r+b") as fh:
        fh.write(bytes([data[0] ^ 0xFF]))
    with pytest.raises(errors.SnapshotError) as info:
        snaps.curator.check(loaded)
    assert info.value.reason == "checksum"
    assert "sha256" in str(info.value)


# ---- only proof of bad content quarantines -------------------------------------------


class FlakyReads:
    """Reads of the slot dir (``safeio.read_bounded``) failing with ``errno`` for one file name,
    ``times`` times (None: always)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, code: int, times: int | None) -> None:
        self.name, self.code, self.left = name, code, times
        self.failures = 0
        real = safeio.read_bounded

        def read_bounded(path: Path, max_bytes: int) -> bytes:
            if path.name == self.name and (self.left is None or self.left > 0):
                if self.left is not None:
                    self.left -= 1
                self.failures += 1
                raise OSError(self.code, os.strerror(self.code), str(path))
            return real(path, max_bytes)

        monkeypatch.setattr(safeio, "read_bounded", read_bounded)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_an_unreadable_manifest_is_reported_and_kept_not_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    record = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    json_name = record.file.replace(".bin", ".json")
    before = names(tmp_path)
    flaky = FlakyReads(monkeypatch, json_name, code, times=None)
    told = Told()
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)
    bad, io = told.bad, told.io
    fresh.loader.scan(clean=True)
    assert bad.calls == []
    assert names(tmp_path) == before  # nothing renamed, nothing deleted
    assert flaky.failures == store.READ_ATTEMPTS  # retried before it was reported
    assert [(op, name) for op, name, _ in io.calls] == [("read", json_name)]
    assert os.strerror(code) in io.calls[0][2]
    assert fresh.snapshots() == []
    flaky.left = 0  # the disk recovers: the next scan finds the snapshot again
    fresh.loader.scan(clean=False)
    assert fresh.snapshots() == [record]


def test_a_read_error_that_clears_on_retry_is_not_even_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    FlakyReads(monkeypatch, record.file.replace(".bin", ".json"), errno.EIO, times=1)
    told = Told()
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)
    io = told.io
    fresh.loader.scan(clean=True)
    assert fresh.snapshots() == [record]
    assert io.calls == []


def test_a_snapshot_known_before_stays_indexed_while_its_manifest_is_unreadable(
    snaps: store.SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = commit(snaps)
    FlakyReads(monkeypatch, record.file.replace(".bin", ".json"), errno.EIO, times=None)
    snaps.loader.scan(clean=False)
    snaps.loader.refresh(record.file)
    assert snaps.snapshots() == [record]


def test_an_io_error_while_verifying_is_not_proof(
    snaps: store.SnapshotStore, told: Told, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = commit(snaps)
    before = names(snaps.dir)

    def broken(fd: int, algorithm: hashing.Algorithm, **_: object) -> str:
        raise OSError(errno.EIO, "Input/output error", record.file)

    monkeypatch.setattr(hashing, "fd_digest", broken)
    io, bad = told.io, told.bad
    with pytest.raises(errors.SnapshotError) as info:
        snaps.curator.check(record)
    assert info.value.reason == "io"
    assert info.value.reason not in outcomes.BAD_CONTENT
    snaps.curator.quarantine(record.file, info.value.reason, detail=str(info.value))  # a careless caller
    assert bad.calls == []
    assert names(snaps.dir) == before
    assert [op for op, _, _ in io.calls] == ["read", "read"]


def test_files_vanishing_during_a_scan_are_a_race_not_damage(
    snaps: store.SnapshotStore, told: Told, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = commit(snaps)
    real = safeio.read_bounded

    def read_then_lose(path: Path, max_bytes: int) -> bytes:  # retention deletes the pair right after the read
        raw = real(path, max_bytes)
        if path.name == record.file.replace(".bin", ".json"):
            (snaps.dir / record.file).unlink()
            path.unlink()
        return raw

    monkeypatch.setattr(safeio, "read_bounded", read_then_lose)
    bad = told.bad
    snaps.loader.scan(clean=False)
    assert bad.calls == []
    assert snaps.snapshots() == []
    assert names(snaps.dir) == set()


def test_a_manifest_of_a_newer_format_is_left_alone_with_one_warning(tmp_path: Path) -> None:
    record = commit(store.SnapshotStore(tmp_path, clock=clocks.stepping()))
    json_path = tmp_path / record.file.replace(".bin", ".json")
    body = json.loads(json_path.read_text())
    body["format"] = manifest.FORMAT + 1
    body["checksum"] = {"algorithm": "some-future-hash", "digest": "?"}
    json_path.write_text(json.dumps(body))
    before = names(tmp_path)
    told = Told()
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping(), events=told)
    newer, bad = told.newer, told.bad
    for _ in range(3):
        fresh.loader.scan(clean=True)
    fresh.loader.refresh(json_path.name)
    assert newer == [(json_path.name, manifest.FORMAT + 1)]
    assert bad.calls == []
    assert fresh.snapshots() == []
    assert names(tmp_path) == before


def test_quarantine_trimming_never_touches_files_kept_for_io_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    keep = [commit(first, 0) for _ in range(store.QUARANTINE_KEEP + 2)]
    for record in keep:
        FlakyReads(monkeypatch, record.file.replace(".bin", ".json"), errno.EIO, times=None)
        monkeypatch.undo()
    FlakyReads(monkeypatch, keep[0].file.replace(".bin", ".json"), errno.EIO, times=None)
    fresh = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    fresh.loader.scan(clean=True)
    for record in keep[1:]:
        fresh.curator.quarantine(record.file, "checksum")
    assert keep[0].file in names(tmp_path)
    assert keep[0].file.replace(".bin", ".json") in names(tmp_path)


# ---- the slot dir itself going away --------------------------------------------------


def test_a_removed_slot_dir_is_reported_not_raised_and_recovers(tmp_path: Path) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    told = Told()
    snaps = store.SnapshotStore(slot_dir, clock=clocks.stepping(), events=told)
    record = commit(snaps)
    io = told.io
    slot_dir.rename(tmp_path / "moved")
    usage = snaps.disk.usage()  # statvfs of a missing dir: reported in the result, not raised
    assert "No such file or directory" in usage.problem
    problem = snaps.disk.check_writable()
    assert problem is not None
    assert "does not exist" in problem
    assert snaps.loader.scan(clean=False) == []
    assert snaps.snapshots() == []
    with pytest.raises(errors.SnapshotError):
        snaps.writer.commit(snaps.writer.temp_name(0), slot=0, tokens=300, written=1000, task=9, fingerprint=FP)
    assert [op for op, _, _ in io.calls] == ["scan"]  # said once, not at every call
    (tmp_path / "moved").rename(slot_dir)
    snaps.loader.scan(clean=False)
    assert snaps.disk.check_writable() is None
    assert snaps.disk.usage().problem == ""
    assert snaps.snapshots() == [record]


def test_a_blocked_store_lists_and_commits_nothing(snaps: store.SnapshotStore) -> None:
    record = commit(snaps)
    snaps.disk.block("another llama-kv-sidecar holds the slot dir")
    assert snaps.snapshots() == []
    assert snaps.disk.check_writable() == "another llama-kv-sidecar holds the slot dir"
    with pytest.raises(errors.SnapshotError, match="another llama-kv-sidecar"):
        commit(snaps)
    snaps.disk.block("")
    assert snaps.snapshots() == [record]


def test_other_json_files_in_the_slot_dir_are_not_manifests(snaps: store.SnapshotStore, told: Told) -> None:
    record = commit(snaps)
    (snaps.dir / ".llama-kv-sidecar.weights.json").write_text('{"/models/m.gguf": {}}')  # the weights cache
    (snaps.dir / "notes.json").write_text("[]")
    before = names(snaps.dir)
    bad = told.bad
    snaps.loader.scan(clean=True)
    snaps.loader.refresh(".llama-kv-sidecar.weights.json")
    assert bad.calls == []
    assert names(snaps.dir) == before
    assert snaps.snapshots() == [record]


# ---- router mode: one view per model ---------------------------------------------------


def test_a_model_view_names_its_files_after_the_model_and_lists_only_them(snaps: store.SnapshotStore) -> None:
    alpha, beta = snaps.for_model("org/alpha:Q4"), snaps.for_model("beta")
    a = commit(alpha)
    b = commit(beta, slot=1)
    plain = commit(snaps)
    tag = manifest.model_tag("org/alpha:Q4")
    assert a.file.startswith(tag + "--slot0-")
    assert "/" not in a.file
    assert ":" not in a.file
    assert a.model == "org/alpha:Q4"
    assert plain.model is None
    assert alpha.snapshots() == [a]
    assert beta.snapshots() == [b]
    assert snaps.for_model(None).snapshots() == [plain], "a plain server's engine never sees a model's files"
    assert {m.file for m in snaps.snapshots()} == {a.file, b.file, plain.file}, "ls, verify and /status see all"


def test_model_views_share_the_index_of_a_scan(tmp_path: Path) -> None:
    first = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    a = commit(first.for_model("alpha"))
    second = store.SnapshotStore(tmp_path, clock=clocks.stepping())
    view = second.for_model("alpha")  # made before the scan, as the engines are
    assert second.loader.scan(clean=True) == []
    assert view.snapshots() == [a]
    assert second.for_model("beta").snapshots() == []


def test_a_blocked_store_blocks_its_model_views(snaps: store.SnapshotStore) -> None:
    view = snaps.for_model("alpha")
    commit(view)
    snaps.disk.block("another sidecar holds the directory")
    assert view.snapshots() == []
    assert view.disk.check_writable() == "another sidecar holds the directory"


def test_a_manifest_whose_file_is_not_of_its_model_is_refused(snaps: store.SnapshotStore) -> None:
    record = commit(snaps.for_model("alpha"))
    text = dataclasses.replace(record, model="beta").to_json()
    with pytest.raises(ValueError, match="not a file of model 'beta'"):
        manifest.Manifest.from_json(text)
    assert manifest.Manifest.from_json(record.to_json()) == record


def test_a_link_planted_at_the_temp_name_after_the_hash_gets_no_chmod_and_is_not_published(
    snaps: store.SnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes(b"kv" * 500)
    outside.chmod(0o600)
    temp = server_writes(snaps, 0, b"kv" * 500)
    read_index = checks.read_index

    def planted(path: Path, events: storeevents.StoreEvents) -> manifest.Index | None:
        found = read_index(path, events)
        path.unlink()
        path.symlink_to(outside)  # between the write and the chmod, as an attacker in the slot dir would
        return found

    monkeypatch.setattr(checks, "read_index", planted)
    with pytest.raises(errors.SnapshotError) as info:
        snaps.writer.commit(temp, slot=0, tokens=300, written=1000, task=9, fingerprint=FP)
    assert info.value.reason == outcomes.SnapshotProblem.NOT_REGULAR
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600
    assert names(snaps.dir) == set()
    assert snaps.snapshots() == []


def test_a_hard_link_to_a_file_elsewhere_at_the_temp_name_is_refused_and_keeps_its_mode(
    snaps: store.SnapshotStore, tmp_path: Path
) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes(b"kv" * 500)
    outside.chmod(0o600)
    temp = snaps.writer.temp_name(0)
    os.link(outside, snaps.dir / temp)
    with pytest.raises(errors.SnapshotError) as info:
        snaps.writer.commit(temp, slot=0, tokens=300, written=1000, task=9, fingerprint=FP)
    assert info.value.reason == outcomes.SnapshotProblem.NOT_REGULAR
    assert "2 names" in str(info.value)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600
    assert outside.stat().st_nlink == 1
    assert names(snaps.dir) == set()
