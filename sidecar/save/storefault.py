"""A disk that will not take a save: which fault it is, and when to try a save again. Pure.

When the disk the snapshots are kept on (``--store-dir``, else the slot dir)
refuses a save's write because it is full, read-only or not ours to write,
every save until that changes would make llama-server serialise a whole slot
(a stall every slot waits through) only to fail the same way. So the save
that finds the fault fails, later saves are skipped without calling the
server, and a save is tried again as soon as the disk looks able to take it:
for a full disk, once its free space has grown by :data:`ROOM` since the
failed save's leftovers were collected, or once :func:`backoff` has passed
(the space may have come back before the baseline was read: a file that
filled the disk for a moment and went away; a quota); for a read-only or
refused one, once a small probe file can be written there. A retry that
fails again starts a new baseline and doubles the wait. Committed snapshots
are never touched by any of it.
"""

from __future__ import annotations

import dataclasses
import errno

from sidecar.core import outcomes

ROOM = 8 << 20
"""Bytes of free space that must come back on a full disk before a save is tried again."""
RETRY_FIRST = 30.0
"""Seconds after which a full disk's save is tried again even if no :data:`ROOM` came back; doubled at each
failed retry, up to :data:`RETRY_MOST`."""
RETRY_MOST = 300.0

_FAULTS = {
    errno.ENOSPC: outcomes.StoreFault.NO_SPACE,
    errno.EDQUOT: outcomes.StoreFault.NO_SPACE,
    errno.EROFS: outcomes.StoreFault.READ_ONLY,
    errno.EACCES: outcomes.StoreFault.DENIED,
    errno.EPERM: outcomes.StoreFault.DENIED,
}

HINTS = {
    outcomes.StoreFault.NO_SPACE: "free space on that filesystem, or lower --max-bytes so that retention keeps "
    "the snapshots well below its size",
    outcomes.StoreFault.READ_ONLY: "remount that filesystem read-write (the kernel remounts a filesystem "
    "read-only after an I/O error: check dmesg and the disk first)",
    outcomes.StoreFault.DENIED: "give the sidecar's user write access to that directory",
}


def classify(exc: BaseException) -> outcomes.StoreFault | None:
    """The fault behind ``exc`` (an OSError anywhere in its chain of causes), None if it is no disk fault."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; bounded all the same
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _FAULTS:
            return _FAULTS[seen.errno]
        seen = seen.__cause__ or seen.__context__
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Episode:
    """The disk refused a save: since when, why, and its free space once the failed save's leftovers went."""

    fault: outcomes.StoreFault
    free_bytes: int
    detail: str
    at: float
    """When the save was refused (monotonic seconds)."""
    retries: int = 0
    """Retries refused the same way since the episode began."""
    skipped: int = 0
    """Saves skipped since, without calling the server."""


def backoff(retries: int) -> float:
    """Seconds a full disk waits before a save is tried again whatever its free space says."""
    return min(RETRY_FIRST * 2.0 ** min(retries, 16), RETRY_MOST)


def worth_probing(episode: Episode, *, free_bytes: int, now: float) -> bool:
    """Whether the disk may take a save again (then a probe write decides): a full one needs :data:`ROOM` back,
    or :func:`backoff` seconds gone by."""
    if episode.fault is outcomes.StoreFault.NO_SPACE:
        return free_bytes >= episode.free_bytes + ROOM or now - episode.at >= backoff(episode.retries)
    return True
