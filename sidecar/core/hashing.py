"""Checksums of snapshot and model files. Blocking I/O: call with ``asyncio.to_thread``.

Snapshots use xxh3-128 (a checksum against damage, not a signature), manifests of format 1 sha256;
files are read in chunks into one reused buffer, in a worker thread.

Invariants and trade-offs: docs/modules.md, `sidecar/core/hashing.py`.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import mmap
import os
import time
from pathlib import Path
from typing import Protocol

import xxhash

from sidecar.core import safeio

CHUNK = 1 << 20
"""Bytes per read: a buffer that stays in the CPU's L2 cache hashes a page-cached file about twice as
fast as 8 MiB (9.0 vs 4.2 GB/s for a 14 MB snapshot here); the kernel's read-ahead keeps a cold disk busy."""


PACE = 0.002
"""Seconds to sleep after each chunk when a commit's hash runs while slots generate.

A commit normally waits until no slot generates (see :mod:`sidecar.save.snapshotter`);
one that waited its longest is made meanwhile, paced. Generation on the CPU is
bound by memory bandwidth, and a hash streams the file through memory:
unpaced, it lengthened the token gap it fell in by about 6 ms for a 20 MB
snapshot (beyond the server's own save); paced, the same reads spread over a
few tokens and the worst gap grew by about 2 ms (docs/snapshots.md, Busy slots). A
20 MB hash then takes about 45 ms instead of 3.
"""


FLOOR_RATE = 20 << 20
"""Bytes per second below which a hash counts as stuck (a hung disk or network mount): 20 MiB/s, a
tenth of a slow spinning disk's sequential read. With ``GRACE``, the deadline of every hash."""
GRACE = 10.0
"""Seconds every hash may take on top of its size at ``FLOOR_RATE``."""


class Overdue(TimeoutError):
    """A hash ran past its deadline (see :func:`deadline_for`): the file is not proven bad, only slow."""


def deadline_for(size: int) -> float:
    """Seconds a hash of ``size`` bytes may take before it is given up."""
    return GRACE + size / FLOOR_RATE


class Algorithm(enum.StrEnum):
    XXH3_128 = "xxh3-128"
    SHA256 = "sha256"


CURRENT = Algorithm.XXH3_128
"""What new snapshots and model files are hashed with."""

DIGEST_HEX = {Algorithm.XXH3_128: 32, Algorithm.SHA256: 64}
"""Length of each algorithm's digest in hex digits."""


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _new(algorithm: Algorithm) -> _Hasher:
    if algorithm is Algorithm.XXH3_128:
        return xxhash.xxh3_128()
    return hashlib.sha256()


def fd_digest(
    fd: int, algorithm: Algorithm, *, pause: float = 0.0, limit: int | None = None, deadline: float | None = None
) -> str:
    """The hex digest of what ``fd`` reads; ``pause``: seconds to sleep after each chunk (see ``PACE``).

    ``limit``: read at most that many bytes (a file that is not what its size says, such as a
    device, is never read past it). ``deadline``: ``time.monotonic()`` after which the hash is
    given up with :class:`Overdue`.
    """
    with contextlib.suppress(OSError):  # advice only; some filesystems refuse it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    hasher = _new(algorithm)
    # An anonymous mapping, not a bytearray: malloc would keep a CHUNK-sized block in the arena of
    # each worker thread that ever hashed, and the process would grow by that much per thread.
    buf = mmap.mmap(-1, CHUNK)
    left = limit
    try:
        with memoryview(buf) as view:
            while left is None or left > 0:
                got = os.readv(fd, [buf]) if left is None or left >= CHUNK else os.readv(fd, [view[:left]])
                if got <= 0:
                    break
                hasher.update(view[:got])
                if left is not None:
                    left -= got
                if deadline is not None and time.monotonic() > deadline:
                    raise Overdue(
                        f"hashing did not finish within its deadline (reading below {FLOOR_RATE >> 20} MiB/s)"
                    )
                if pause:
                    time.sleep(pause)
    finally:
        buf.close()
    return hasher.hexdigest()


def file_digest(path: Path, algorithm: Algorithm = CURRENT) -> str:
    """The hex digest of a file's content."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd_digest(fd, algorithm)
    finally:
        os.close(fd)


def digest_and_sync(
    path: Path,
    algorithm: Algorithm = CURRENT,
    *,
    pause: float = 0.0,
    limit: int | None = None,
    mode: int | None = None,
    same_as: os.stat_result | None = None,
) -> str:
    """Hash a file the server just wrote (its pages are still in the page cache), then make it durable.

    ``fdatasync`` writes the data and the metadata needed to read it back
    (the size); the file's times are not needed for a snapshot, so the full
    ``fsync`` buys nothing here. Measured by ``python -m bench.hashing``.
    ``pause``: see ``PACE``. ``limit``: the file's expected size (see :func:`fd_digest`); the
    deadline follows from it. A symbolic link or anything but a regular file is refused
    (``safeio.Refused``). ``mode``: set through the open descriptor (``fchmod``), never by path, so a link
    planted at ``path`` meanwhile changes nothing else. ``same_as``: the ``lstat`` the file was checked by; a
    file that is not that one any more is refused.
    """
    fd, st = safeio.open_regular(path)
    size = st.st_size if limit is None else limit
    try:
        if same_as is not None and not safeio.same_file(st, same_as):
            raise safeio.Refused(f"{path.name} was replaced after it was checked", reason=safeio.NOT_REGULAR)
        digest = fd_digest(fd, algorithm, pause=pause, limit=size, deadline=time.monotonic() + deadline_for(size))
        if mode is not None:
            os.fchmod(fd, mode)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return digest
