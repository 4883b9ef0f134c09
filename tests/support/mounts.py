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
