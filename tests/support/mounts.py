"""A small tmpfs mounted for a test: a disk that fills up or turns read-only for real.

Mounting needs root (CI runs the tests as root): without it the test fails with
the reason, it is never skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """``path`` (created) with a tmpfs of ``size`` (``64m``) mounted on it for the block; lazily unmounted after."""
    assert os.geteuid() == 0, f"this test mounts a {size} tmpfs and needs root (CI runs as root): run it as root"
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs at ``path`` ``ro`` or ``rw``: the kernel then refuses (or takes) every write."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fs_type(path: Path) -> str:
    """The type of the filesystem ``path`` lies on (``ext4``, ``tmpfs``, ...), from ``/proc/self/mounts``."""
    where = path.resolve()
    best, kind = -1, ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, found, *_ = line.split()
        point = point.replace("\\040", " ")
        if (where == Path(point) or Path(point) in where.parents) and len(point) > best:
            best, kind = len(point), found
    return kind


def assert_on_disk(path: Path) -> None:
    """Fail (never skip) when ``path`` is in RAM: a test that counts disk writes would count none there."""
    kind = fs_type(path)
    assert kind not in ("tmpfs", "ramfs"), (
        f"{path} is on a {kind}: this test counts what reaches a disk; run it with TMPDIR (pytest's --basetemp) on one"
    )
