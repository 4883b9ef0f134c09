"""The blocks on disk: one file per block, named by its sha256, fanned out by its first two hex digits. Blocking I/O.

``blocks/3f/3fa2…`` holds the bytes whose sha256 is ``3fa2…``: 256
subdirectories keep each directory small (a million blocks, 512 GB of
8B-class KV, is 4,000 files per directory). A block is written once: to a
``.tmp-`` file in its own subdirectory, ``fdatasync``, then renamed to its
name, so a name only ever holds a whole block; a block the store already
holds (a regular file of the right size under its name) is never written
again. The subdirectories a write touched are ``fsync``ed by :meth:`sync`
before the caller commits a recipe naming the blocks, so after a power
loss a committed recipe still finds them. A ``.tmp-`` file is a write that
died: no recipe names it, and garbage collection removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TEMP_PREFIX = ".tmp-"
FILE_MODE = 0o640
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FANOUT = re.compile(r"[0-9a-f]{2}")
RACY_NS = 2_000_000_000
"""A folder whose mtime is this recent (or ahead of the clock) may change again within the same timestamp
(a filesystem's mtime moves in clock ticks, not nanoseconds): its count is not kept, it is listed next time."""


class BlockDir:
    def __init__(self, root: Path) -> None:
        self.path = root
        self._touched: set[Path] = set()

    def of(self, digest: str) -> Path:
        return self.path / digest[:2] / digest

    def holds(self, digest: str, size: int) -> bool:
        """Whether the block is here whole: a regular file of ``size`` bytes (a truncated one is not held)."""
        try:
            st = os.lstat(self.of(digest))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def put(self, digest: str, data: memoryview | bytes | bytearray) -> bool:
        """Store ``data`` under ``digest`` unless held already; True if it was written."""
        if self.holds(digest, len(data)):
            return False
        final = self.of(digest)
        folder = final.parent
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            self._touched.add(folder.parent)
        temp = folder / f"{TEMP_PREFIX}{digest[:16]}-{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            with memoryview(data) as view:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fdatasync(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        self._touched.add(folder)
        return True

    def sync(self) -> None:
        """``fsync`` every directory a :meth:`put` changed since the last call: its renames are durable."""
        for folder in sorted(self._touched, key=lambda p: len(p.parts), reverse=True):
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._touched.clear()

    def entries(self) -> Iterator[tuple[str, Path, int]]:
        """(digest, path, size) of every block; ``.tmp-`` files come as ("", path, size)."""
        if not self.path.is_dir():
            return
        with os.scandir(self.path) as top:
            folders = [e.path for e in top if _FANOUT.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        for folder in sorted(folders):
            with os.scandir(folder) as it:
                for entry in it:
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        if not stat.S_ISREG(st.st_mode):
                            continue
                        if _DIGEST.fullmatch(entry.name):
                            yield entry.name, Path(entry.path), st.st_size
                        elif entry.name.startswith(TEMP_PREFIX):
                            yield "", Path(entry.path), st.st_size


@dataclasses.dataclass(frozen=True, slots=True)
class Tally:
    blocks: int
    bytes: int


class Tallies:
    """The blocks' count and bytes, each fan-out folder's kept while the folder is unchanged (same inode and
    mtime): a read lists again only the folders a write or a collection changed since, not every block file
    (listing 100,000 blocks took 0.8 s here, a read after each save). Blocks are never rewritten in place, so
    an unchanged folder holds the same blocks; a block file truncated in place by another hand is counted at
    its old size until its folder changes (the gauges' figure; every restore checks sizes itself).
    Safe across threads: each read builds a new table and swaps it in."""

    def __init__(self, *, now_ns: Callable[[], int] = time.time_ns) -> None:
        self._now_ns = now_ns
        self._kept: dict[str, tuple[tuple[int, int], Tally]] = {}

    def total(self, blocks: BlockDir) -> Tally:
        if not blocks.path.is_dir():
            return Tally(0, 0)
        kept, fresh = self._kept, {}
        with os.scandir(blocks.path) as top:
            folders = [e for e in top if _FANOUT.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        count = size = 0
        for folder in folders:
            try:
                st = folder.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # collected meanwhile
            stamp = (st.st_ino, st.st_mtime_ns)
            known = kept.get(folder.name)
            tally = known[1] if known is not None and known[0] == stamp else _listed(folder.path)
            if self._now_ns() - st.st_mtime_ns > RACY_NS:
                fresh[folder.name] = (stamp, tally)
            count, size = count + tally.blocks, size + tally.bytes
        self._kept = fresh
        return Tally(count, size)


def _listed(folder: str) -> Tally:
    count = size = 0
    try:
        with os.scandir(folder) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and _DIGEST.fullmatch(entry.name):
                        count, size = count + 1, size + st.st_size
    except FileNotFoundError:
        pass  # collected meanwhile
    return Tally(count, size)
