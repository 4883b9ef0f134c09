"""One sidecar per slot dir, and per store dir: an exclusive ``flock`` held for the process lifetime.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/dirlock.py`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from sidecar.core import errors

LOCK_NAME = ".llama-kv-sidecar.lock"


class DirLock:
    """Hold with :meth:`acquire`; :meth:`release` (or process exit) lets go."""

    def __init__(
        self,
        slot_dir: Path,
        *,
        kind: str = "slot dir",
        remedy: str = "give this one the directory of its own llama-server",
    ) -> None:
        """``kind`` names the directory in messages (a slot dir, or a store dir); ``remedy`` says what to do."""
        self.dir = slot_dir
        self._kind = kind
        self._remedy = remedy
        self._fd: int | None = None
        self._held: tuple[int, int] | None = None
        """(device, inode) of the lock file this process holds."""

    @property
    def path(self) -> Path:
        return self.dir / LOCK_NAME

    def acquire(self) -> None:
        """Take the lock or raise ConfigError naming the sidecar that holds it."""
        try:
            # Held read-only: a file open for writing would stop the filesystem being remounted read-only.
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot open the lock file {self.path}: {exc.strerror or exc}: the {self._kind} must be "
                "writable by this user"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise errors.ConfigError(
                f"another llama-kv-sidecar holds the {self._kind} {self.dir} ({holder}): one sidecar per "
                f"{self._kind}; stop that one, or {self._remedy} "
                f"(lock file {LOCK_NAME})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
        try:
            _write_holder(self.path, body)
        except OSError as exc:
            os.close(fd)
            raise errors.ConfigError(
                f"cannot write the lock file {self.path}: {exc.strerror or exc}: the {self._kind} must be "
                "writable by this user"
            ) from exc
        self.release()
        self._fd = fd
        st = os.fstat(fd)
        self._held = (st.st_dev, st.st_ino)

    def holds(self) -> bool:
        """Whether the lock file in the slot dir now is the one this process locked.

        False after the directory was removed, moved or replaced: the lock
        went with the old directory and must be taken again on the new one.
        """
        if self._held is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._held

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self._held = None, None


def _write_holder(path: Path, body: str) -> None:
    """Who holds the lock, for the refusal of the next one (written through a descriptor closed at once)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, body.encode(), 0)
    finally:
        os.close(fd)


def _describe_holder(fd: int) -> str:
    try:
        raw = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {raw['pid']} on host {raw['host']}, since {raw['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: the lock file does not say"
