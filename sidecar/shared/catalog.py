"""What the shared store holds for this server, and the best match for a request's tokens.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/catalog.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable

import structlog

from sidecar.core import errors, outcomes, protocols
from sidecar.shared import keys, objstore, records
from sidecar.snapshots import manifest, slotfile

log = structlog.get_logger("sidecar.shared")
REFRESH_EVERY = 5.0
"""Seconds a listing is reused before the store is listed again."""
READ_BATCH = 16
"""Manifests read at once after a listing (the first listing of a busy namespace reads many)."""


Record = records.SharedRecord
"""A shared manifest (named apart: :meth:`Catalog.records` hides the module inside the class)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    record: records.SharedRecord
    blocks: int
    """Leading blocks the record shares with the request."""

    @property
    def tokens(self) -> int:
        """Prompt tokens the match saves."""
        return self.blocks * self.record.block_tokens


def best_match(
    found: Iterable[records.SharedRecord], chain: tuple[str, ...], *, max_tokens: int, block_tokens: int
) -> Match | None:
    """The record sharing the most leading blocks with ``chain`` (newest on a tie); None if none shares one."""
    best: Match | None = None
    for record in found:
        if record.block_tokens != block_tokens or record.snapshot.tokens > max_tokens:
            continue
        blocks = slotfile.shared_blocks(record.chain, chain)
        if blocks == 0:
            continue
        if best is None or (blocks, record.uploaded) > (best.blocks, best.record.uploaded):
            best = Match(record, blocks)
    return best


class Catalog:
    """The shared manifests of each namespace, listed and read lazily, cached by key."""

    def __init__(
        self,
        store: objstore.ObjectStore,
        prefix: str,
        *,
        refresh_every: float = REFRESH_EVERY,
        clock: protocols.Clock | None = None,
        on_error: Callable[[errors.SharedStoreError], None] = lambda exc: None,
        on_refused: Callable[[str, outcomes.SharedRefusal, str], None] = lambda key, reason, detail: None,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._refresh_every = refresh_every
        self._clock = clock or protocols.SystemClock()
        self._on_error = on_error
        self._on_refused = on_refused
        self._records: dict[str, records.SharedRecord | None] = {}
        """Every manifest key read so far; None for one that does not parse (not read again)."""
        self._listed: dict[str, tuple[float, list[str]]] = {}
        self._lock = asyncio.Lock()

    async def records(self, ns: str) -> list[records.SharedRecord]:
        """The readable shared manifests of ``ns``; raises SharedStoreError if the store cannot be listed."""
        async with self._lock:
            listed = self._listed.get(ns)
            if listed is None or self._clock.monotonic() - listed[0] >= self._refresh_every:
                infos = await self._store.list_objects(keys.manifests_under(self._prefix, ns))
                for info in infos:
                    if info.size > manifest.MAX_BYTES and info.key not in self._records:
                        self._records[info.key] = None  # refused unread, and never read
                        self._on_refused(
                            info.key,
                            outcomes.SharedRefusal.OVERSIZED,
                            f"{info.size} bytes; a manifest is at most {manifest.MAX_BYTES}",
                        )
                listed = (self._clock.monotonic(), [i.key for i in infos if keys.is_manifest(i.key)])
                self._listed[ns] = listed
            unread = [key for key in listed[1] if key not in self._records]
            for start in range(0, len(unread), READ_BATCH):
                await asyncio.gather(*(self._read(key) for key in unread[start : start + READ_BATCH]))
            return [r for k in listed[1] if (r := self._records.get(k)) is not None]

    async def _read(self, key: str) -> None:
        try:
            raw = await self._store.get_bytes(key, limit=manifest.MAX_BYTES)
        except errors.SharedObjectRefused as exc:
            self._records[key] = None
            self._on_refused(key, outcomes.SharedRefusal(exc.reason), str(exc))
            return
        except errors.SharedStoreError as exc:
            if not exc.missing:
                self._on_error(exc)  # read again at the next listing
            return
        try:
            self._records[key] = records.SharedRecord.from_json(raw)
        except (ValueError, manifest.NewerFormatError) as exc:
            self._records[key] = None
            self._on_refused(key, outcomes.SharedRefusal.UNREADABLE, str(exc))

    def forget(self, ns: str) -> None:
        """List ``ns`` again at the next call."""
        self._listed.pop(ns, None)

    def published(self, ns: str, key: str, record: Record) -> None:
        """This node wrote ``record`` under ``key`` in ``ns``: known without reading it back, and listed from now on.

        A request's lookup then neither lists the store again for it nor reads the node's own manifests back
        (one GET each, on the request's path); other nodes' new manifests are listed within ``refresh_every``.
        """
        self._records[key] = record
        listed = self._listed.get(ns)
        if listed is not None and key not in listed[1]:
            listed[1].append(key)

    async def lookup(self, ns: str, chain: tuple[str, ...], *, max_tokens: int) -> Match | None:
        """The shared snapshot with the longest common prefix with ``chain``; None if none shares a block."""
        return best_match(await self.records(ns), chain, max_tokens=max_tokens, block_tokens=slotfile.BLOCK_TOKENS)
