"""Where the sidecar keeps things by default: the state dir, the block store in it, and the staging dir.

With no directory flag the sidecar needs none from the user:

- the **state dir** (``--state-dir``, ``$XDG_STATE_HOME/llama-kv-sidecar``, else
  ``~/.local/state/llama-kv-sidecar``) is created 0700 when missing (its parent must exist), and
  holds the block store (``store/``) and, when needed, a staging dir on disk (``slots/``);
- the **staging dir**, llama-server's ``--slot-save-path``, is on a tmpfs (``/dev/shm``) when that
  has room for the largest slot file the command can write (:mod:`.slotsize`): created 0700 and
  removed at exit. Otherwise it is ``slots/`` beside the store on disk, and that cost is said. A
  save that does not fit in the tmpfs at the time goes to the store's disk anyway (``spill``).

:func:`default_state_dir` and :func:`choose` are pure; :func:`prepare` and :func:`ram_dir` touch the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from sidecar.core import errors

NAME = "llama-kv-sidecar"
STORE = "store"
"""The block store's folder in the state dir."""
SLOTS = "slots"
"""The staging dir on disk in the state dir (and the whole files' slot dir with ``--whole-files``)."""
SHM = Path("/dev/shm")  # noqa: S108 (the tmpfs every Linux host mounts; a dir of ours, 0700, made in it)
DIR_MODE = 0o700
PROBE = ".llama-kv-sidecar.probe"
MADE = ".llama-kv-sidecar.store-made"
"""Written in the state dir when its store is created: a store that vanished later is refused, not made anew."""
MARGIN = 1 << 20
"""Bytes a tmpfs keeps free beyond the largest slot file (and a sixteenth of it) to be chosen."""


class Staging(enum.StrEnum):
    """Where llama-server saves and restores slot files."""

    RAM = "ram"
    """A tmpfs: a save is written to RAM, the store keeps only what it lacks on disk."""
    DISK = "disk"
    """The state dir's ``slots/`` on disk: every save is written to disk whole before the store takes it."""
    GIVEN = "given"
    """The user's ``--slot-dir``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    staging: Staging
    why: str = ""
    """Why (for ``disk``: the cost, and the fix)."""


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/llama-kv-sidecar``, else ``$HOME/.local/state/llama-kv-sidecar``. Pure."""
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / NAME
    home = env.get("HOME") or str(Path("~").expanduser())
    return Path(home) / ".local" / "state" / NAME


def choose(*, slot_bytes: int | None, tmpfs_free: int | None) -> Choice:
    """RAM staging when the tmpfs has room for the largest slot file, else on disk with the cost. Pure.

    ``slot_bytes``: None when the model could not be read (RAM, as a save that does not fit goes to disk);
    ``tmpfs_free``: None when there is no tmpfs to use.
    """
    if tmpfs_free is None:
        return Choice(
            Staging.DISK,
            f"no writable tmpfs at {SHM}: every save is written to disk whole before the block store keeps what "
            "it lacks (about twice the disk writes of RAM staging, and a save stalls the server longer); mount a tmpfs "
            f"at {SHM}, or give --slot-dir a tmpfs directory",
        )
    if slot_bytes is None or slot_bytes + slot_bytes // 16 + MARGIN <= tmpfs_free:
        return Choice(Staging.RAM)
    return Choice(
        Staging.DISK,
        f"{SHM} has {tmpfs_free / 2**20:.0f} MiB free, less than the largest slot file of this command "
        f"({slot_bytes / 2**20:.0f} MiB: KV per token x context): every save is written to disk whole before "
        "the block store keeps what it lacks (about twice the disk writes of RAM staging, and a save stalls "
        f"the server longer); give {SHM} more room (Docker: --shm-size; Compose: a tmpfs mount with a size), "
        "lower -c, or give --slot-dir a tmpfs directory with room",
    )


def prepare(state_dir: Path, *, flag: str) -> None:
    """Create the state dir 0700 when missing (its parent must exist), and check it is a writable directory.

    Raises ConfigError naming ``flag`` (how it was set) and the fix.
    """
    try:
        state_dir.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise errors.ConfigError(
            f"state dir {state_dir}: its parent {state_dir.parent} does not exist; create it, or give {flag} "
            "a directory whose parent exists (it is created there, 0700)"
        ) from None
    except OSError as exc:
        raise errors.ConfigError(f"state dir {state_dir}: cannot create it ({_why(exc)}); {_fix(flag)}") from None
    if not state_dir.is_dir():
        raise errors.ConfigError(f"state dir {state_dir} is not a directory; {_fix(flag)}")
    probe = state_dir / PROBE
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise errors.ConfigError(f"state dir {state_dir} cannot be written ({_why(exc)}); {_fix(flag)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def parents(path: Path) -> None:
    """Create the missing parents of the default state dir (``$XDG_STATE_HOME``, ``~/.local/state``) 0700."""
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.ConfigError(f"cannot create {path.parent} ({_why(exc)}); {_fix('--state-dir')}") from None


def store_dir(state_dir: Path, *, flag: str) -> Path:
    """The block store of ``state_dir``, created on first use; raises ConfigError if it held one that is gone.

    A store that vanished (removed, or a volume not mounted) would otherwise be made anew, empty, and
    every snapshot it held silently given up.
    """
    path = state_dir / STORE
    made = state_dir / MADE
    if not path.exists() and made.exists():
        raise errors.ConfigError(
            f"the state dir {state_dir} held a block store, {path}, which is gone (removed, moved, or a volume "
            f"not mounted?): its snapshots would be lost; put it back, or remove {made} to start afresh, or give "
            f"{flag} another directory"
        )
    subdir(state_dir, STORE)
    if not made.exists():
        try:
            made.write_text("the block store store/ was created here; see docs/launcher.md\n")
        except OSError as exc:
            raise errors.ConfigError(f"cannot write {made} ({_why(exc)}); {_fix(flag)}") from None
    return path


def subdir(parent: Path, name: str) -> Path:
    """``parent/name``, created 0700 when missing; raises ConfigError."""
    path = parent / name
    try:
        path.mkdir(mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise errors.ConfigError(f"cannot create {path} ({_why(exc)})") from None
    return path


def _why(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "a read-only filesystem"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    return exc.strerror or str(exc)


def _fix(flag: str) -> str:
    return f"give {flag} a writable directory on a disk with room"


def tmpfs_free(root: Path) -> int | None:
    """Free bytes of the tmpfs at ``root``; None if there is none (missing, not a directory, not writable)."""
    try:
        if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
            return None
        stats = os.statvfs(root)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def ram_dir(state_dir: Path, root: Path) -> Path:
    """The RAM staging dir of ``state_dir``: one name per user and state dir, so a leftover of a sidecar killed
    with ``kill -9`` is taken over (and cleaned) by the next one on the same state dir, whose lock it holds."""
    tag = hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
    return root / f"{NAME}-{os.getuid()}-{tag}"


def make_ram_dir(path: Path) -> None:
    """Create ``path`` 0700, or take over a leftover that is this user's own directory; raises ConfigError."""
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise errors.ConfigError(f"cannot create the RAM staging dir {path} ({_why(exc)})") from None
    else:
        return
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise errors.ConfigError(
            f"{path} exists and is not this user's directory: the sidecar stages llama-server's saves there; "
            "remove it, or give --slot-dir a tmpfs directory of your own"
        )
    os.chmod(path, DIR_MODE)


def remove_ram_dir(path: Path) -> None:
    """Remove the RAM staging dir at exit (what it holds is staging only: the store keeps the snapshots)."""
    shutil.rmtree(path, ignore_errors=True)
