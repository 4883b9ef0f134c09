"""The committed recipes on disk: ``recipes/<name>.json``, each written last and atomically. Blocking I/O.

A recipe is written to a ``.tmp-`` file in the same directory, ``fsync``ed,
renamed over its name and the directory ``fsync``ed: a name holds either
the old recipe or the new one, never part of one, and a crash before the
rename leaves a temp file no reader lists (garbage collection removes it).
Recipes are read through :mod:`sidecar.core.safeio`: a symbolic link, a
FIFO or a file larger than any recipe is refused unread. A recipe read is
kept decoded while its file is the same (inode, size, mtime): a swap reads
its recipe for the check and again for the rebuild, and a recipe of a long
conversation is thousands of blocks of JSON.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from sidecar.blocks import recipe
from sidecar.core import errors, outcomes, safeio

SUFFIX = ".json"
TEMP_PREFIX = ".tmp-"
FILE_MODE = 0o640
DECODED_KEEP = 256
"""Recipes kept decoded (by name, while their file is unchanged)."""

_Stamp = tuple[int, int, int]


class RecipeDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._decoded: dict[str, tuple[_Stamp, recipe.Recipe]] = {}

    def of(self, name: str) -> Path:
        if not recipe.NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a recipe name: letters, digits, '_', '.', '-', not starting with '.'")
        return self.path / f"{name}{SUFFIX}"

    def names(self) -> list[str]:
        """Names of the committed recipes (temp files are not recipes)."""
        with os.scandir(self.path) as it:
            return sorted(
                e.name[: -len(SUFFIX)]
                for e in it
                if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file(follow_symlinks=False)
            )

    def temps(self) -> list[Path]:
        with os.scandir(self.path) as it:
            return [Path(e.path) for e in it if e.name.startswith(TEMP_PREFIX)]

    def read(self, name: str) -> recipe.Recipe:
        """The committed recipe ``name``; BlockStoreError (missing, recipe, not_regular, io) if unusable."""
        path = self.of(name)
        stamp = _stamp(path)
        kept = self._decoded.get(name)
        if kept is not None and stamp is not None and kept[0] == stamp:
            return kept[1]
        found = self._decode(name, path)
        if stamp is not None:
            if len(self._decoded) >= DECODED_KEEP:
                self._decoded.clear()
            self._decoded[name] = (stamp, found)
        return found

    def _decode(self, name: str, path: Path) -> recipe.Recipe:
        try:
            text = safeio.read_bounded(path, recipe.MAX_BYTES)
        except FileNotFoundError as exc:
            raise errors.BlockStoreError(
                f"no recipe {name!r} in the block store", reason=outcomes.BlockProblem.MISSING, name=name
            ) from exc
        except safeio.Refused as exc:
            reason = (
                outcomes.BlockProblem.NOT_REGULAR if exc.reason == safeio.NOT_REGULAR else outcomes.BlockProblem.RECIPE
            )
            raise errors.BlockStoreError(f"recipe {name!r} refused: {exc}", reason=reason, name=name) from exc
        except OSError as exc:
            raise errors.BlockStoreError(
                f"recipe {name!r} could not be read: {exc.strerror or exc}", reason=outcomes.BlockProblem.IO, name=name
            ) from exc
        try:
            found = recipe.Recipe.from_json(text.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.BlockStoreError(
                f"recipe {name!r} is damaged: {exc}", reason=outcomes.BlockProblem.RECIPE, name=name
            ) from exc
        if found.name != name:
            raise errors.BlockStoreError(
                f"recipe file {name!r} holds the recipe of {found.name!r}",
                reason=outcomes.BlockProblem.RECIPE,
                name=name,
            )
        return found

    def write(self, made: recipe.Recipe) -> int:
        """Commit ``made`` (temp file, fsync, rename, directory fsync); the bytes written."""
        final = self.of(made.name)
        data = made.to_json().encode()
        temp = self.path / f"{TEMP_PREFIX}{secrets.token_hex(8)}{SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                view, done = memoryview(data), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return len(data)

    def remove(self, name: str) -> bool:
        """Uncommit ``name``; False if it was not there. Its blocks go at the next collection."""
        self._decoded.pop(name, None)
        try:
            os.unlink(self.of(name))
        except FileNotFoundError:
            return False
        return True


def _stamp(path: Path) -> _Stamp | None:
    """(inode, size, mtime) of the regular file at ``path``; None if it is not one (the read then says why)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None
