"""Rebuilding ahead: a restart's restore round finds its files already rebuilt from the block store.

While a restarted llama-server loads its model, the snapshots its restore round will restore are
rebuilt from the block store into the slot dir, as far as disk and RAM allow; a restore uses such a
file only while it is still the very one rebuilt. A library swap that saves the slot's own content
first rebuilds the snapshot it brings in meanwhile (:meth:`Ahead.start`): one such file at a time,
none while a restart's files wait, so the slot dir holds at most one file of the sidecar's beyond
what the server itself is saving.

Invariants and trade-offs: docs/modules.md, `sidecar/restore/ahead.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from sidecar.core import errors, metrics, outcomes, tasks
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.restore")

Stamp = tuple[int, int, int]
"""(size, mtime_ns, inode) of a rebuilt file right after its checksum passed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Room:
    """Bytes free where files rebuilt ahead would go."""

    staging: int
    """Free in the slot dir's filesystem (for unprivileged users)."""
    memory: int | None
    """RAM the kernel reports available (``MemAvailable``); None where unknown."""


def chosen(sizes: Sequence[int], room: Room) -> int:
    """How many of the files of ``sizes`` (in the order they would be restored) to rebuild ahead. Pure.

    The longest leading run whose total still leaves room, in the slot dir's filesystem and in RAM, for the
    largest of the files beyond it: the server may save a slot meanwhile, and nothing rebuilt ahead may make
    that save fail or push the host into swapping.
    """
    limit = room.staging if room.memory is None else min(room.staging, room.memory)
    budget = limit - max(sizes, default=0)
    count = total = 0
    for size in sizes:
        if total + size > budget:
            break
        total += size
        count += 1
    return count


def measure_room(staging: Path) -> Room:
    """The :class:`Room` of ``staging`` now; raises OSError if its filesystem cannot be read."""
    stats = os.statvfs(staging)
    return Room(stats.f_bavail * stats.f_frsize, _memory_available())


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """A snapshot's file rebuilt ahead, in the slot dir under ``name``."""

    name: str
    record: manifest.Manifest
    stamp: Stamp


class Ahead:
    """The files rebuilt ahead of the next restore round, by snapshot file."""

    def __init__(
        self,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        *,
        room: Callable[[Path], Room] = measure_room,
    ) -> None:
        self._snapshots = snapshots
        self._stats = stats
        self._room = room
        self._ready: dict[str, Ready] = {}
        self._swap: asyncio.Task[None] | None = None
        self._giving_back: set[asyncio.Task[None]] = set()
        self._swap_file: str | None = None
        """The snapshot file whose rebuild a swap began, while it waits in ``_ready``."""
        """A swap's rebuild, running while the slot it goes to is saved (see :meth:`start`)."""

    @property
    def pending(self) -> bool:
        """Whether files rebuilt ahead wait for a restore."""
        return bool(self._ready)

    async def build(self, records: Sequence[manifest.Manifest]) -> None:
        """Rebuild ``records`` (each slot's snapshot its restore round will restore, in that order) into the
        slot dir, as many as :func:`chosen` allows; give back any rebuilt before."""
        await self.discard()
        if not records:
            return
        await asyncio.to_thread(self._snapshots.staged.drop_spare)  # its room goes to the files rebuilt ahead
        try:
            room = await asyncio.to_thread(self._room, self._snapshots.staging)
        except OSError as exc:
            log.warning("restore_ahead_skipped", error=str(exc), effect="each restore rebuilds its file itself")
            return
        count = chosen([r.bytes for r in records], room)
        if count < len(records):
            self._stats.restore_ahead.labels(outcomes.RestoreAhead.SKIPPED.value).inc(len(records) - count)
            log.info(
                "restore_ahead_skipped",
                files=len(records) - count,
                bytes=sum(r.bytes for r in records[count:]),
                staging_free_bytes=room.staging,
                memory_available_bytes=room.memory,
                reason="rebuilding them now would leave less room than the largest snapshot's size in the slot "
                "dir's filesystem or in RAM",
                effect="their restores rebuild them, after the server is up",
            )
        started, done = time.perf_counter(), 0
        for record in records[:count]:
            if await self._rebuild(record, failed="restore_ahead_failed"):
                done += record.bytes
        if self._ready:
            log.info(
                "restore_ahead_built",
                files=len(self._ready),
                bytes=done,
                seconds=round(time.perf_counter() - started, 4),
                effect="the restore round after the server loads hands them to it without rebuilding them",
            )

    def start(self, record: manifest.Manifest) -> bool:
        """Begin rebuilding ``record`` for a swap while its slot's own content is saved; False if not begun.

        Not begun without a block store, while another swap's rebuild runs or any file rebuilt ahead waits.
        The swap's restore takes the file (:meth:`settle`, then :meth:`take`); :meth:`finish` gives it back
        if it did not.
        """
        if self._snapshots.blocks is None or self._swap is not None or self._ready or self._giving_back:
            return False
        self._swap = tasks.watch(
            asyncio.create_task(self._rebuild_one(record), name="swap-rebuild-ahead"),
            effect="the swap rebuilds its file itself",
        )
        return True

    async def _rebuild_one(self, record: manifest.Manifest) -> None:
        if await self._rebuild(record, failed="swap_rebuild_ahead_failed"):
            self._swap_file = record.file

    async def _rebuild(self, record: manifest.Manifest, *, failed: str) -> bool:
        """Rebuild ``record`` into the slot dir, ready to :meth:`take`; False (``failed`` logged) if not."""
        try:
            name = await asyncio.to_thread(self._snapshots.staged.stage, record)
        except errors.SnapshotError as exc:  # its restore tries it again, and decides what to do with it
            log.warning(failed, slot=record.slot, file=record.file, error=str(exc))
            return False
        stamp = self._stamp(name)
        if stamp is None:
            await asyncio.to_thread(self._snapshots.staged.unstage, name, record)
            return False
        self._ready[record.file] = Ready(name, record, stamp)
        return True

    async def settle(self) -> None:
        """Wait for a swap's rebuild still running (its file is then ready to :meth:`take`)."""
        running = [t for t in (self._swap, *self._giving_back) if t is not None]
        if running:  # a cancelled wait leaves them to finish, and give back what they made
            await asyncio.wait(running)

    def finish(self, record: manifest.Manifest) -> None:
        """After the swap :meth:`start` began for: give back its file if no restore took it (off the path)."""
        running, self._swap = self._swap, None

        async def give_back() -> None:
            if running is not None:
                await running
            if self._swap_file == record.file:
                await self.drop_swap()

        task = tasks.watch(
            asyncio.create_task(give_back(), name="swap-rebuild-give-back"),
            effect="a file rebuilt for a swap stays in the slot dir until the sidecar's next start-up",
        )
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def drop_swap(self) -> None:
        """Give back a swap's file rebuilt ahead that no restore took: another restore's rebuild comes now, and
        the slot dir holds one rebuild of the sidecar's at a time (that swap rebuilds its file itself)."""
        name, self._swap_file = self._swap_file, None
        ready = self._ready.pop(name, None) if name is not None else None
        if ready is not None:
            self._stats.restore_ahead.labels(outcomes.RestoreAhead.UNUSED.value).inc()
            await asyncio.to_thread(self._snapshots.staged.unstage, ready.name, ready.record)

    async def displaced(self, slot: int, record: manifest.Manifest) -> bool:
        """Give back the file rebuilt ahead for ``slot`` now that ``record``, another snapshot, goes there (one a
        request held at the gate wants, or one committed since the rebuild), before ``record`` is rebuilt: on a
        tmpfs of small pages the file given back stays as the spare whose pages that rebuild overwrites instead
        of allocating new ones (a 330 MB rebuild took 0.8 s on the path into new pages here, 0.1 s over a
        spare's). True if one was given back. The displaced snapshot is rebuilt again should the round still
        restore it into another slot."""
        found = next(
            (
                r
                for r in self._ready.values()
                if r.record.slot == slot and r.record.file not in (record.file, self._swap_file)
            ),
            None,
        )
        if found is None:
            return False
        del self._ready[found.record.file]
        self._stats.restore_ahead.labels(outcomes.RestoreAhead.UNUSED.value).inc()
        await asyncio.to_thread(self._snapshots.staged.unstage, found.name, found.record)
        log.info(
            "restore_ahead_displaced",
            slot=slot,
            file=found.record.file,
            by=record.file,
            reason="this slot's restore takes another snapshot: one a request held at the gate wants, or one "
            "committed since the rebuild",
            effect="its file is given back before the other is rebuilt, which reuses its pages where it can",
        )
        return True

    def take(self, record: manifest.Manifest) -> str | None:
        """The name of ``record``'s file rebuilt ahead and unchanged since, now the caller's; None if none.

        A file that changed since its checksum passed is not trusted: it is given back by :meth:`discard`.
        """
        ready = self._ready.get(record.file)
        if ready is None or not same_snapshot(ready.record, record) or self._stamp(ready.name) != ready.stamp:
            return None
        del self._ready[record.file]
        if self._swap_file == record.file:
            self._swap_file = None
        self._stats.restore_ahead.labels(outcomes.RestoreAhead.USED.value).inc()
        return ready.name

    async def discard(self) -> None:
        """Delete every file rebuilt ahead that no restore took."""
        left, self._ready, self._swap_file = list(self._ready.values()), {}, None
        for ready in left:
            self._stats.restore_ahead.labels(outcomes.RestoreAhead.UNUSED.value).inc()
            await asyncio.to_thread(self._snapshots.staged.unstage, ready.name, ready.record)
        if left:
            log.info(
                "restore_ahead_unused",
                files=[r.record.file for r in left],
                reason="no restore took them: a newer snapshot of the slot, a slot not empty, or no restore round",
            )

    def _stamp(self, name: str) -> Stamp | None:
        try:
            st = os.lstat(self._snapshots.staging / name)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino


def same_snapshot(a: manifest.Manifest, b: manifest.Manifest) -> bool:
    """Whether ``a`` and ``b`` are the one committed snapshot (a file is named once, but a name can return). Pure."""
    return a.file == b.file and a.generation == b.generation and a.checksum == b.checksum and a.bytes == b.bytes
