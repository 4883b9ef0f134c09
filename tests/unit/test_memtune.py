"""glibc's mmap threshold, set by the sidecar at start: freed slot-file buffers leave the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.core import memtune

PROBE = """
import concurrent.futures, os, random, sys
from sidecar.core import memtune
if sys.argv[1] == "set":
    assert memtune.fix_mmap_threshold()
kept = []
def slot_file(_):
    data = bytearray(os.urandom(64)) * (10 * 1024 * 1024 // 64)  # a 10 MB slot file, read and hashed
    kept.append([random.random() for _ in range(2000)])  # long-lived small objects made meanwhile
    return len(bytes(data[:100]))
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    for _ in range(30):
        list(pool.map(slot_file, range(8)))
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")))
"""


def _resident_kib(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* setting inherited
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return int(done.stdout.strip())


def test_freed_slot_file_buffers_leave_the_process_with_the_threshold_set_side_by_side_without() -> None:
    left = _resident_kib("default")
    set_ = _resident_kib("set")
    print(f"resident after 240 freed 10 MB buffers in 8 threads: {left} KiB by default, {set_} KiB with it set")
    assert set_ < 0.6 * left, (left, set_)


def test_a_threshold_set_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert memtune.fix_mmap_threshold() is False
