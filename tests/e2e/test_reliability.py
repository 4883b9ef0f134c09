"""Faults the real llama-server can produce on demand, and what the sidecar does about them."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.llamabed import MakeServer, complete, make_prompt
from support.sidecarbed import MakeSidecar, SidecarProcess

TOKENS = 1024


def _manifests(slot_dir: Path) -> list[str]:
    return sorted(p.name for p in slot_dir.glob("slot*.json"))


def _saved(side: SidecarProcess, n: int = 1, slot: int = 0) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot=str(slot), result="ok") >= n,
        what=f"{n} snapshot(s) of slot {slot}",
    )


def _restored(side: SidecarProcess, n: int = 1, slot: int = 0) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot=str(slot), result="ok") >= n,
        what=f"{n} restore(s) of slot {slot}",
    )


def _handled_more_than(side: SidecarProcess, before: float) -> bool:
    ok = side.metric("llama_sidecar_restores_total", slot="0", result="ok")
    return ok + side.metric("llama_sidecar_restores_total", slot="0", result="slot_busy") > before


def test_kill9_during_a_save_promotes_nothing_and_the_previous_snapshot_is_restored(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "1"})
    first = make_prompt(server.url, TOKENS, seed=41)
    complete(server.url, first)
    _saved(side)
    good = _manifests(slot_dir)
    # A much bigger turn, and kill -9 the moment the server starts writing its file.
    complete(server.url, first + " " + make_prompt(server.url, 8000, seed=42))
    deadline = time.monotonic() + 30
    while not any(p.name.startswith(".tmp-") for p in slot_dir.iterdir()):
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.0005)
    server.kill()
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 0, what="server down")
    server.start()
    server.wait_healthy()
    _restored(side)
    assert side.log_events("slot_restored")[-1]["file"] == good[0].replace(".json", ".bin")
    assert not [p for p in slot_dir.iterdir() if p.name.startswith(".tmp-")], "partial file left behind"
    # If the kill beat the write, the save failed; if the write won, it was a complete, checked file.
    committed = side.log_events("snapshot_committed")
    assert len(committed) in (1, 2)
    if len(committed) == 2:
        assert committed[1]["tokens"] > 8000
    else:
        assert side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") >= 1
    warm = complete(server.url, first + " and more")
    assert warm["timings"]["cache_n"] >= 0.95 * TOKENS


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_snapshot_is_quarantined_never_restored_and_the_slot_prefills_normally(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, damage: str
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, TOKENS, seed=43)
    complete(server.url, prompt)
    _saved(side)
    side.kill()  # damage the file while nobody watches, as a bad disk or a stray process would
    (snapshot,) = slot_dir.glob("slot*.bin")
    with snapshot.open("r+b") as fh:
        if damage == "flip":
            fh.seek(snapshot.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
        else:
            fh.truncate(snapshot.stat().st_size // 2)
    server.restart(graceful=False)
    side = sidecar(server, slot_dir)
    reason = "checksum" if damage == "flip" else "size"
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_quarantined_total", reason=reason) == 1, what="quarantine"
    )
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    assert len(side.log_events("snapshot_quarantined")) == 1
    assert (slot_dir / (snapshot.name + ".quarantined")).exists()
    assert not snapshot.exists()
    cold = complete(server.url, prompt + " again")
    assert cold["timings"]["cache_n"] == 0  # a normal prefill: nothing garbage was restored


def test_server_back_with_smaller_context_or_other_model_refuses_naming_the_field(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, TOKENS, seed=44))
    _saved(side)
    server.ctx_size = 512
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 1,
        what="incompatible (context)",
    )
    assert "n_ctx" in side.log_events("snapshot_incompatible")[-1]["differences"]
    other = tmp_path / "same-weights-other-file.gguf"
    shutil.copyfile(server.model, other)
    server.ctx_size = 16384
    server.model = other
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 2,
        what="incompatible (model)",
    )
    assert "model_path" in side.log_events("snapshot_incompatible")[-1]["differences"]
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0


def test_fewer_slots_refuses_every_snapshot_naming_total_slots(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir)
    for slot in (0, 1):
        complete(server.url, make_prompt(server.url, TOKENS, seed=45 + slot), id_slot=slot)
        _saved(side, slot=slot)
    server.n_slots = 1
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 1,
        what="slot 0 refused",
    )
    # llama-server itself refuses state saved with another slot count (n_stream mismatch), so
    # the sidecar refuses it first, with the reason, instead of letting the server clear the slot.
    assert "total_slots" in side.log_events("snapshot_incompatible")[0]["differences"]
    assert len(_manifests(slot_dir)) == 2  # refused, not deleted: the old server may come back


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the disk-full tests needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def test_disk_floor_and_full_disk_skip_or_fail_saves_and_keep_the_good_snapshot(
    llama: MakeServer, sidecar: MakeSidecar, small_fs: Path
) -> None:
    server = llama(slot_dir=small_fs)
    side = sidecar(server, small_fs, extra={"--min-free-bytes": str(40 << 20), "--keep-per-slot": "1"})
    prompt = make_prompt(server.url, 4096, seed=47)
    complete(server.url, prompt)
    _saved(side)
    good = _manifests(small_fs)
    # Below the floor: the next save (estimated from the last one's bytes per token) is skipped.
    complete(server.url, prompt + " " + make_prompt(server.url, 200, seed=48))
    side.wait_for(lambda: side.log_events("snapshot_skipped_low_disk"), what="skip below the floor")
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="skipped") >= 1
    assert _manifests(small_fs) == good
    assert side.get("/healthz")[0] == 200
    side.terminate()  # its final snapshot is skipped for the same reason

    # No floor, and a disk that fills up behind the estimate's back: the server's own write
    # runs out of space. The save fails, nothing partial is promoted, the good snapshot stays.
    side = sidecar(server, small_fs, extra={"--min-free-bytes": "0", "--keep-per-slot": "1"})
    other = make_prompt(server.url, 1024, seed=49)  # ~8.5 MB on disk, estimated at ~5 MB
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * max(0, _free(small_fs) - (6 << 20) - (512 << 10)))
    complete(server.url, other)
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") >= 1, what="failed save"
    )
    assert _manifests(small_fs) == good
    assert not [p for p in small_fs.iterdir() if p.name.startswith(".tmp-")]
    filler.unlink()
    server.restart(graceful=False)
    _restored(side)
    assert side.log_events("slot_restored")[-1]["file"] == good[0].replace(".json", ".bin")


def test_hung_server_times_out_without_pile_up_and_recovers_without_a_false_restart(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--request-timeout": "0.5"})
    complete(server.url, make_prompt(server.url, TOKENS, seed=50))
    _saved(side)
    assert side.proc is not None
    fds = Path(f"/proc/{side.proc.pid}/fd")
    server.pause()
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 0, what="hang noticed")
    counts = []
    for _ in range(10):
        started = time.monotonic()
        assert side.get("/healthz")[0] == 200
        assert time.monotonic() - started < 1.0
        counts.append(len(list(fds.iterdir())))
        time.sleep(0.5)
    assert max(counts) - min(counts) <= 2, counts  # no pile-up of sockets while every call times out
    server.resume()
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 1, what="recovery")
    time.sleep(1)
    assert side.metric("llama_sidecar_server_restarts_total") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0


def test_sidecar_killed_mid_work_cleans_up_and_keeps_every_good_snapshot(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, TOKENS, seed=51)
    complete(server.url, prompt)
    _saved(side)
    side.kill()
    good = _manifests(slot_dir)
    # What a sidecar killed at each step leaves behind: a server temp file, a renamed file whose
    # manifest was never written, a manifest temp file.
    (slot_dir / ".tmp-slot0-deadbeef0000.bin").write_bytes(b"partial")
    (slot_dir / "slot0-20990101T000000000000Z.bin").write_bytes(b"renamed, no manifest")
    (slot_dir / ".tmp-cafe00000000.json").write_text("{")
    server.restart(graceful=False)
    side = sidecar(server, slot_dir)
    _restored(side)
    assert sorted(p.name for p in slot_dir.iterdir()) == sorted([*good, good[0].replace(".json", ".bin")])
    assert len(side.log_events("slot_dir_cleaned")) == 3
    warm = complete(server.url, prompt + " more")
    assert warm["timings"]["cache_n"] >= 0.95 * TOKENS


def test_api_key_is_sent_and_never_logged(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    key = "sk-test-5e1dcar-do-not-log"
    server = llama(slot_dir=slot_dir, api_key=key)
    side = sidecar(server, slot_dir, env={"LLAMA_API_KEY": key}, extra={"--log-level": "debug"})
    complete(server.url, make_prompt(server.url, TOKENS, seed=52, api_key=key), api_key=key)
    _saved(side)
    assert key not in side.log_path.read_text()
    assert key not in side.get("/status")[1]
    for path in slot_dir.iterdir():
        assert path.stat().st_mode & 0o007 == 0, f"{path.name} is world-accessible"


def test_restart_loop_twenty_cycles_with_a_client(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    assert side.proc is not None
    prompt = make_prompt(server.url, 512, seed=53)
    complete(server.url, prompt)
    _saved(side)
    rss: list[int] = []
    reused: list[int] = []
    for cycle in range(20):
        before = side.metric("llama_sidecar_restores_total", slot="0", result="ok") + side.metric(
            "llama_sidecar_restores_total", slot="0", result="slot_busy"
        )
        server.restart(graceful=False)
        if cycle % 4 == 3:
            # A client racing the sidecar to the restarted server: whoever is first, the outcome is
            # a restore (then the client reuses it) or a slot left to the client (slot_busy).
            complete(server.url, prompt + f" turn {cycle}")
        side.wait_for(
            functools.partial(_handled_more_than, side, before),
            what=f"cycle {cycle} restored or skipped",
        )
        turn = complete(server.url, prompt + f" turn {cycle} again")
        reused.append(turn["timings"]["cache_n"])
        _saved(side, n=cycle + 2)
        status = Path(f"/proc/{side.proc.pid}/status").read_text()
        rss.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))))
    assert side.metric("llama_sidecar_server_restarts_total") == 20
    assert side.metric("llama_sidecar_snapshots_quarantined_total", reason="checksum") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="failed") == 0
    assert min(reused) >= 500, reused  # every turn reused the conversation's prefix
    assert rss[-1] - rss[4] < 4096, rss  # KiB: no growth once warmed up
    print(f"restart loop: 20 cycles, cache_n per turn {reused}, sidecar RSS KiB {rss[4]} -> {rss[-1]}")
