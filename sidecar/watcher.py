"""Keeps the snapshot index and the disk gauges true as files come and go.

watchdog observes the slot dir on its own thread; its callbacks only hand
the file name to asyncio with ``loop.call_soon_threadsafe``. The consumer
drains the queue in batches, re-reads the touched manifests and updates
``disk_used_bytes``, ``disk_free_bytes`` and ``snapshot_files``, so files
created, deleted, truncated or renamed by anyone show up within a second
without rescanning on each poll. A full rescan every ``RESCAN_EVERY``
seconds is the safety net for missed events.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from sidecar import metrics, store

log = structlog.get_logger("sidecar.watcher")
RESCAN_EVERY = 60.0
_IGNORED = {"opened", "closed_no_write"}


class _Handoff(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str]) -> None:
        self._loop = loop
        self._queue = queue

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _IGNORED or event.is_directory:
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            if raw:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, os.fsdecode(raw))


class Watcher:
    def __init__(self, snapshots: store.SnapshotStore, stats: metrics.Metrics) -> None:
        self._store = snapshots
        self._metrics = stats
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._observer: BaseObserver | None = None

    def start(self) -> None:
        observer = Observer()
        observer.schedule(_Handoff(asyncio.get_running_loop(), self._queue), str(self._store.dir))
        observer.daemon = True
        observer.start()
        self._observer = observer

    async def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            await asyncio.to_thread(self._observer.join, 5.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_rescan = loop.time() + RESCAN_EVERY
        await self.update_gauges()
        while True:
            timeout = max(0.0, next_rescan - loop.time())
            try:
                # asyncio.timeout, not wait_for: in Python 3.11 wait_for swallows a cancellation
                # that arrives as the queue yields an item, and the sidecar then hangs on SIGTERM.
                async with asyncio.timeout(timeout):
                    first = await self._queue.get()
            except TimeoutError:
                await asyncio.to_thread(self._store.scan, clean=False)
                await self.update_gauges()
                next_rescan = loop.time() + RESCAN_EVERY
                continue
            names = {first}
            await asyncio.sleep(0.05)  # let a burst of events for one file arrive
            while not self._queue.empty():
                names.add(self._queue.get_nowait())
            for name in names:
                path = Path(name)
                if path.parent == self._store.dir:
                    await asyncio.to_thread(self._store.refresh, path.name)
            await self.update_gauges()

    async def update_gauges(self) -> None:
        try:
            usage = await asyncio.to_thread(self._store.usage)
        except OSError as exc:
            log.warning("disk_usage_unreadable", slot_dir=str(self._store.dir), error=str(exc))
            return
        self._metrics.disk_used.set(usage.used_bytes)
        self._metrics.disk_free.set(usage.free_bytes)
        self._metrics.snapshot_files.set(usage.snapshot_files)
