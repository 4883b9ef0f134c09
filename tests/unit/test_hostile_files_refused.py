"""Files put in the slot dir to hang the sidecar or to be handed to the server: each is refused, never read.

A ``.bin`` linked to ``/dev/zero`` whose manifest says 0 bytes, a FIFO named
like a manifest, a ``.bin`` linked to a file outside the directory with a
consistent manifest, a manifest of a gigabyte. Each is refused by name
(quarantined, with the reason), in bounded time and memory, and the good
snapshots beside it stay.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from pathlib import Path

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from sidecar.core import errors, events, hashing, metrics, protocols, safeio
from sidecar.engine import report
from sidecar.restore import restorer
from sidecar.slots import actions
from sidecar.snapshots import manifest, store
from tests.support import clocks, told
from tests.unit import memllama

FP = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)
STAMP = "20261201T100000000000Z"


def fresh(path: Path) -> tuple[store.SnapshotStore, told.Calls]:
    reports = told.Told()
    snaps = store.SnapshotStore(path, clock=protocols.SystemClock(), events=reports)
    return snaps, reports.bad


def good(snaps: store.SnapshotStore) -> manifest.Manifest:
    data = b"kv" * 500
    temp = snaps.writer.temp_name(0)
    (snaps.dir / temp).write_bytes(data)
    return snaps.writer.commit(temp, slot=0, tokens=300, written=len(data), task=9, fingerprint=FP)


def manifest_for(name: str, data_size: int, digest: str, *, slot: int = 1) -> str:
    record = manifest.Manifest(
        slot=slot,
        file=name,
        tokens=100,
        bytes=data_size,
        checksum=manifest.Checksum(hashing.Algorithm.XXH3_128, digest),
        generation=99,
        created=time.time(),
        task=1,
        fingerprint=FP,
    )
    return record.to_json()


def test_a_bin_linked_to_dev_zero_with_a_zero_byte_manifest_is_refused_and_never_hashed(tmp_path: Path) -> None:
    snaps, bad = fresh(tmp_path)
    kept = good(snaps)
    name = f"slot1-{STAMP}.bin"
    (tmp_path / name).symlink_to("/dev/zero")
    (tmp_path / name.replace(".bin", ".json")).write_text(manifest_for(name, 0, xxhash.xxh3_128_hexdigest(b"")))
    snaps.loader.scan(clean=True)
    assert snaps.snapshots() == [kept]
    assert [(n, r) for n, r, _ in bad.calls] == [(name, "not_regular")]
    assert "symbolic link" in bad.calls[0][2]
    assert (tmp_path / (name + store.QUARANTINE_SUFFIX)).is_symlink()  # set aside, link and all
    lying = manifest.Manifest.from_json(manifest_for(name, 0, "0" * 32))
    (tmp_path / name).symlink_to("/dev/zero")  # put back: a check of it must refuse, not hash forever
    started = time.monotonic()
    with pytest.raises(errors.SnapshotError) as refused:
        snaps.curator.check(lying)
    assert refused.value.reason == "not_regular"
    assert time.monotonic() - started < 1.0


def test_a_fifo_named_like_a_manifest_neither_blocks_a_refresh_nor_a_scan(tmp_path: Path) -> None:
    snaps, bad = fresh(tmp_path)
    kept = good(snaps)
    name = f"slot1-{STAMP}.json"
    (tmp_path / name.replace(".json", ".bin")).write_bytes(b"kv" * 10)
    os.mkfifo(tmp_path / name)
    done = threading.Event()

    def refresh() -> None:
        snaps.loader.refresh(name)
        snaps.loader.scan(clean=False)
        done.set()

    worker = threading.Thread(target=refresh, daemon=True)
    worker.start()
    try:
        assert done.wait(5.0), "a refresh of the FIFO blocked"
    finally:
        if not done.is_set():  # unblock a reader stuck in open() before the test ends
            fd = os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            worker.join(5.0)
    assert snaps.snapshots() == [kept]
    assert [(n, r) for n, r, _ in bad.calls] == [(name.replace(".json", ".bin"), "not_regular")]
    assert "FIFO" in bad.calls[0][2]


def test_a_bin_linked_outside_the_dir_with_a_consistent_manifest_is_refused(tmp_path: Path) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    snaps, bad = fresh(slot_dir)
    kept = good(snaps)
    outside = tmp_path / "secret"
    outside.write_bytes(b"root:x:0:0::/root:/bin/sh\n" * 40)
    name = f"slot1-{STAMP}.bin"
    (slot_dir / name).symlink_to(outside)
    text = manifest_for(name, outside.stat().st_size, xxhash.xxh3_128_hexdigest(outside.read_bytes()))
    (slot_dir / name.replace(".bin", ".json")).write_text(text)
    snaps.loader.scan(clean=False)
    assert snaps.snapshots() == [kept]
    assert [(n, r) for n, r, _ in bad.calls] == [(name, "not_regular")]
    (slot_dir / name).symlink_to(outside)  # and if it came back between a scan and a check
    with pytest.raises(errors.SnapshotError) as refused:
        snaps.curator.check(manifest.Manifest.from_json(text))
    assert refused.value.reason == "not_regular"
    assert outside.read_bytes().startswith(b"root:")  # never written to, never renamed


def test_a_manifest_of_a_gigabyte_is_refused_unread(tmp_path: Path) -> None:
    snaps, bad = fresh(tmp_path)
    kept = good(snaps)
    name = f"slot1-{STAMP}.json"
    (tmp_path / name.replace(".json", ".bin")).write_bytes(b"kv" * 10)
    with (tmp_path / name).open("wb") as fh:
        fh.truncate(1 << 30)  # sparse: a gigabyte to read, nothing on disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    snaps.loader.scan(clean=False)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert snaps.snapshots() == [kept]
    assert [(n, r) for n, r, _ in bad.calls] == [(name.replace(".json", ".bin"), "oversized")]
    assert str(manifest.MAX_BYTES) in bad.calls[0][2]
    assert grown_kib < 64 << 10  # not read: the process grew by less than 64 MiB


def test_a_hash_reads_no_further_than_the_size_it_expects_and_gives_up_at_its_deadline() -> None:
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        started = time.monotonic()
        assert hashing.fd_digest(fd, hashing.Algorithm.XXH3_128, limit=3 << 20) == xxhash.xxh3_128_hexdigest(
            bytes(3 << 20)
        )
        assert time.monotonic() - started < 5.0
        with pytest.raises(hashing.Overdue):
            hashing.fd_digest(fd, hashing.Algorithm.XXH3_128, deadline=time.monotonic() + 0.2)  # no limit at all
    finally:
        os.close(fd)


def test_safeio_refuses_links_fifos_and_devices_by_what_they_are(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to("/dev/zero")
    for name in ("fifo", "link"):
        with pytest.raises(safeio.Refused) as refused:
            safeio.read_bounded(tmp_path / name, 1024)
        assert refused.value.reason == "not_regular"
    with pytest.raises(safeio.Refused):
        safeio.read_bounded(Path("/dev/zero"), 1024)
    (tmp_path / "big").write_bytes(b"x" * 2000)
    with pytest.raises(safeio.Refused) as refused:
        safeio.read_bounded(tmp_path / "big", 1024)
    assert refused.value.reason == "oversized"
    assert safeio.read_bounded(tmp_path / "big", 2000) == b"x" * 2000


async def test_a_check_that_hangs_is_seen_by_liveness_once_past_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read blocked in the kernel (a hung disk or mount) cannot be cancelled: /healthz must say so."""
    server = memllama.MemLlama(tmp_path)
    snaps = store.SnapshotStore(tmp_path, clock=protocols.SystemClock())
    record = good(snaps)
    clock = clocks.FakeClock()
    worker = restorer.Restorer(
        slot_actions=actions.SlotActions(client=server, snapshots=snaps),
        snapshots=snaps,
        stats=metrics.Metrics(CollectorRegistry(), version="t"),
        clock=clock,
        identity=lambda: memllama.IDENTITY,
    ).checks
    release = threading.Event()
    monkeypatch.setattr(snaps.curator, "check", lambda _record: release.wait(10.0))
    checking = asyncio.create_task(worker.precheck())
    while worker.checking is None:
        await asyncio.sleep(0.01)
    live = report.Liveness(poll_seconds=30.0, action_seconds=60.0)
    status = report.Status(
        server_url="http://mem-llama",
        observation=None,
        identity=None,
        link_ok=None,
        link_problem="",
        last_snapshot=None,
        last_restore=(),
        progress_at=clock.monotonic() - 1000.0,  # the loop's own figure would call it stuck long ago
        acting=True,
        check=worker.checking,
    )
    assert worker.checking.file == record.file
    deadline = worker.checking.deadline
    assert live.stall(status, deadline) is None  # a long hash within its deadline is alive
    stuck = live.stall(status, deadline + report.CHECK_GRACE + 1.0)
    assert stuck is not None
    assert record.file in stuck
    assert "blocked" in stuck
    release.set()
    await checking
    assert worker.checking is None
