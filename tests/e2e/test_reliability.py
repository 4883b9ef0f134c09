"""Faults the real llama-server can produce on demand, and what the sidecar does about them."""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import mounts
from tests.support.llamabed import MakeServer, complete, make_prompt, tokenize
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, bin_of, manifests
from tests.support.wait import wait_until

TOKENS = 1024


def _handled(side: SidecarProcess) -> float:
    """Restore rounds that reached slot 0: restored, left to a client, or raced by one.

    Restored by its `slot_restored` line: on a sliding-window model (the test model) `restores_total`
    counts a restore only once the slot's next request decided it.
    """
    restored = len([e for e in side.log_events("slot_restored") if e.get("slot") == 0])
    skipped = sum(side.metric("llama_sidecar_restores_total", slot="0", result=r) for r in ("slot_busy", "raced"))
    return restored + skipped


def _handled_more_than(side: SidecarProcess, before: float) -> bool:
    return _handled(side) > before


def _save_settled(side: SidecarProcess, n: int) -> str:
    """ "ok" once the `n`th save of slot 0 is committed, "failed" once one failed, else ""."""
    if side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") >= n:
        return "ok"
    return "failed" if side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") >= 1 else ""


def test_kill9_during_a_save_promotes_nothing_partial_and_restores_the_newest_complete_snapshot(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, figure: Callable[[str], None]
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "1"})
    first = make_prompt(server.url, TOKENS, seed=41)
    complete(server.url, first)
    side.wait_saved()
    (good,) = manifests(slot_dir)
    # A much bigger turn, and kill -9 the moment the server starts writing its file.
    bigger = first + " " + make_prompt(server.url, 8000, seed=42)
    complete(server.url, bigger)
    wait_until(
        lambda: any(p.name.startswith(".tmp-") for p in slot_dir.iterdir()),
        timeout=30,
        what="the second save to start writing",
        every=0.0005,
    )
    server.kill()
    # Two outcomes, told apart by what the sidecar got, not by timing: the kill beat the server's
    # reply (the save failed, the temp file is removed), or the reply came first (the file was
    # complete and checked, so it is committed and, with --keep-per-slot 1, replaces the first).
    outcome = side.wait_for(lambda: _save_settled(side, 2), what="the second save to commit or fail")
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 0, what="server down")
    server.start()
    server.wait_healthy()
    side.wait_restored()
    assert not [p for p in slot_dir.iterdir() if p.name.startswith(".tmp-")], "partial file left behind"
    committed = side.log_events("snapshot_committed")
    restored = side.log_events("slot_restored")[-1]
    if outcome == "ok":
        assert len(committed) == 2
        assert committed[1]["tokens"] > 8000
        assert manifests(slot_dir) == [committed[1]["file"].replace(".bin", ".json")]
        assert restored["file"] == committed[1]["file"]
        warm = complete(server.url, bigger + " and more")
        assert warm["timings"]["cache_n"] >= 0.95 * committed[1]["tokens"]
    else:
        assert len(committed) == 1
        assert manifests(slot_dir) == [good]
        assert restored["file"] == bin_of(good)
        warm = complete(server.url, first + " and more")
        assert warm["timings"]["cache_n"] >= 0.95 * TOKENS
    winner = "the write" if outcome == "ok" else "the kill"
    figure(f"kill -9 during a save: {winner} won; restored {restored['tokens']} tokens")


def _damage(path: Path, how: str) -> None:
    """Flip one byte in the middle, or cut the file in half, as a bad disk or a stray process would."""
    with path.open("r+b") as fh:
        if how == "flip":
            fh.seek(path.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
        else:
            fh.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_slot_whose_only_snapshot_is_corrupt_quarantines_it_restores_nothing_and_prefills_normally(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, damage: str
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    prompt = make_prompt(server.url, TOKENS, seed=43)
    complete(server.url, prompt)
    side.wait_saved()
    side.kill()  # damage the file while nobody watches
    (snapshot,) = slot_dir.glob("slot*.bin")
    _damage(snapshot, damage)
    server.restart(graceful=False)
    side = sidecar(server, slot_dir)
    reason = "checksum" if damage == "flip" else "size"
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_quarantined_total", reason=reason) == 1, what="quarantine"
    )
    # Caught before any restore call: a cut file by its size when the sidecar loads the dir, a flipped
    # one by its checksum when the files are checked at start-up. Nothing is left to restore.
    side.wait_for(lambda: side.status()["ready"], what="the sidecar ready after its restore round")
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="failed") == 0
    side.wait_for(lambda: side.log_events("snapshot_quarantined"), what="the quarantine's line")
    assert len(side.log_events("snapshot_quarantined")) == 1
    assert (slot_dir / (snapshot.name + ".quarantined")).exists()
    assert not snapshot.exists()
    cold = complete(server.url, prompt + " again")
    assert cold["timings"]["cache_n"] == 0  # a normal prefill: nothing garbage was restored


def test_corrupt_newest_snapshot_falls_back_to_the_older_one(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "2"})
    first = make_prompt(server.url, TOKENS, seed=54)
    complete(server.url, first)
    side.wait_saved()
    second = first + " " + make_prompt(server.url, 300, seed=55)
    complete(server.url, second)
    side.wait_saved(2)
    older, newest = manifests(slot_dir)
    side.kill()
    _damage(slot_dir / bin_of(newest), "flip")
    server.restart(graceful=False)
    side = sidecar(server, slot_dir)
    side.wait_restored()
    (restored,) = side.log_events("slot_restored")
    assert restored["file"] == bin_of(older)
    assert side.metric("llama_sidecar_snapshots_quarantined_total", reason="checksum") == 1
    assert (slot_dir / (bin_of(newest) + ".quarantined")).exists()
    assert manifests(slot_dir) == [older]
    warm = complete(server.url, second + " and on")
    assert warm["timings"]["cache_n"] >= 0.95 * restored["tokens"]  # the older turn, reused
    assert restored["tokens"] < 0.95 * len(tokenize(server.url, second))  # and not the newer one


def test_server_back_with_smaller_context_or_other_model_refuses_naming_the_field(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, TOKENS, seed=44))
    side.wait_saved()
    server.ctx_size = 512
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 1,
        what="incompatible (context)",
    )
    refused = side.wait_for(lambda: side.log_events("snapshot_incompatible")[:1], what="the refusal's line")
    assert "n_ctx" in refused[-1]["differences"]
    other = tmp_path / "same-weights-other-file.gguf"
    shutil.copyfile(server.model, other)
    server.ctx_size = 16384
    server.model = other
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 2,
        what="incompatible (model)",
    )
    refused = side.wait_for(lambda: side.log_events("snapshot_incompatible")[1:2], what="the second refusal's line")
    assert "model_path" in refused[-1]["differences"]
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0


def test_fewer_slots_refuses_every_snapshot_naming_total_slots(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir)
    for slot in (0, 1):
        complete(server.url, make_prompt(server.url, TOKENS, seed=45 + slot), id_slot=slot)
        side.wait_saved(slot=slot)
    server.n_slots = 1
    server.restart(graceful=False)
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 1,
        what="slot 0 refused",
    )
    # llama-server itself refuses state saved with another slot count (n_stream mismatch), so
    # the sidecar refuses it first, with the reason, instead of letting the server clear the slot.
    refused = side.wait_for(lambda: side.log_events("snapshot_incompatible")[:1], what="the refusal's line")
    assert "total_slots" in refused[0]["differences"]
    assert len(manifests(slot_dir)) == 2  # refused, not deleted: the old server may come back


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs as the slot dir. Mounting it needs root: without root this fails, never skips."""
    with mounts.tmpfs(tmp_path / "small", "64m") as mount:
        yield mount


def test_disk_floor_and_full_disk_skip_or_fail_saves_and_keep_the_good_snapshot(
    llama: MakeServer, sidecar: MakeSidecar, small_fs: Path
) -> None:
    server = llama(slot_dir=small_fs)
    # whole files in the slot dir (beside a tmpfs slot dir the block store is the default): its disk floor
    side = sidecar(
        server, small_fs, extra={"--min-free-bytes": str(40 << 20), "--keep-per-slot": "1", "--whole-files": ""}
    )
    prompt = make_prompt(server.url, 4096, seed=47)
    complete(server.url, prompt)
    side.wait_saved()
    good = manifests(small_fs)
    # Below the floor: the next save (estimated from the last one's bytes per token) is skipped.
    complete(server.url, prompt + " " + make_prompt(server.url, 200, seed=48))
    side.wait_for(lambda: side.log_events("snapshot_skipped_low_disk"), what="skip below the floor")
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="skipped") >= 1
    assert manifests(small_fs) == good
    assert side.get("/healthz")[0] == 200
    side.terminate()  # its final snapshot is skipped for the same reason

    # No floor, and a disk that fills up behind the estimate's back: the server's own write
    # runs out of space. The save fails, nothing partial is promoted, the good snapshot stays.
    side = sidecar(server, small_fs, extra={"--min-free-bytes": "0", "--keep-per-slot": "1", "--whole-files": ""})
    other = make_prompt(server.url, 1024, seed=49)  # ~8.5 MB on disk, estimated at ~5 MB
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * max(0, mounts.free_bytes(small_fs) - (6 << 20) - (512 << 10)))
    complete(server.url, other)
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") >= 1, what="failed save"
    )
    assert manifests(small_fs) == good
    assert not [p for p in small_fs.iterdir() if p.name.startswith(".tmp-")]
    filler.unlink()
    server.restart(graceful=False)
    side.wait_restored()
    assert side.log_events("slot_restored")[-1]["file"] == bin_of(good[0])


def test_hung_server_times_out_without_pile_up_and_recovers_without_a_false_restart(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--request-timeout": "0.5"})
    complete(server.url, make_prompt(server.url, TOKENS, seed=50))
    side.wait_saved()
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
    side.wait_saved()
    side.kill()
    good = manifests(slot_dir)
    # What a sidecar killed at each step leaves behind: a server temp file, a renamed file whose
    # manifest was never written, a manifest temp file.
    (slot_dir / ".tmp-slot0-deadbeef0000.bin").write_bytes(b"partial")
    (slot_dir / "slot0-20990101T000000000000Z.bin").write_bytes(b"renamed, no manifest")
    (slot_dir / ".tmp-cafe00000000.json").write_text("{")
    server.restart(graceful=False)
    side = sidecar(server, slot_dir)
    side.wait_restored()
    snapshot_files = sorted(p.name for p in slot_dir.iterdir() if not p.name.startswith(".llama-kv-sidecar"))
    assert snapshot_files == sorted([*good, bin_of(good[0])])
    assert len(side.log_events("slot_dir_cleaned")) == 3
    warm = complete(server.url, prompt + " more")
    assert warm["timings"]["cache_n"] >= 0.95 * TOKENS


def test_api_key_is_sent_and_never_logged(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    key = "sk-test-5e1dcar-do-not-log"
    server = llama(slot_dir=slot_dir, api_key=key)
    side = sidecar(server, slot_dir, env={"LLAMA_API_KEY": key}, extra={"--log-level": "debug"})
    complete(server.url, make_prompt(server.url, TOKENS, seed=52, api_key=key), api_key=key)
    side.wait_saved()
    assert key not in side.log_path.read_text()
    assert key not in side.get("/status")[1]
    for path in slot_dir.iterdir():
        assert path.stat().st_mode & 0o007 == 0, f"{path.name} is world-accessible"


def test_restart_loop_twenty_cycles_with_a_client(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, figure: Callable[[str], None]
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    assert side.proc is not None
    prompt = make_prompt(server.url, 512, seed=53)
    complete(server.url, prompt)
    side.wait_saved()
    rss: list[int] = []
    reused: list[int] = []
    for cycle in range(20):
        before = _handled(side)
        server.restart(graceful=False)
        if cycle % 4 == 3:
            # A client racing the sidecar to the restarted server: whoever is first, the outcome is
            # a restore (then the client reuses it), a slot left to the client (slot_busy), or a
            # request served during the restore call (raced).
            complete(server.url, prompt + f" turn {cycle}")
        side.wait_for(
            functools.partial(_handled_more_than, side, before),
            what=f"cycle {cycle} restored or skipped",
        )
        turn = complete(server.url, prompt + f" turn {cycle} again")
        reused.append(turn["timings"]["cache_n"])
        side.wait_saved(cycle + 2)
        status = Path(f"/proc/{side.proc.pid}/status").read_text()
        rss.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))))
    assert side.metric("llama_sidecar_server_restarts_total") == 20
    assert side.metric("llama_sidecar_snapshots_quarantined_total", reason="checksum") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="failed") == 0
    assert min(reused) >= 500, reused  # every turn reused the conversation's prefix
    assert rss[-1] - rss[4] < 4096, rss  # KiB: no growth once warmed up
    figure(f"20 kill -9 cycles: cache_n per turn min {min(reused)} max {max(reused)}")
    figure(f"20 kill -9 cycles: sidecar RSS {rss[0]} KiB at cycle 1, {rss[4]} at cycle 5, {rss[-1]} at cycle 20")
