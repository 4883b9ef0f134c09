"""Nodes of the shared store in one process, for the unit tests: a slot dir (and a block store), a SharedStore."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.core import events, location, metrics, protocols
from sidecar.shared import objstore, service
from sidecar.snapshots import manifest, slotfile, store

IDENTITY = events.Identity("b1-abc", "/models/m.gguf", 2, 8192, 1000, 10, weights="xxh3-128:" + "3" * 32)
FP = manifest.Fingerprint.of(IDENTITY, n_ctx=4096)


def slot_file(ids: list[int], kv_bytes: int) -> bytes:
    """A slot file as llama-server writes it: header, packed token state, then KV data."""
    words = struct.pack("<iII", -1, slotfile.PACKED_VERSION, len(ids)) + struct.pack(f"<{len(ids)}i", *ids)
    head = struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, len(words) // 4)
    return head + words + os.urandom(kv_bytes)


def committed(snaps: store.SnapshotStore, data: bytes, *, slot: int = 0, tokens: int = 600) -> manifest.Manifest:
    temp = snaps.writer.temp_name(slot)
    (snaps.staging / temp).write_bytes(data)
    return snaps.writer.commit(temp, slot=slot, tokens=tokens, written=len(data), task=1, fingerprint=FP)


class Samples:
    """Reads one node's metrics by their exported names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def __call__(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"llama_sidecar_{name}", labels) or 0.0


def node(
    root: Path, where: location.Location, *, store_dir: Path | None = None
) -> tuple[store.SnapshotStore, service.SharedStore, Samples]:
    """A node on ``root`` (its slot dir); with ``store_dir``, its snapshots in a block store there."""
    root.mkdir()
    snaps = store.SnapshotStore(root, clock=protocols.SystemClock(), store_dir=store_dir)
    registry = CollectorRegistry()
    shared = service.SharedStore(where, snapshots=snaps, stats=metrics.Metrics(registry, version="test"))
    snaps.subscribe(shared.offer)
    return snaps, shared, Samples(registry)


def url_of(objects: objstore.ObjectStore, tmp_path: Path) -> str:
    text = objects.describe()
    return text.split(" at ")[0]
