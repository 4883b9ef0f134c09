"""Fetching a snapshot from the shared store into the slot dir.

A snapshot uploaded as blocks is rebuilt from the blocks this node lacks
(:mod:`~sidecar.shared.blockdown`), checked block by block and as a whole
file, into the same temporary name; from there it is committed like a blob.

The blob is streamed into a temporary name (``.tmp-slot<id>-…``, which
nothing restores and the next start-up removes), its size and checksum are
compared with the shared manifest's while it is written (the download stops
as soon as the blob runs past the manifest's size), and only then is it
committed like a snapshot the server just saved: the store renames it to
its final name and writes the local manifest last. From there the local
library, the restorer and retention see it like any other snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from pathlib import Path
from typing import Protocol

import structlog
import xxhash

from sidecar.core import errors, hashing, metrics, outcomes
from sidecar.shared import blockdown, decide, objstore, records
from sidecar.snapshots import manifest, store

log = structlog.get_logger("sidecar.shared")


async def fetch(
    store_: objstore.ObjectStore,
    shared: records.SharedRecord,
    *,
    snapshots: store.SnapshotStore,
    slot: int,
    stats: metrics.Metrics,
    rate: decide.Rate,
) -> manifest.Manifest:
    """Download ``shared`` into the slot dir as a snapshot of ``slot``; raise SharedStoreError or SnapshotError."""
    want = shared.snapshot
    temp = snapshots.writer.temp_name(slot)
    path = snapshots.staging / temp
    started = time.perf_counter()
    moved: int | None = None
    try:
        if shared.recipe:
            got = await blockdown.fetch_into(store_, shared, snapshots=snapshots, dest=path)
            size, digest, moved = want.bytes, want.checksum.digest, got.fetched_bytes
            stats.shared_block_bytes.labels(outcomes.Direction.DOWN, outcomes.BlockTransfer.TRANSFERRED).inc(
                got.fetched_bytes
            )
            stats.shared_block_bytes.labels(outcomes.Direction.DOWN, outcomes.BlockTransfer.SKIPPED).inc(
                got.skipped_bytes
            )
        else:
            size, digest = await _download(store_, shared.blob, path, want.checksum.algorithm, limit=want.bytes)
        if size != want.bytes:
            raise _corrupt(f"{shared.blob} holds {size} bytes, its shared manifest says {want.bytes}")
        if digest != want.checksum.digest:
            raise _corrupt(f"{shared.blob} does not match its shared manifest's {want.checksum.algorithm} checksum")
        committed = await asyncio.to_thread(
            snapshots.writer.commit,
            temp,
            slot=slot,
            tokens=want.tokens,
            written=size,
            task=None,
            fingerprint=want.fingerprint,
            prefill_rate=want.prefill_rate,  # the origin's: what recomputing these tokens costs on this model
        )
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    if committed.checksum.algorithm is want.checksum.algorithm and committed.checksum.digest != digest:
        await asyncio.to_thread(snapshots.curator.delete, committed)  # changed on disk between the two hashes
        raise errors.SnapshotError(
            f"{committed.file} changed while it was committed", reason=outcomes.SnapshotProblem.CHECKSUM
        )
    seconds = time.perf_counter() - started
    transferred = size if moved is None else moved
    rate.add(transferred, seconds)
    stats.shared_bytes.labels(outcomes.Direction.DOWN).inc(transferred)
    stats.shared_objects.labels(outcomes.Direction.DOWN).inc()
    stats.shared_transfer.labels(outcomes.Direction.DOWN).observe(seconds)
    log.info(
        "shared_snapshot_fetched",
        file=committed.file,
        slot=slot,
        tokens=committed.tokens,
        bytes=size,
        transferred=transferred,
        form="blocks" if shared.recipe else "whole",
        seconds=round(seconds, 3),
    )
    return committed


def _corrupt(detail: str) -> errors.SharedObjectRefused:
    return errors.SharedObjectRefused(detail, operation="get", reason=outcomes.SharedRefusal.CORRUPT)


async def _download(
    store_: objstore.ObjectStore, key: str, path: Path, algorithm: hashing.Algorithm, *, limit: int
) -> tuple[int, str]:
    """Stream ``key`` into ``path`` (created exclusively), hashing as it goes; (bytes, hex digest).

    Stops once past ``limit`` bytes (the manifest's size): a blob larger than it says is refused
    without downloading the rest.
    """
    hasher = _hasher(algorithm)
    size = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, store.FILE_MODE)
    except OSError as exc:
        raise errors.SnapshotError(f"creating {path.name}: {exc}", reason=outcomes.SnapshotProblem.IO) from exc
    with os.fdopen(fd, "wb") as fh:
        async for chunk in store_.stream(key):
            hasher.update(chunk)
            size += len(chunk)
            if size > limit:
                raise _corrupt(f"{key} holds more than the {limit} bytes its shared manifest says")
            await asyncio.to_thread(fh.write, chunk)
    return size, hasher.hexdigest()


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> object: ...

    def hexdigest(self) -> str: ...


def _hasher(algorithm: hashing.Algorithm) -> _Hasher:
    return xxhash.xxh3_128() if algorithm is hashing.Algorithm.XXH3_128 else hashlib.sha256()
