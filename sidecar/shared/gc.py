"""Retention in the shared store: ``llama-kv-sidecar gc --shared-store URL``.

Snapshots are dropped by age (``--max-age``) and then oldest first until
the blobs kept fit ``--max-bytes``. Deletion never takes an object a
manifest still names, and never one a node may be downloading:

1. a dropped snapshot loses its manifest, after a tombstone
   (``<ns>/gone/<checksum>@<time>``) recorded when: from then on no node finds it;
2. its blob is deleted by a later run, once the tombstone is older than
   ``--grace`` (longer than any download takes), together with the tombstone;
3. a blob no manifest names and no tombstone dates (an upload that died
   before its manifest) is deleted once it is older than ``--grace``: an
   upload in progress writes its manifest seconds after its blob.

:func:`plan` is pure; :func:`collect` lists, plans and deletes.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterable

from sidecar.shared import keys, objstore

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
    """Bytes of the blobs whose manifests stay."""


def _parts(key: str) -> tuple[str, str, str] | None:
    """(namespace path, kind, content id) of a key of the layout in ``keys``; None for other keys."""
    head, name = posixpath.split(key)
    base, kind = posixpath.split(head)
    if kind == GONE:
        return base, kind, name.split("@", 1)[0]
    if kind in (keys.MANIFESTS, keys.BLOBS):
        return base, kind, name.rsplit(".", 1)[0]
    return None


def tombstone(manifest_key: str, now: float) -> str:
    """``<ns>/gone/<content id>@<unix time>``: when the snapshot was unpublished."""
    found = _parts(manifest_key)
    assert found is not None
    return posixpath.join(found[0], GONE, f"{found[2]}@{int(now)}")


def plan(objects: Iterable[objstore.ObjectInfo], *, now: float, max_age: float, max_bytes: int, grace: float) -> Plan:
    """What to unpublish and delete; ``max_age`` 0 and ``max_bytes`` 0 mean no limit."""
    manifests: dict[tuple[str, str], objstore.ObjectInfo] = {}
    blobs: dict[tuple[str, str], objstore.ObjectInfo] = {}
    stones: dict[tuple[str, str], list[objstore.ObjectInfo]] = {}
    for info in objects:
        found = _parts(info.key)
        if found is None:
            continue
        base, kind, cid = found
        if kind == GONE:
            stones.setdefault((base, cid), []).append(info)
        else:
            (manifests if kind == keys.MANIFESTS else blobs)[(base, cid)] = info
    live = sorted(manifests, key=lambda k: manifests[k].modified, reverse=True)  # newest first
    drop = [k for k in live if max_age > 0 and now - manifests[k].modified > max_age]
    kept = [k for k in live if k not in drop]
    total = sum(blobs[k].size for k in kept if k in blobs)
    while max_bytes > 0 and kept and total > max_bytes:
        oldest = kept.pop()
        drop.append(oldest)
        total -= blobs[oldest].size if oldest in blobs else 0
    delete: list[str] = []
    for k in set(blobs) | set(stones):
        dated = stones.get(k, [])
        if k in manifests:
            if k not in drop:
                delete += [s.key for s in dated]  # left from an earlier unpublish; the snapshot is back
            continue  # unpublished by this run: the blob waits for the grace period
        blob = blobs.get(k)
        if dated:
            if now - max(s.modified for s in dated) > grace:
                delete += [s.key for s in dated] + ([blob.key] if blob else [])
        elif blob is not None and now - blob.modified > grace:
            delete.append(blob.key)  # an upload that never published its manifest
    return Plan(tuple(sorted(manifests[k].key for k in drop)), tuple(sorted(delete)), total)


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
    """List everything under ``prefix``, plan, and (unless ``dry_run``) unpublish and delete."""
    listed = await store.list_objects(keys.join(prefix) + "/" if prefix else "")
    done = plan(listed, now=now, max_age=max_age, max_bytes=max_bytes, grace=grace)
    if dry_run:
        return done
    for key in done.unpublish:
        await store.put_bytes(tombstone(key, now), b"")
    if done.unpublish:
        await store.delete(list(done.unpublish))
    if done.delete:
        await store.delete(list(done.delete))
    return done
