"""The soak's disk-full fault: a fill that races the product's writes is measured again, and one that never
fits still counts as a fault, with a window of that moment (it filled the disk for a moment)."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any, cast

import pytest

from bench.soak import faults, schedule

FREE = 4 << 20


def _faults(disk: Path) -> faults.Faults:
    return faults.Faults(
        rig=cast(Any, None),
        s3=cast(Any, None),
        disk=disk,
        clock=lambda: 50.0,
        say=lambda _line: None,
        leave=lambda: None,
        burst=lambda: 0,
    )


def _refusing(times: int) -> Any:
    """posix_fallocate that runs out of space ``times`` times (the product wrote meanwhile), then fills."""
    real = os.posix_fallocate
    calls = {"n": 0}

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] <= times:
            os.write(fd, b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    return fallocate


def test_a_fill_that_raced_the_products_writes_is_measured_again_and_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "product_free", lambda _path: FREE)
    monkeypatch.setattr(os, "posix_fallocate", _refusing(1))
    done = _faults(tmp_path)
    done.begin(schedule.Event(50.0, schedule.Fault.DISK_FULL, 5.0))
    assert done.seen.done["disk_full"] == 1
    assert (tmp_path / "soak-filler").stat().st_size == FREE - faults.FILL_LEFT
    assert [(w.fault, w.until) for w in done.seen.windows_now()] == [(schedule.Fault.DISK_FULL, math.inf)]
    assert done.seen.notes == []


def test_a_fill_that_never_fits_still_counts_as_a_fault_with_its_window_and_leaves_no_filler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be dropped as not done: the lost turns it caused went unexplained, and its partial filler
    (on a filesystem that keeps one) stayed behind."""
    monkeypatch.setattr(faults, "product_free", lambda _path: FREE)
    monkeypatch.setattr(os, "posix_fallocate", _refusing(faults.FILL_TRIES))
    done = _faults(tmp_path)
    done.begin(schedule.Event(50.0, schedule.Fault.DISK_FULL, 5.0))
    assert done.seen.done["disk_full"] == 1
    assert done.seen.skipped["disk_full"] == 0
    assert [(w.fault, w.at, w.until) for w in done.seen.windows_now()] == [(schedule.Fault.DISK_FULL, 50.0, 50.0)]
    assert not (tmp_path / "soak-filler").exists()
