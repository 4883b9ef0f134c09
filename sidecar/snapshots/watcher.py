"""Keeps the snapshot index and the disk gauges true as files come and go.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/watcher.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import structlog
from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from sidecar.core import errors, metrics, outcomes
from sidecar.snapshots import backing, dirlock, store

log = structlog.get_logger("sidecar.watcher")
RESCAN_EVERY = 60.0
CHECK_EVERY = 1.0
"""Seconds between checks that the slot dir is still there and still ours."""
_IGNORED = {"opened", "closed_no_write"}
WATCHED = [FileCreatedEvent, FileDeletedEvent, FileMovedEvent, FileClosedEvent]
"""What the kernel reports: files appearing, going, renamed, and closed after a write (a truncation
through an open file ends with one). Not each write: llama-server writes a snapshot in hundreds of
them, and waking on each costs the CPU its save is running on (the save took 12 ms instead of 8
beside a sidecar watching every write, while another slot generated). A truncation without an
open file is found by the rescan every ``RESCAN_EVERY`` seconds and by the check before a restore.
Directory events are not needed: :meth:`Watcher.check_dir` looks for the slot dir every ``CHECK_EVERY``."""
_UNCOMMITTED = (store.TEMP_PREFIX, store.PROBE_PREFIX)


class _Handoff(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str]) -> None:
        self._loop = loop
        self._queue = queue

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _IGNORED or event.is_directory:
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            name = os.fsdecode(raw) if raw else ""
            # A file being saved or probed is nobody's snapshot yet: its commit renames it (seen then).
            if name and not os.path.basename(name).startswith(_UNCOMMITTED):
                self._loop.call_soon_threadsafe(self._queue.put_nowait, name)


class Watcher:
    def __init__(
        self, snapshots: store.SnapshotStore, stats: metrics.Metrics, lock: dirlock.DirLock | None = None
    ) -> None:
        self._snapshots = snapshots
        self._metrics = stats
        self._lock = lock
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._observer: BaseObserver | None = None
        self._dir_id: tuple[int, int] | None = None
        self._lost = False
        self._counted = backing.Figures()
        """The block store's running totals last added to the metrics."""

    def start(self) -> None:
        self._dir_id = self._snapshots.disk.dir_identity()
        self._observe()

    def _observe(self) -> None:
        observer = Observer()
        observer.schedule(
            _Handoff(asyncio.get_running_loop(), self._queue), str(self._snapshots.dir), event_filter=WATCHED
        )
        observer.daemon = True
        observer.start()
        self._observer = observer

    async def stop(self) -> None:
        if self._observer is not None:
            observer, self._observer = self._observer, None
            observer.stop()
            await asyncio.to_thread(observer.join, 2.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_check = loop.time() + CHECK_EVERY
        next_rescan = loop.time() + RESCAN_EVERY
        await self.update_gauges()
        while True:
            timeout = max(0.0, min(next_check, next_rescan) - loop.time())
            try:
                # asyncio.timeout, not wait_for: in Python 3.11 wait_for swallows a cancellation
                # that arrives as the queue yields an item, and the sidecar then hangs on SIGTERM.
                async with asyncio.timeout(timeout):
                    first = await self._queue.get()
            except TimeoutError:
                pass
            else:
                await self._refresh(first)
            if loop.time() >= next_check:  # also under a steady stream of events
                await self.check_dir()
                next_check = loop.time() + CHECK_EVERY
            if loop.time() >= next_rescan:
                await asyncio.to_thread(self._snapshots.loader.scan, clean=False)
                await self.update_gauges()
                next_rescan = loop.time() + RESCAN_EVERY

    async def _refresh(self, first: str) -> None:
        names = {first}
        await asyncio.sleep(0.05)  # let a burst of events for one file arrive
        while not self._queue.empty():
            names.add(self._queue.get_nowait())
        for name in names:
            path = Path(name)
            if path.parent == self._snapshots.dir:
                await asyncio.to_thread(self._snapshots.loader.refresh, path.name)
        await self.update_gauges()

    async def check_dir(self) -> None:
        """Notice the slot dir going away or coming back, and recover; never raises for the filesystem."""
        current = await asyncio.to_thread(self._snapshots.disk.dir_identity)
        unchanged = current is not None and current == self._dir_id and not self._lost
        if unchanged and (self._lock is None or self._lock.holds()):
            return
        if current is None:
            if not self._lost:
                self._lost = True
                log.error(
                    "slot_dir_lost",
                    slot_dir=str(self._snapshots.dir),
                    effect="no snapshots or restores, /readyz answers 503; the sidecar keeps running "
                    f"and checks every {CHECK_EVERY:g} s for the directory to come back",
                    hint="restore the directory (or its volume mount) at this path",
                )
                await asyncio.to_thread(self._snapshots.loader.scan, clean=False)
                await self.update_gauges()
            return
        if self._lock is not None and not self._lock.holds():
            try:
                await asyncio.to_thread(self._lock.acquire)
            except (errors.ConfigError, OSError) as exc:
                self._snapshots.disk.block(str(exc))
                if not self._lost:
                    self._lost = True
                    log.error("slot_dir_taken", slot_dir=str(self._snapshots.dir), error=str(exc))
                return
            self._snapshots.disk.block("")
        await self.stop()
        try:
            self._observe()
        except OSError as exc:
            log.warning("slot_dir_unwatchable", slot_dir=str(self._snapshots.dir), error=str(exc))
            return
        self._dir_id = current
        await asyncio.to_thread(self._snapshots.loader.scan, clean=False)
        await self.update_gauges()
        log.info(
            "slot_dir_back" if self._lost else "slot_dir_replaced",
            slot_dir=str(self._snapshots.dir),
            snapshots=len(self._snapshots.snapshots()),
        )
        self._lost = False

    async def update_gauges(self) -> None:
        usage = await asyncio.to_thread(self._snapshots.disk.usage)
        if usage.problem:
            return  # reported by the store; the last good figures stay
        self._metrics.disk_used.set(usage.used_bytes)
        self._block_figures(usage)
        self._metrics.disk_free.set(usage.free_bytes)
        self._metrics.snapshot_files.set(usage.snapshot_files)
        library = self._snapshots.library()
        self._metrics.library_conversations.set(len(library))
        self._metrics.library_bytes.set(sum(m.bytes for m in library))

    def _block_figures(self, usage: store.Usage) -> None:
        """The block store's figures: gauges from ``usage``, counters moved on by what was written since."""
        blocks = self._snapshots.blocks
        if blocks is None:
            return
        self._metrics.store_unique.set(usage.unique_bytes)
        self._metrics.store_represented.set(usage.represented_bytes)
        now = dataclasses.replace(blocks.figures)
        last, self._counted = self._counted, now
        self._metrics.store_written.labels(outcomes.StoreWrite.BLOCKS.value).inc(
            now.block_bytes_written - last.block_bytes_written
        )
        self._metrics.store_written.labels(outcomes.StoreWrite.MANIFESTS.value).inc(
            now.manifest_bytes_written - last.manifest_bytes_written
        )
        self._metrics.store_deduplicated.inc(now.deduplicated_bytes - last.deduplicated_bytes)
