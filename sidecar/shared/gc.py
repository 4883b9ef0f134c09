"""Retention in the shared store: ``llama-kv-sidecar gc --shared-store URL``.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/gc.py`.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import secrets
import time
from collections.abc import Iterable, Mapping

from sidecar.blocks import recipe
from sidecar.core import errors
from sidecar.shared import fence, keys, objstore

GONE = "gone"
GRACE = 3600.0
"""Default seconds between unpublishing a snapshot and deleting its blob."""


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    unpublish: tuple[str, ...]
    """Manifest keys to delete (a tombstone is written for each first)."""
    delete: tuple[str, ...]
    """Blob and tombstone keys to delete."""
    kept_bytes: int
    """Bytes of the blobs whose manifests stay, and of the blocks their recipes name (each block once)."""
    late: bool = False
    """The run passed its deadline: what was left to delete waits for the next run."""


def _parts(key: str) -> tuple[str, str, str] | None:
    """(namespace path, kind, content id) of a key of the layout in ``keys``; None for other keys."""
    head, name = posixpath.split(key)
    base, kind = posixpath.split(head)
    if kind == GONE:
        return base, kind, name.split("@", 1)[0]
    if kind in (keys.MANIFESTS, keys.BLOBS, keys.BLOCKS):
        return base, kind, name.rsplit(".", 1)[0]
    base2, kind2 = posixpath.split(base)
    if kind2 == keys.RECIPES:
        return base2, kind2, kind  # <ns>/recipes/<content id>/<attempt>.json
    return None


def tombstone(manifest_key: str, now: float) -> str:
    """``<ns>/gone/<content id>@<unix time>``: when the snapshot was unpublished."""
    found = _parts(manifest_key)
    assert found is not None
    return posixpath.join(found[0], GONE, f"{found[2]}@{int(now)}")


Blocks = Mapping[str, frozenset[str] | None]
"""The block digests each recipe key names; None for a recipe that could not be read."""


def plan(
    objects: Iterable[objstore.ObjectInfo],
    *,
    now: float,
    max_age: float,
    max_bytes: int,
    grace: float,
    recipes: Blocks | None = None,
) -> Plan:
    """What to unpublish and delete; ``max_age`` 0 and ``max_bytes`` 0 mean no limit."""
    named = recipes or {}
    block_grace = max(grace, fence.MIN_GRACE)
    listing = _Listing.of(objects)
    manifests = listing.manifests
    live = sorted(manifests, key=lambda k: manifests[k].modified, reverse=True)  # newest first
    drop = [k for k in live if max_age > 0 and now - manifests[k].modified > max_age]
    kept = [k for k in live if k not in drop]
    sizes = _Sizes(listing.blobs, listing.blocks, listing.attempts, named)
    for k in kept:
        sizes.add(k)
    while max_bytes > 0 and kept and sizes.total > max_bytes:
        oldest = kept.pop()
        sizes.remove(oldest)
        drop.append(oldest)
    delete = _expired(listing, drop, now=now, grace=grace, block_grace=block_grace)
    delete += _unreferenced_blocks(
        listing.blocks, listing.attempts, named, gone=set(delete), now=now, grace=block_grace
    )
    return Plan(tuple(sorted(manifests[k].key for k in drop)), tuple(sorted(delete)), sizes.total)


Key = tuple[str, str]
"""(namespace path, content id)."""


@dataclasses.dataclass(slots=True)
class _Listing:
    """The store's objects of the layout in ``keys``, by kind and :data:`Key`."""

    manifests: dict[Key, objstore.ObjectInfo] = dataclasses.field(default_factory=dict)
    blobs: dict[Key, objstore.ObjectInfo] = dataclasses.field(default_factory=dict)
    stones: dict[Key, list[objstore.ObjectInfo]] = dataclasses.field(default_factory=dict)
    attempts: dict[Key, list[objstore.ObjectInfo]] = dataclasses.field(default_factory=dict)
    """The recipes of every upload attempt."""
    blocks: dict[Key, objstore.ObjectInfo] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, objects: Iterable[objstore.ObjectInfo]) -> _Listing:
        listing = cls()
        for info in objects:
            found = _parts(info.key)
            if found is None:
                continue
            base, kind, cid = found
            if kind == GONE:
                listing.stones.setdefault((base, cid), []).append(info)
            elif kind == keys.RECIPES:
                listing.attempts.setdefault((base, cid), []).append(info)
            elif kind == keys.BLOCKS:
                listing.blocks[(base, cid)] = info
            else:
                (listing.manifests if kind == keys.MANIFESTS else listing.blobs)[(base, cid)] = info
        return listing


def _expired(listing: _Listing, drop: list[Key], *, now: float, grace: float, block_grace: float) -> list[str]:
    """The blobs, recipes and tombstones past their grace period, of snapshots no manifest publishes."""
    delete: list[str] = []
    for k in set(listing.blobs) | set(listing.stones) | set(listing.attempts):
        dated = listing.stones.get(k, [])
        if k in listing.manifests:
            if k not in drop:
                delete += [s.key for s in dated]  # left from an earlier unpublish; the snapshot is back
            continue  # unpublished by this run: the blob waits for the grace period
        blob = listing.blobs.get(k)
        tried = listing.attempts.get(k, [])
        old = [r.key for r in tried if now - r.modified > block_grace]  # a younger one: an upload in progress
        if dated:
            if now - max(s.modified for s in dated) > grace:
                delete += [s.key for s in dated] + ([blob.key] if blob else []) + old
        else:
            if blob is not None and now - blob.modified > grace:
                delete.append(blob.key)  # an upload that never published its manifest
            delete += old  # likewise, as blocks
    return delete


class _Sizes:
    """Bytes the kept snapshots hold: a blob each, and every block their recipes name counted once."""

    def __init__(
        self,
        blobs: Mapping[tuple[str, str], objstore.ObjectInfo],
        blocks: Mapping[tuple[str, str], objstore.ObjectInfo],
        attempts: Mapping[tuple[str, str], list[objstore.ObjectInfo]],
        named: Blocks,
    ) -> None:
        self._blobs, self._blocks, self._attempts, self._named = blobs, blocks, attempts, named
        self._users: dict[tuple[str, str], int] = {}
        self.total = 0

    def _of(self, k: tuple[str, str]) -> set[tuple[str, str]]:
        return {(k[0], d) for r in self._attempts.get(k, []) for d in (self._named.get(r.key) or ())}

    def add(self, k: tuple[str, str]) -> None:
        self.total += self._blobs[k].size if k in self._blobs else 0
        for b in self._of(k):
            self._users[b] = self._users.get(b, 0) + 1
            if self._users[b] == 1 and b in self._blocks:
                self.total += self._blocks[b].size

    def remove(self, k: tuple[str, str]) -> None:
        self.total -= self._blobs[k].size if k in self._blobs else 0
        for b in self._of(k):
            self._users[b] -= 1
            if self._users[b] == 0 and b in self._blocks:
                self.total -= self._blocks[b].size


def _unreferenced_blocks(
    blocks: Mapping[tuple[str, str], objstore.ObjectInfo],
    attempts: Mapping[tuple[str, str], list[objstore.ObjectInfo]],
    named: Blocks,
    *,
    gone: set[str],
    now: float,
    grace: float,
) -> list[str]:
    """Blocks older than ``grace`` that no recipe left after this run names (none of a namespace with an
    unreadable recipe)."""
    referenced: set[tuple[str, str]] = set()
    blind: set[str] = set()
    for (base, _), tried in attempts.items():
        for r in tried:
            if r.key in gone:
                continue
            digests = named.get(r.key)
            if digests is None:
                blind.add(base)
            else:
                referenced |= {(base, d) for d in digests}
    return [
        info.key
        for k, info in blocks.items()
        if k not in referenced and k[0] not in blind and now - info.modified > grace
    ]


async def collect(
    store: objstore.ObjectStore,
    prefix: str,
    *,
    now: float,
    max_age: float,
    max_bytes: int,
    grace: float = GRACE,
    dry_run: bool = False,
) -> Plan:
    """Mark the run, list everything under ``prefix``, read the recipes, plan, and (unless ``dry_run``)
    unpublish and delete until :data:`fence.DEADLINE`; then remove the mark."""
    started = time.monotonic()
    marker = keys.gc_marker(prefix, now, secrets.token_hex(4))
    if not dry_run:
        await store.put_bytes(marker, b"")
    try:
        listed = await store.list_objects(keys.join(prefix) + "/" if prefix else "")
        named = await read_recipes(store, [i.key for i in listed if _is_recipe(i.key)])
        done = plan(listed, now=now, max_age=max_age, max_bytes=max_bytes, grace=grace, recipes=named)
        if dry_run:
            return done
        for key in done.unpublish:
            await store.put_bytes(tombstone(key, now), b"")
        if done.unpublish:
            await store.delete(list(done.unpublish))
        for at in range(0, len(done.delete), DELETE_BATCH):
            if time.monotonic() - started >= fence.DEADLINE:
                return dataclasses.replace(done, late=True)
            await store.delete(list(done.delete[at : at + DELETE_BATCH]))
        return done
    finally:
        if not dry_run:
            await store.delete([marker])


DELETE_BATCH = 1000
"""Keys deleted per request, the deadline checked before each."""


def _is_recipe(key: str) -> bool:
    found = _parts(key)
    return found is not None and found[1] == keys.RECIPES


async def read_recipes(store: objstore.ObjectStore, recipe_keys: list[str]) -> dict[str, frozenset[str] | None]:
    """The block digests each recipe names; None for one that cannot be read or parsed (its blocks are unknown)."""
    named: dict[str, frozenset[str] | None] = {}
    for key in recipe_keys:
        try:
            raw = await store.get_bytes(key, limit=recipe.MAX_BYTES)
            named[key] = frozenset(recipe.Recipe.from_json(raw.decode()).digests())
        except errors.SharedStoreError as exc:
            if exc.missing:
                continue  # deleted since the listing (by another run): names nothing
            named[key] = None
        except (ValueError, UnicodeDecodeError, json.JSONDecodeError):
            named[key] = None
    return named
