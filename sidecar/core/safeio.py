"""Opening files in a directory others can write: no symlinks, regular files only, bounded reads. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/core/safeio.py`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FOLLOWING = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """The name is not a regular file of a bounded size; ``reason`` is ``not_regular`` or ``oversized``."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


NOT_REGULAR = "not_regular"
OVERSIZED = "oversized"


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, max_bytes: int | None = None, follow: bool = False) -> tuple[int, os.stat_result]:
    """An open descriptor of the regular file at ``path`` and its ``fstat``; the caller closes it.

    Raises :class:`Refused` for a symbolic link, anything not a regular file,
    or a file over ``max_bytes``; ``OSError`` for anything else (missing, EIO).
    ``follow``: a symbolic link is followed, and what it points to must be a
    regular file (for files outside the slot dir, such as the model: model
    caches are made of links).
    """
    try:
        fd = os.open(path, _FOLLOWING if follow else _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(
                f"{path.name} is a symbolic link: refused, whatever it points to", reason=NOT_REGULAR
            ) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path.name} is {kind(st.st_mode)}, not a regular file", reason=NOT_REGULAR)
        if max_bytes is not None and st.st_size > max_bytes:
            raise Refused(f"{path.name} holds {st.st_size} bytes, more than the {max_bytes} allowed", reason=OVERSIZED)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The content of the regular file at ``path``, refused unread if larger than ``max_bytes``."""
    fd, _ = open_regular(path, max_bytes=max_bytes)
    try:
        parts: list[bytes] = []
        left = max_bytes + 1  # one byte more: a file that grew since the fstat is refused too
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            parts.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) > max_bytes:
        raise Refused(f"{path.name} grew past {max_bytes} bytes while it was read", reason=OVERSIZED)
    return data


def lstat_regular(path: Path) -> os.stat_result:
    """``lstat`` of ``path``; :class:`Refused` unless it is a regular file (a symbolic link is refused)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path.name} is {kind(st.st_mode)}, not a regular file", reason=NOT_REGULAR)
    return st


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two stats are of one file (device and inode), whatever its name now."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
