"""The slot dir as a filesystem: list, measure, remove, set aside, write atomically. Blocking I/O.

Every call here either succeeds or reports its ``OSError`` through the
``report`` callback (operation, file name, error) and returns a value that
says so; none raises for the filesystem except :meth:`SlotDir.files` and
:meth:`SlotDir.write_atomically`, whose callers decide. A slot dir that is
removed, moved or unmounted under a running sidecar therefore shows up as
a problem in /readyz, not as a crash.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from sidecar.core import outcomes

TEMP_PREFIX = ".tmp-"

Report = Callable[[outcomes.SlotDirOperation, str, str], None]
"""(operation, file name, error)."""


class SlotDir:
    def __init__(self, path: Path, report: Report) -> None:
        self.path = path
        self._report = report
        self.problem = ""
        """The last error of the directory itself (listing, measuring); cleared by the next success."""

    def files(self) -> list[os.DirEntry[str]]:
        """Regular files of the directory; raises OSError if it cannot be listed."""
        found = []
        with os.scandir(self.path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        found.append(entry)
        self.problem = ""
        return found

    def names(self) -> list[str]:
        """Names of every entry but directories (FIFOs, links, devices too); raises OSError if unlistable."""
        found = []
        with os.scandir(self.path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if not entry.is_dir(follow_symlinks=False):
                        found.append(entry.name)
        self.problem = ""
        return found

    def measure(self) -> tuple[int, int] | str:
        """(bytes of its files, bytes free for unprivileged users), or the problem that stopped it."""
        try:
            entries = self.files()
            stats = os.statvfs(self.path)
        except OSError as exc:
            return self.failed(outcomes.SlotDirOperation.SCAN, exc)
        used = 0
        for entry in entries:
            with contextlib.suppress(OSError):  # removed since the listing
                used += entry.stat(follow_symlinks=False).st_size
        return used, stats.f_bavail * stats.f_frsize

    def free(self) -> int | str:
        """Bytes free for unprivileged users on its filesystem (one ``statvfs``, no listing), or the problem."""
        try:
            stats = os.statvfs(self.path)
        except OSError as exc:
            return self.failed(outcomes.SlotDirOperation.SCAN, exc)
        return stats.f_bavail * stats.f_frsize

    def check(self) -> str | None:
        """None if the directory is there and writable, else what is wrong."""
        if not self.path.is_dir():
            return (
                f"slot dir {self.path} does not exist or is not a directory (removed, moved or unmounted?): "
                "no snapshots or restores until it is back"
            )
        if not os.access(self.path, os.W_OK | os.X_OK):
            return f"slot dir {self.path} is not writable by this user (uid {os.getuid()})"
        return self.problem or None

    def identity(self) -> tuple[int, int] | None:
        """(device, inode) of the directory, None while it is missing: tells one put back from a new one."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def failed(self, operation: outcomes.SlotDirOperation, exc: OSError) -> str:
        """Remember and report (once per distinct error) an error of the directory itself."""
        problem = f"slot dir {self.path}: {describe(exc)}"
        if problem != self.problem:
            self._report(operation, "", describe(exc))
        self.problem = problem
        return problem

    def exists(self, name: str) -> bool:
        """Whether the name is taken (by anything, a dangling symbolic link too)."""
        try:
            return os.path.lexists(self.path / name)
        except OSError:
            return False

    def unlink(self, name: str) -> bool:
        """Remove a file; True if it is gone (also if it was never there)."""
        try:
            (self.path / name).unlink()
        except FileNotFoundError:
            return True
        except OSError as exc:
            self._report(outcomes.SlotDirOperation.WRITE, name, describe(exc))
            return False
        return True

    def set_aside(self, name: str, suffix: str) -> None:
        """Rename ``name`` to ``name + suffix`` if it exists."""
        try:
            os.replace(self.path / name, self.path / (name + suffix))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._report(outcomes.SlotDirOperation.WRITE, name, describe(exc))

    def write_atomically(self, name: str, text: str, *, mode: int) -> None:
        """Temp file, fsync, rename over ``name``, directory fsync; raises OSError (the temp file removed)."""
        temp = f"{TEMP_PREFIX}{secrets.token_hex(6)}{Path(name).suffix}"
        try:
            fd = os.open(self.path / temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(self.path / temp, self.path / name)
        except BaseException:
            self.unlink(temp)
            raise
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def describe(exc: OSError) -> str:
    """``No such file or directory (FileNotFoundError, errno 2): /path``."""
    name = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    return f"{name} ({type(exc).__name__}, errno {exc.errno})" + (f": {exc.filename}" if exc.filename else "")
