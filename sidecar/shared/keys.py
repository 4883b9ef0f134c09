"""Object keys in the shared store. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/keys.py`.
"""

from __future__ import annotations

import hashlib
import json
import re

from sidecar.snapshots import manifest

BLOBS = "blobs"
MANIFESTS = "manifests"
BLOCKS = "blocks"
RECIPES = "recipes"
GC_RUNNING = "gc-running"
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def namespace(fp: manifest.Fingerprint) -> str:
    """``<model file stem>-<hash of everything a restore must match>``: readable and exact."""
    adapters = None if fp.adapters is None else [[a.id, a.path, a.scale] for a in fp.adapters]
    identity = [fp.build_info, fp.model_path, fp.model_size, fp.model_params, fp.weights, adapters, fp.total_slots]
    digest = hashlib.blake2b(json.dumps(identity).encode(), digest_size=10).hexdigest()
    stem = fp.model_path.rsplit("/", 1)[-1].removesuffix(".gguf").lower()
    readable = _UNSAFE.sub("-", stem).strip("-.")[:48] or "model"
    return f"{readable}-{digest}"


def content_id(checksum: manifest.Checksum) -> str:
    return f"{checksum.algorithm}-{checksum.digest}"


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def blob(prefix: str, ns: str, checksum: manifest.Checksum) -> str:
    return join(prefix, ns, BLOBS, content_id(checksum) + ".bin")


def shared_manifest(prefix: str, ns: str, checksum: manifest.Checksum) -> str:
    return join(prefix, ns, MANIFESTS, content_id(checksum) + ".json")


def manifests_under(prefix: str, ns: str) -> str:
    return join(prefix, ns, MANIFESTS) + "/"


def is_manifest(key: str) -> bool:
    return f"/{MANIFESTS}/" in f"/{key}" and key.endswith(".json")


def is_blob(key: str) -> bool:
    return f"/{BLOBS}/" in f"/{key}" and key.endswith(".bin")


def block(prefix: str, ns: str, digest: str) -> str:
    return join(prefix, ns, BLOCKS, digest + ".blk")


def block_beside(recipe_key: str, digest: str) -> str:
    """The key of block ``digest`` in the namespace of the recipe at ``recipe_key``."""
    return join(recipe_key.rsplit(f"/{RECIPES}/", 1)[0], BLOCKS, digest + ".blk")


def recipe(prefix: str, ns: str, checksum: manifest.Checksum, attempt: str) -> str:
    """One upload attempt's recipe: ``attempt`` is ``<unix time>-<random>``, so every attempt has a key of its own."""
    return join(prefix, ns, RECIPES, content_id(checksum), attempt + ".json")


def gc_marker(prefix: str, start: float, token: str) -> str:
    return join(prefix, GC_RUNNING, f"{int(start)}-{token}")


def gc_markers_under(prefix: str) -> str:
    return join(prefix, GC_RUNNING) + "/"


def marker_start(key: str) -> float | None:
    """The unix time a collection's marker says it started; None for another key."""
    head = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return float(head) if head.isdigit() else None
