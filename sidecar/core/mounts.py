"""Whether a directory is on a tmpfs of small pages, where llama-server reads a restored file slowly.

llama-server reads a slot file to restore it. From a tmpfs mounted without
``huge=`` the kernel serves the file in 4 KiB pages, and the read is about
2.5 times slower than from a disk filesystem's page cache (large folios) or
from a tmpfs mounted with ``huge=within_size``: 288 MB took the server
75-125 ms against 30-55 ms (Linux 6.18, 2 cores). With ``--store-dir`` the
slot dir is such a tmpfs, so the sidecar says so at start-up.

:func:`small_pages` is pure (the text of ``/proc/self/mountinfo`` and of
``/sys/kernel/mm/transparent_hugepage/shmem_enabled``); :func:`tmpfs_of_small_pages`
reads them.
"""

from __future__ import annotations

from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_HUGE = ("huge=always", "huge=within_size", "huge=advise")


def small_pages(mountinfo: str, path: Path, shmem_enabled: str = "") -> bool:
    """Whether ``path`` (absolute, resolved) is on a tmpfs whose files are kept in small pages. Pure.

    The mount is the one whose mount point is the longest prefix of ``path``
    (the last such line: a later mount hides an earlier one); ``shmem_enabled``
    forcing huge pages on every tmpfs (``[force]``) counts as huge.
    """
    mount = _holding(mountinfo, path)
    if mount is None:
        return False
    fstype_, options = mount
    small = fstype_ == "tmpfs" and not any(o in _HUGE for o in options.split(","))
    return small and "[force]" not in shmem_enabled


def fstype(mountinfo: str, path: Path) -> str | None:
    """The filesystem type of the mount holding ``path`` (absolute, resolved); None if no line covers it. Pure."""
    mount = _holding(mountinfo, path)
    return None if mount is None else mount[0]


def _holding(mountinfo: str, path: Path) -> tuple[str, str] | None:
    """The filesystem type and super options of the mount holding ``path``: the one whose mount point is the
    longest prefix of it, the last such line (a later mount hides an earlier one); None if no line covers it."""
    best: tuple[int, tuple[str, str]] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = Path(_unescape(fields[4]))
        if path != point and point not in path.parents:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        depth = len(point.parts)
        if best is None or depth >= best[0]:
            best = (depth, (after[0], after[2] if len(after) > 2 else ""))
    return None if best is None else best[1]


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on a tmpfs (RAM) on this host; False where the kernel's mount table cannot be read."""
    try:
        info = MOUNTINFO.read_text()
    except OSError:
        return False
    return fstype(info, path.resolve()) == "tmpfs"


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def tmpfs_of_small_pages(path: Path) -> bool:
    """:func:`small_pages` of ``path`` on this host; False where the kernel's files cannot be read."""
    try:
        info = MOUNTINFO.read_text()
    except OSError:
        return False
    try:
        shmem = SHMEM_ENABLED.read_text()
    except OSError:
        shmem = ""
    return small_pages(info, path.resolve(), shmem)
