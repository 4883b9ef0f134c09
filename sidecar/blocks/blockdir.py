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
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

TEMP_PREFIX = ".tmp-"
FILE_MODE = 0o640
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FANOUT = re.compile(r"[0-9a-f]{2}")


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
