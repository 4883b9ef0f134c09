"""One sidecar per slot dir: dirlock.DirLock, and the commands that take it or do not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.core import errors, protocols
from sidecar.snapshots import dirlock, manifest, store

FP = manifest.Fingerprint("b1", "/models/m.gguf", 100, 200, 4096, 1)


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = dirlock.DirLock(tmp_path)
    first.acquire()
    try:
        held = json.loads((tmp_path / dirlock.LOCK_NAME).read_text())
        assert held["pid"] == os.getpid()
        assert held["host"] == socket.gethostname()
        with pytest.raises(errors.ConfigError) as info:
            dirlock.DirLock(tmp_path).acquire()
        message = str(info.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}, since {held['since']}" in message
        assert str(tmp_path) in message
        assert first.holds()
    finally:
        first.release()
    second = dirlock.DirLock(tmp_path)
    second.acquire()  # released: free again
    second.release()


def test_the_kernel_releases_the_lock_of_a_dead_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from sidecar.snapshots import dirlock; "
            "dirlock.DirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(errors.ConfigError, match=f"pid {holder.pid} "):
            dirlock.DirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    lock = dirlock.DirLock(tmp_path)
    lock.acquire()  # the lock file is still there, with the dead pid in it: no matter
    lock.release()


def test_a_replaced_directory_is_no_longer_held(tmp_path: Path) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    lock = dirlock.DirLock(slot_dir)
    lock.acquire()
    slot_dir.rename(tmp_path / "old")
    assert not lock.holds()
    slot_dir.mkdir()
    assert not lock.holds()
    lock.acquire()  # taken again on the new directory
    assert lock.holds()
    lock.release()
    assert not lock.holds()


def _snapshot(directory: Path) -> manifest.Manifest:
    snaps = store.SnapshotStore(directory, clock=protocols.SystemClock())
    temp = snaps.writer.temp_name(0)
    (directory / temp).write_bytes(os.urandom(3000))
    return snaps.writer.commit(temp, slot=0, tokens=300, written=3000, task=3, fingerprint=FP)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_verify_takes_the_lock_but_ls_and_dry_run_do_not(tmp_path: Path) -> None:
    record = _snapshot(tmp_path)
    lock = dirlock.DirLock(tmp_path)
    lock.acquire()
    try:
        ls = _cli("ls", "--slot-dir", str(tmp_path))
        assert ls.returncode == 0, ls.stderr
        assert record.file in ls.stdout
        dry = _cli("verify", "--slot-dir", str(tmp_path), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        refused = _cli("verify", "--slot-dir", str(tmp_path))
        assert refused.returncode == 2
        assert f"pid {os.getpid()}" in refused.stderr
        assert "another llama-kv-sidecar holds the slot dir" in refused.stderr
    finally:
        lock.release()
    assert _cli("verify", "--slot-dir", str(tmp_path)).returncode == 0
