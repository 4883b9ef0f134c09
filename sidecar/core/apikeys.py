"""llama-server's API keys as the proxy checks them, and whom a conversation belongs to. Pure.

Keys are checked as llama-server checks them. With keys, a conversation's owner is a fingerprint of
its key or its key's pool, written into manifests so the conversation follows on any node with the
same keys; without keys everything is shared.

Invariants and trade-offs: docs/modules.md, `sidecar/core/apikeys.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Iterable, Mapping

NOBODY = ""
"""The owner of every conversation when llama-server has no API keys (and of snapshots written before owners)."""
POOL_LINE = "# pool:"
"""A key file line that starts a pool: the keys on the lines after it share their conversations."""
_BEARER = "Bearer "


def owner_of(*, key: str | None = None, pool: str | None = None) -> str:
    """The fingerprint that stands for a key (or a pool) in manifests: 32 hex digits of SHA-256, never the key."""
    material = b"pool\0" + pool.encode() if pool is not None else b"key\0" + (key or "").encode("utf-8", "replace")
    return hashlib.sha256(b"llama-kv-sidecar owner\0" + material).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    """The keys llama-server accepts; each key's owner."""

    keys: tuple[str, ...]
    pools: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Key to pool name, for keys a ``# pool:`` line put in a pool."""

    @property
    def first(self) -> str | None:
        """The key the sidecar itself sends."""
        return self.keys[0] if self.keys else None

    def check(self, authorization: str | None, api_key: str | None) -> str | None:
        """The owner of a request with these header values, as llama-server reads them; None: refused."""
        given = authorization or api_key or ""
        given = given.removeprefix(_BEARER)
        raw = given.encode("utf-8", "surrogateescape")
        found: str | None = None
        for key in self.keys:  # every key compared, in constant time: the time says nothing of which matched
            if hmac.compare_digest(raw, key.encode("utf-8", "surrogateescape")):
                found = key
        if found is None:
            return None
        pool = self.pools.get(found)
        return owner_of(pool=pool) if pool is not None else owner_of(key=found)


def of_list(keys: Iterable[str]) -> Keys | None:
    """Keys given as a list (``--api-key k1,k2``); None for no key."""
    kept = tuple(k for k in keys if k)
    return Keys(kept) if kept else None


def of_file(lines: Iterable[str]) -> Keys | None:
    """Keys of llama-server's key file (one per line, ``#`` comments), with the pools its ``# pool:`` lines set.

    ``# pool: NAME`` puts the keys on the lines after it in pool NAME, up to the next ``# pool:`` line;
    ``# pool:`` with no name ends the pool. llama-server reads those lines as comments.
    """
    kept: list[str] = []
    pools: dict[str, str] = {}
    pool: str | None = None
    for line in lines:
        if line.startswith(POOL_LINE):
            pool = line.removeprefix(POOL_LINE).strip() or None
            continue
        if not line or line.startswith("#"):
            continue
        kept.append(line)
        if pool is not None:
            pools[line] = pool
    return Keys(tuple(kept), pools) if kept else None
