"""Uploading a snapshot of the block store as blocks: only those the shared store lacks.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/blockup.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import time
from pathlib import Path

from sidecar.blocks import blockdir
from sidecar.core import errors, outcomes, protocols, safeio
from sidecar.shared import fence, keys, objstore
from sidecar.snapshots import backing, manifest, store

CONCURRENCY = 8
"""Block requests (HEAD or PUT) in flight at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """What one block upload moved and what it did not need to."""

    recipe_key: str
    file_bytes: int
    blocks: int
    sent_blocks: int
    sent_bytes: int
    """Bytes of blocks sent, plus the recipe's."""
    skipped_bytes: int
    """Bytes of the file in blocks the store held already (or that came earlier in the same file)."""
    waited: float
    """Seconds spent waiting for collections in progress."""


async def upload(
    objects: objstore.ObjectStore,
    *,
    prefix: str,
    ns: str,
    record: manifest.Manifest,
    snapshots: store.SnapshotStore,
    clock: protocols.Clock,
) -> Sent:
    """Steps 1-3 of the module docstring; SharedStoreError if the store fails, SnapshotError if a local block is bad."""
    blocks = snapshots.blocks
    assert blocks is not None
    made = await asyncio.to_thread(blocks.recipe, backing.recipe_name(record))
    if made.checksum != record.checksum.digest or made.size != record.bytes:
        raise errors.SnapshotError(
            f"{record.file}: its recipe describes another file than its manifest",
            reason=outcomes.SnapshotProblem.MANIFEST,
        )
    text = dataclasses.replace(made, name=keys.content_id(record.checksum)).to_json().encode()
    unique = {b.digest: b.size for b in made.blocks()}
    sent = _Tally()
    recipe_key, recipe_written = await _put_recipe(objects, prefix, ns, record, text, clock)
    sent.bytes += len(text)
    await _ensure_blocks(objects, prefix, ns, unique, snapshots, sent)
    waited = 0.0
    while True:
        started = time.monotonic()
        waited_now = await _wait_for_collections(objects, prefix, clock)
        waited += time.monotonic() - started
        info = await objects.head(recipe_key)
        if not waited_now and info is not None and clock.wall() - recipe_written < fence.RECIPE_FRESH:
            break
        if info is None or clock.wall() - recipe_written >= fence.RECIPE_FRESH:
            recipe_key, recipe_written = await _put_recipe(objects, prefix, ns, record, text, clock)
            sent.bytes += len(text)
        await _ensure_blocks(objects, prefix, ns, unique, snapshots, sent)
    return Sent(
        recipe_key=recipe_key,
        file_bytes=made.size,
        blocks=len(made.blocks()),
        sent_blocks=sent.blocks,
        sent_bytes=sent.bytes,
        skipped_bytes=max(0, made.size - sent.block_bytes),
        waited=waited,
    )


@dataclasses.dataclass(slots=True)
class _Tally:
    blocks: int = 0
    bytes: int = 0
    block_bytes: int = 0


async def _put_recipe(
    objects: objstore.ObjectStore,
    prefix: str,
    ns: str,
    record: manifest.Manifest,
    text: bytes,
    clock: protocols.Clock,
) -> tuple[str, float]:
    now = clock.wall()
    key = keys.recipe(prefix, ns, record.checksum, f"{int(now)}-{secrets.token_hex(4)}")
    await objects.put_bytes(key, text)
    return key, now


async def _ensure_blocks(
    objects: objstore.ObjectStore,
    prefix: str,
    ns: str,
    unique: dict[str, int],
    snapshots: store.SnapshotStore,
    sent: _Tally,
) -> None:
    """Send every block of ``unique`` the store does not hold."""
    gate = asyncio.Semaphore(CONCURRENCY)
    blocks = snapshots.blocks
    assert blocks is not None
    root = blocks.store.root / "blocks"

    async def one(digest: str, size: int) -> None:
        key = keys.block(prefix, ns, digest)
        async with gate:
            info = await objects.head(key)
            if info is not None and info.size == size:
                return
            if info is not None:
                raise errors.SnapshotError(
                    f"block {key} in the shared store holds {info.size} bytes, not the {size} of its name: a damaged "
                    "or foreign object that a create-only write cannot replace; remove it and the upload is retried "
                    "at the next start-up",
                    reason=outcomes.SnapshotProblem.IO,
                )
            data = await asyncio.to_thread(_read_checked, root, digest, size)
            if await objects.put_bytes(key, data) is objstore.Written.CREATED:
                sent.blocks += 1
                sent.bytes += size
                sent.block_bytes += size

    await objstore.all_done(one(d, s) for d, s in unique.items())


def _read_checked(root: Path, digest: str, size: int) -> bytes:
    """The local block's bytes, checked against its name; SnapshotError if it is missing or damaged."""
    path = blockdir.BlockDir(root).of(digest)
    try:
        data = safeio.read_bounded(path, size)
    except (OSError, safeio.Refused) as exc:
        raise errors.SnapshotError(
            f"block {digest} could not be read for the upload: {exc}", reason=outcomes.SnapshotProblem.IO
        ) from exc
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise errors.SnapshotError(
            f"block {digest} no longer holds the bytes it is named for: not uploaded",
            reason=outcomes.SnapshotProblem.CHECKSUM,
        )
    return data


async def _wait_for_collections(objects: objstore.ObjectStore, prefix: str, clock: protocols.Clock) -> bool:
    """Wait until no collection may still be deleting; True if there was one to wait for."""
    waited = False
    while True:
        listed = await objects.list_objects(keys.gc_markers_under(prefix))
        starts = [s for info in listed if (s := keys.marker_start(info.key)) is not None]
        if not fence.running(starts, now=clock.wall()):
            return waited
        waited = True
        await asyncio.sleep(fence.POLL)
