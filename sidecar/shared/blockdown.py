"""Fetching a snapshot the shared store holds as blocks: only the blocks this node lacks. Blocking I/O in threads.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/blockdown.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from sidecar.blocks import assemble, blockdir, locking, recipe
from sidecar.core import errors, outcomes
from sidecar.shared import keys, objstore, records
from sidecar.snapshots import store

CONCURRENCY = 8
"""Block downloads in flight at once."""
FETCH_PREFIX = ".llama-kv-sidecar.fetch-"
"""Temporary block directories in the slot dir of a node without a block store (not a snapshot name)."""
LEFTOVER_AGE = 3600.0
"""Seconds after which such a directory is a fetch that died, removed by the next fetch."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fetched:
    fetched_blocks: int
    fetched_bytes: int
    """Bytes of blocks downloaded, plus the recipe's."""
    skipped_bytes: int
    """Bytes of the file in blocks this node held already (or that came earlier in the same file)."""


async def fetch_into(
    objects: objstore.ObjectStore,
    shared: records.SharedRecord,
    *,
    snapshots: store.SnapshotStore,
    dest: Path,
) -> Fetched:
    """Rebuild ``shared``'s file at ``dest`` from its blocks; SharedObjectRefused (corrupt) or SharedStoreError."""
    raw = await objects.get_bytes(shared.recipe, limit=recipe.MAX_BYTES)
    made = _parse(shared, raw)
    with _block_dir(snapshots) as where:
        got = await _fetch_blocks(objects, made, recipe_key=shared.recipe, where=where)
        await asyncio.to_thread(where.sync)
        try:
            await asyncio.to_thread(assemble.reassemble, where, made, dest)
        except errors.BlockStoreError as exc:
            raise _corrupt(f"{shared.recipe}: {exc}") from exc
    return Fetched(got.blocks, got.bytes + len(raw), max(0, made.size - got.bytes))


def _parse(shared: records.SharedRecord, raw: bytes) -> recipe.Recipe:
    try:
        made = recipe.Recipe.from_json(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(f"{shared.recipe} is not a recipe: {exc}") from exc
    want = shared.snapshot
    if (
        made.size != want.bytes
        or made.checksum != want.checksum.digest
        or made.algorithm is not want.checksum.algorithm
    ):
        raise _corrupt(f"{shared.recipe} describes another file than its shared manifest ({made.size} bytes)")
    return made


@dataclasses.dataclass(slots=True)
class _Got:
    blocks: int = 0
    bytes: int = 0


async def _fetch_blocks(
    objects: objstore.ObjectStore, made: recipe.Recipe, *, recipe_key: str, where: blockdir.BlockDir
) -> _Got:
    unique = {b.digest: b.size for b in made.blocks()}
    gate = asyncio.Semaphore(CONCURRENCY)
    got = _Got()

    async def one(digest: str, size: int) -> None:
        if await asyncio.to_thread(where.holds, digest, size):
            return
        key = keys.block_beside(recipe_key, digest)
        async with gate:
            try:
                data = await objects.get_bytes(key, limit=size)
            except errors.SharedObjectRefused as exc:
                raise _corrupt(f"block {key} holds more than the {size} bytes its recipe says") from exc
            except errors.SharedStoreError as exc:
                if exc.missing:
                    raise _corrupt(f"block {key} is missing from the shared store") from exc
                raise
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise _corrupt(f"block {key} does not hold the bytes it is named for")
        if await asyncio.to_thread(where.put, digest, data):
            got.blocks += 1
            got.bytes += size

    await objstore.all_done(one(d, s) for d, s in unique.items())
    return got


@contextlib.contextmanager
def _block_dir(snapshots: store.SnapshotStore) -> Iterator[blockdir.BlockDir]:
    """The local block store's blocks, its lock held shared, or a temporary directory in the slot dir."""
    blocks = snapshots.blocks
    if blocks is not None:
        with locking.held(blocks.store.root, exclusive=False):
            yield blockdir.BlockDir(blocks.store.root / "blocks")
        return
    for old in snapshots.staging.glob(FETCH_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > LEFTOVER_AGE:  # a fetch that died with its process
                shutil.rmtree(old, ignore_errors=True)
    temp = Path(tempfile.mkdtemp(prefix=FETCH_PREFIX, dir=snapshots.staging))
    try:
        yield blockdir.BlockDir(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def missing_bytes(snapshots: store.SnapshotStore, blocks: Iterable[tuple[str, int]]) -> int:
    """Bytes of the distinct ``blocks`` (digest, size) this node's block store lacks (all without one)."""
    unique = dict(blocks)
    held = snapshots.blocks
    if held is None:
        return sum(unique.values())
    where = blockdir.BlockDir(held.store.root / "blocks")
    return sum(size for digest, size in unique.items() if not where.holds(digest, size))


def _corrupt(detail: str) -> errors.SharedObjectRefused:
    return errors.SharedObjectRefused(detail, operation="get", reason=outcomes.SharedRefusal.CORRUPT)
