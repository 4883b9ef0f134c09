"""The size and checksum checks of the files a restore reads, done ahead while the server loads if it can."""

from __future__ import annotations

import asyncio
import os
import time

import structlog

from sidecar.core import errors, hashing, outcomes, protocols
from sidecar.restore import ahead, records
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.restore")
_Stamp = tuple[int, int, int]
"""(size, mtime_ns, inode) of a file when it passed its check."""


class FileChecks:
    def __init__(
        self,
        *,
        snapshots: store.SnapshotStore,
        clock: protocols.Clock,
        rebuilt_ahead: ahead.Ahead,
        acts: records.Acts,
    ) -> None:
        self._snapshots = snapshots
        self._clock = clock
        self._ahead = rebuilt_ahead
        self._acts = acts
        self._checked: dict[str, _Stamp] = {}
        self.checking: records.Check | None = None
        """The file being checked now; None between checks."""
        self.checked_at = float("-inf")
        """Monotonic time the last check ended (progress, for liveness)."""

    async def precheck(self, *, rebuild: bool = False) -> None:
        """Check the newest good snapshot of every slot now, so the restore round does not hash.

        Called while the server loads (or before the first poll), when the
        files are all the sidecar can work on. ``rebuild``: with a block store,
        also rebuild those snapshots into the slot dir (:mod:`sidecar.restore.ahead`),
        so the round does not rebuild either.
        """
        self._checked.clear()  # every restore round's files are hashed anew: just before it, or in it
        by_slot: dict[int, list[manifest.Manifest]] = {}
        for snap in self._snapshots.snapshots():  # newest (highest generation) first, never by the wall clock
            by_slot.setdefault(snap.slot, []).append(snap)
        started = time.perf_counter()
        checked = 0
        good: list[manifest.Manifest] = []
        for _, newest_first in sorted(by_slot.items()):
            for candidate in newest_first:
                checked += 1
                if await self.check(candidate):
                    good.append(candidate)
                    break
        if checked:
            log.info("snapshots_prechecked", files=checked, seconds=round(time.perf_counter() - started, 4))
        if rebuild and self._snapshots.blocks is not None:
            await self._ahead.build(good)

    def clear(self) -> None:
        """Forget every check: the next restore round hashes its files anew."""
        self._checked.clear()

    async def check(self, candidate: manifest.Manifest) -> bool:
        """Whether ``candidate`` passes its size and checksum check (cached while the file is unchanged)."""
        if self.unchanged(candidate):
            return True
        try:
            return await self._hash_check(candidate)
        finally:
            self.checking = None
            self.checked_at = self._clock.monotonic()

    async def _hash_check(self, candidate: manifest.Manifest) -> bool:
        self._acts.mark()
        self.checking = records.Check(candidate.file, self._clock.monotonic() + hashing.deadline_for(candidate.bytes))
        try:
            await asyncio.to_thread(self._snapshots.curator.check, candidate)
            stamp = await asyncio.to_thread(self._stamp, candidate.file)
        except errors.SnapshotError as exc:
            if exc.reason not in outcomes.BAD_CONTENT:  # unreadable now, not proven bad: keep it
                log.warning("snapshot_unreadable", slot=candidate.slot, file=candidate.file, error=str(exc))
                return False
            log.error("snapshot_corrupt", slot=candidate.slot, file=candidate.file, reason=exc.reason, error=str(exc))
            await asyncio.to_thread(self._snapshots.curator.quarantine, candidate.file, exc.reason, detail=str(exc))
            self._checked.pop(candidate.file, None)
            return False
        if stamp is not None:
            self._checked[candidate.file] = stamp
        return True

    def unchanged(self, candidate: manifest.Manifest) -> bool:
        """Whether ``candidate`` passed its check and its file kept its size, mtime and inode since."""
        stamp = self._checked.get(candidate.file)
        return stamp is not None and stamp == self._stamp(candidate.file)

    def _stamp(self, file: str) -> _Stamp | None:
        try:
            st = os.lstat(self._snapshots.dir / file)  # a file swapped for a link is a new file
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino
