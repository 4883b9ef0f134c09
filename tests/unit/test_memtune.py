"""glibc's mmap threshold, set by the sidecar at start: freed slot-file buffers leave the process."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from sidecar.app import run
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


TRIM_PROBE = """
import concurrent.futures, os, random, sys, time
from sidecar.core import memtune
kept = []
def blocks(_):
    held = [os.urandom(64 * 1024) for _ in range(160)]  # a slot file's blocks, read and hashed
    kept.append([random.random() for _ in range(500)])  # long-lived small objects made meanwhile
    return len(held)
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    for _ in range(60):
        list(pool.map(blocks, range(8)))
took = 0.0
if sys.argv[1] == "trim":
    began = time.perf_counter()
    assert memtune.trim()
    took = time.perf_counter() - began
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(rss, took)
"""


def _trimmed(mode: str) -> tuple[int, float]:
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE, mode], capture_output=True, text=True, env=env, check=True)
    rss, took = done.stdout.split()
    return int(rss), float(took)


def test_freed_blocks_leave_the_threads_heaps_when_trimmed_side_by_side_without() -> None:
    left, _ = _trimmed("keep")
    trimmed, took = _trimmed("trim")
    print(f"resident after 76,800 freed 64 KiB blocks in 8 threads: {left} KiB kept, {trimmed} KiB trimmed")
    print(f"the trim took {took:.4f} s")
    assert trimmed < 0.5 * left, (left, trimmed)
    assert took < 0.5


async def test_runs_trim_task_trims_again_and_again_until_the_allocator_has_no_trim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return len(calls) < 3  # glibc twice, then "not glibc": the task ends

    monkeypatch.setattr(memtune, "trim", trim)
    monkeypatch.setattr(memtune, "TRIM_SECONDS", 0.0)
    await asyncio.wait_for(run._trim(), timeout=5)
    assert len(calls) == 3
