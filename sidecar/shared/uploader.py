"""Uploading committed snapshots to the shared store, in the background.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/uploader.py`.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable

import structlog

from sidecar.core import errors, metrics, outcomes, protocols, safeio
from sidecar.shared import blockup, decide, keys, objstore, records
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.shared")
QUEUE_LIMIT = 256
"""Snapshots waiting for upload at most; beyond it the oldest waiting one is dropped (kept locally)."""
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 60.0
"""Longest pause, in seconds, between two attempts while the store fails."""


class Uploader:
    def __init__(
        self,
        store_: objstore.ObjectStore,
        *,
        prefix: str,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        rate: decide.Rate,
        on_published: Callable[[str, str, records.SharedRecord], None] = lambda ns, key, record: None,
        clock: protocols.Clock | None = None,
    ) -> None:
        self._store = store_
        self._prefix = prefix
        self._snapshots = snapshots
        self._stats = stats
        self._rate = rate
        self._on_published = on_published
        self._clock = clock or protocols.SystemClock()
        self._waiting: collections.OrderedDict[str, manifest.Manifest] = collections.OrderedDict()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.backoff = 0.0
        """Seconds the next retry waits; 0 while the store answers."""

    def offer(self, record: manifest.Manifest) -> None:
        """Queue ``record`` for upload; safe to call from any thread."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._add, record)
        except RuntimeError:
            return  # the loop is closing: the next start-up offers every local snapshot again

    def _add(self, record: manifest.Manifest) -> None:
        self._waiting[record.file] = record
        self._waiting.move_to_end(record.file)
        while len(self._waiting) > QUEUE_LIMIT:
            dropped, _ = self._waiting.popitem(last=False)
            log.warning(
                "shared_upload_dropped",
                file=dropped,
                reason=f"more than {QUEUE_LIMIT} snapshots wait for the shared store",
                effect="kept locally only; offered again at the next start-up of the sidecar",
            )
        self._stats.shared_pending.set(len(self._waiting))
        self._wake.set()

    def pending(self) -> int:
        return len(self._waiting)

    def waiting(self) -> frozenset[str]:
        return frozenset(self._waiting)

    async def run(self) -> None:
        """The ``uploader`` task: offer every local snapshot, then publish what is queued, for ever."""
        self._loop = asyncio.get_running_loop()
        for record in reversed(self._snapshots.snapshots()):  # oldest first, like commits
            self._add(record)
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            file, record = next(iter(self._waiting.items()))
            try:
                await self.publish(record)
            except errors.SharedStoreError as exc:
                self._stats.shared_errors.labels(_label(exc.operation)).inc()
                self.backoff = min(MAX_BACKOFF, max(FIRST_BACKOFF, self.backoff * 2))
                log.warning(
                    "shared_upload_failed",
                    file=file,
                    error=str(exc),
                    retry_in=round(self.backoff, 1),
                    waiting=len(self._waiting),
                    effect="local snapshots and restores go on; the upload is retried",
                )
                await asyncio.sleep(self.backoff * random.uniform(0.8, 1.2))  # noqa: S311 - jitter, not secrets
                continue
            self.backoff = 0.0
            if self._waiting.get(file) is record:
                del self._waiting[file]
            self._stats.shared_pending.set(len(self._waiting))

    async def publish(self, record: manifest.Manifest) -> bool:
        """Upload one snapshot and its shared manifest; False if there was nothing to do."""
        ns = keys.namespace(record.fingerprint)
        manifest_key = keys.shared_manifest(self._prefix, ns, record.checksum)
        if await self._store.head(manifest_key) is not None:
            return False  # published before (by us or by another node)
        if self._snapshots.blocks is not None:
            return await self._publish_blocks(record, ns, manifest_key)
        with self._snapshots.recency.using(record.file):  # retention leaves it alone while it is read
            try:
                await asyncio.to_thread(self._snapshots.curator.check, record)
                path = await asyncio.to_thread(self._snapshots.staged.whole_file, record)  # a block store's: rebuilt
            except errors.SnapshotError as exc:
                log.info("shared_upload_skipped", file=record.file, reason=str(exc), effect="not uploaded")
                return False
            try:
                chain = await asyncio.to_thread(_chain, record, lambda: slotfile.read_tokens(path))
                blob_key = keys.blob(self._prefix, ns, record.checksum)
                started = time.perf_counter()
                written = await self._store.put_file(blob_key, path)
                seconds = time.perf_counter() - started
            finally:
                await asyncio.to_thread(self._snapshots.staged.release_whole, path, record)
        shared = records.SharedRecord(
            snapshot=record, blob=blob_key, chain=chain, block_tokens=slotfile.BLOCK_TOKENS, uploaded=self._clock.wall()
        )
        await self._store.put_bytes(manifest_key, shared.to_json().encode())
        if written is objstore.Written.CREATED:
            self._rate.add(record.bytes, seconds)
            self._stats.shared_bytes.labels(outcomes.Direction.UP).inc(record.bytes)
            self._stats.shared_objects.labels(outcomes.Direction.UP).inc()
            self._stats.shared_transfer.labels(outcomes.Direction.UP).observe(seconds)
        self._on_published(ns, manifest_key, shared)
        log.info(
            "shared_snapshot_published",
            file=record.file,
            key=manifest_key,
            bytes=record.bytes,
            seconds=round(seconds, 3),
            blob=written.value,
            indexed_blocks=len(chain),
        )
        return True

    async def _publish_blocks(self, record: manifest.Manifest, ns: str, manifest_key: str) -> bool:
        """Upload the blocks of ``record`` the store lacks, then its shared manifest (see ``blockup``)."""
        with self._snapshots.recency.using(record.file):  # retention leaves it (and so its blocks) alone meanwhile
            try:
                await asyncio.to_thread(self._snapshots.curator.check, record)
                started = time.perf_counter()
                sent = await blockup.upload(
                    self._store, prefix=self._prefix, ns=ns, record=record, snapshots=self._snapshots, clock=self._clock
                )
                seconds = time.perf_counter() - started
            except errors.SnapshotError as exc:
                log.info("shared_upload_skipped", file=record.file, reason=str(exc), effect="not uploaded")
                return False
            chain = (
                record.index.chain if record.index is not None and record.index.block == slotfile.BLOCK_TOKENS else ()
            )
        shared = records.SharedRecord(
            snapshot=record,
            blob="",
            chain=chain,
            block_tokens=slotfile.BLOCK_TOKENS,
            uploaded=self._clock.wall(),
            recipe=sent.recipe_key,
        )
        written = await self._store.put_bytes(manifest_key, shared.to_json().encode())
        if sent.sent_bytes:
            self._rate.add(sent.sent_bytes, max(1e-6, seconds - sent.waited))
        up = outcomes.Direction.UP
        self._stats.shared_bytes.labels(up).inc(sent.sent_bytes)
        self._stats.shared_block_bytes.labels(up, outcomes.BlockTransfer.TRANSFERRED).inc(sent.sent_bytes)
        self._stats.shared_block_bytes.labels(up, outcomes.BlockTransfer.SKIPPED).inc(sent.skipped_bytes)
        if written is objstore.Written.CREATED:
            self._stats.shared_objects.labels(up).inc()
            self._stats.shared_transfer.labels(up).observe(seconds)
        self._on_published(ns, manifest_key, shared)
        log.info(
            "shared_snapshot_published",
            file=record.file,
            key=manifest_key,
            form="blocks",
            bytes=record.bytes,
            transferred=sent.sent_bytes,
            skipped=sent.skipped_bytes,
            blocks=sent.blocks,
            blocks_sent=sent.sent_blocks,
            waited_for_gc=round(sent.waited, 1),
            seconds=round(seconds, 3),
            indexed_blocks=len(chain),
        )
        return True


def _chain(record: manifest.Manifest, read: Callable[[], slotfile.SlotTokens]) -> tuple[str, ...]:
    """The snapshot's prefix hash chain; empty when its tokens cannot be read (it stays shareable by slot)."""
    if record.index is not None and record.index.block == slotfile.BLOCK_TOKENS:
        return record.index.chain  # read from the file at commit
    try:
        tokens = read()
    except (slotfile.SlotFileError, safeio.Refused, OSError):
        return ()
    return slotfile.prefix_hashes(tokens.data)


def _label(operation: str) -> str:
    return operation if operation in metrics.SHARED_OPERATIONS else "put"
