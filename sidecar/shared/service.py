"""The shared store as the rest of the sidecar sees it: offer, warm, lookup, fetch, worth.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/service.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from sidecar.blocks import recipe as blockrecipe
from sidecar.core import apikeys, errors, events, location, metrics, outcomes
from sidecar.shared import blockdown, catalog, connect, decide, downloader, keys, objstore, records, uploader
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.shared")
WARM_TIMEOUT = 60.0
"""Longest a restore round waits for snapshots fetched from the shared store, in seconds."""
WARM_LIST_SECONDS = 10.0
"""Longest a restore round waits for the shared store's listing: a store that hangs (a frozen server, a
network that drops packets) must not hold the restore gate for all of :data:`WARM_TIMEOUT`."""
RECIPE_SECONDS = 1.0
"""Longest the request path waits for a recipe to price a block fetch; then the whole file is priced."""
RECIPE_CACHE = 256
"""Recipes' block lists kept (objects never change once written)."""


class SharedStore:
    def __init__(
        self,
        where: location.Location,
        *,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        objects: objstore.ObjectStore | None = None,
    ) -> None:
        self.where = where
        self.objects = objects or connect.open_store(where)
        prefix = where.key_prefix
        self._snapshots = snapshots
        self._stats = stats
        self._recipes: dict[str, tuple[tuple[str, int], ...]] = {}
        self._refused: set[str] = set()
        """Keys of the blobs this process refused (incompatible or corrupt): never fetched again."""
        self.rate = decide.Rate()
        """Measured bandwidth of this node's transfers (bytes per second)."""
        self.catalog = catalog.Catalog(self.objects, prefix, on_error=self._count, on_refused=self._refused_manifest)
        self.uploader = uploader.Uploader(
            self.objects,
            prefix=prefix,
            snapshots=snapshots,
            stats=stats,
            rate=self.rate,
            on_published=self.catalog.published,
        )

    def _count(self, exc: errors.SharedStoreError) -> None:
        self._stats.shared_errors.labels(exc.operation if exc.operation in metrics.SHARED_OPERATIONS else "get").inc()

    def describe(self) -> str:
        """Where the store is, without credentials."""
        return self.where.describe()

    def waiting(self) -> frozenset[str]:
        """Local snapshots still waiting for their upload."""
        return self.uploader.waiting()

    def offer(self, record: manifest.Manifest) -> None:
        """Queue a committed snapshot for upload (any thread)."""
        self.uploader.offer(record)

    async def run(self) -> None:
        """The ``uploader`` task."""
        log.info("shared_store_enabled", store=self.objects.describe())
        await self.uploader.run()

    async def close(self) -> None:
        await self.objects.close()

    @staticmethod
    def namespace(identity: events.Identity) -> str:
        return keys.namespace(manifest.Fingerprint.of(identity, n_ctx=0))

    async def lookup(
        self, identity: events.Identity, chain: tuple[str, ...], *, max_tokens: int, owner: str = apikeys.NOBODY
    ) -> catalog.Match | None:
        """The shared snapshot of ``owner``'s sharing the longest prefix with ``chain`` that fits this server;
        None if none, or the store failed. Another owner's snapshots are never offered, nor looked into."""
        try:
            found = await self.catalog.records(self.namespace(identity))
        except errors.SharedStoreError as exc:
            self._failed(exc, "lookup")
            return None
        return catalog.best_match(
            self._fitting((r for r in found if r.snapshot.owner == owner), identity, max_tokens=max_tokens),
            chain,
            max_tokens=max_tokens,
            block_tokens=slotfile.BLOCK_TOKENS,
        )

    def _fitting(
        self, found: Iterable[records.SharedRecord], identity: events.Identity, *, max_tokens: int
    ) -> list[records.SharedRecord]:
        """The records of ``found`` this server can restore; the others are refused (said once, counted)."""
        fitting: list[records.SharedRecord] = []
        for record in found:
            if record.key in self._refused:
                continue
            if record.snapshot.tokens > max_tokens:
                continue  # too long for these slots, not foreign: another server of the namespace may take it
            problems = manifest.incompatibilities(record.snapshot, identity, slot_n_ctx=max_tokens)
            if problems:
                self._refuse(record.key, outcomes.SharedRefusal.INCOMPATIBLE, "; ".join(problems))
                continue
            fitting.append(record)
        return fitting

    def _refuse(self, key: str, reason: outcomes.SharedRefusal, detail: str) -> None:
        if key in self._refused:
            return
        self._refused.add(key)
        self._stats.shared_refused.labels(reason.value).inc()
        log.error(
            "shared_snapshot_refused",
            key=key,
            reason=reason.value,
            detail=detail,
            effect="never fetched nor restored by this node; requests it would have served are prefilled",
            hint=_HINTS[reason],
        )

    def _refused_manifest(self, key: str, reason: outcomes.SharedRefusal, detail: str) -> None:
        self._refuse(key, reason, detail)

    async def worth(self, match: catalog.Match, *, cached_tokens: int, prefill_rate: float) -> decide.Estimate:
        """Whether fetching ``match`` beats prefilling what it adds over ``cached_tokens`` already at hand."""
        return decide.fetch_or_prefill(
            size=await self.transfer_bytes(match.record),
            saved_tokens=max(0, match.tokens - cached_tokens),
            bandwidth=self.rate.current(),
            prefill_rate=prefill_rate,
        )

    async def transfer_bytes(self, shared: records.SharedRecord) -> int:
        """Bytes a fetch of ``shared`` would download: the blocks this node lacks, or the whole file.

        A snapshot uploaded as blocks is priced by its recipe (read once, bounded, within
        :data:`RECIPE_SECONDS`) against this node's block store; any failure prices the whole file.
        """
        if not shared.recipe:
            return shared.snapshot.bytes
        try:
            async with asyncio.timeout(RECIPE_SECONDS):
                blocks = await self._recipe_blocks(shared.recipe)
            return await asyncio.to_thread(blockdown.missing_bytes, self._snapshots, blocks)
        except (TimeoutError, errors.SharedStoreError, ValueError, UnicodeDecodeError):
            return shared.snapshot.bytes

    async def _recipe_blocks(self, key: str) -> tuple[tuple[str, int], ...]:
        known = self._recipes.get(key)
        if known is None:
            raw = await self.objects.get_bytes(key, limit=blockrecipe.MAX_BYTES)
            known = tuple((b.digest, b.size) for b in blockrecipe.Recipe.from_json(raw.decode()).blocks())
            if len(self._recipes) >= RECIPE_CACHE:
                self._recipes.clear()
            self._recipes[key] = known
        return known

    async def fetch(self, shared: records.SharedRecord, *, slot: int) -> manifest.Manifest | None:
        """Download ``shared`` into the slot dir as a snapshot of ``slot``; None if it failed (logged, counted)."""
        try:
            return await downloader.fetch(
                self.objects, shared, snapshots=self._snapshots, slot=slot, stats=self._stats, rate=self.rate
            )
        except errors.SharedObjectRefused as exc:
            self._refuse(shared.key, outcomes.SharedRefusal(exc.reason), str(exc))
        except errors.SharedStoreError as exc:
            self._failed(exc, "fetch")
        except errors.SnapshotError as exc:
            log.error("shared_fetch_failed", key=shared.key, error=str(exc), effect="the slot is prefilled instead")
        return None

    async def warm(self, identity: events.Identity, slots: tuple[events.SlotView, ...]) -> list[manifest.Manifest]:
        """Fetch the newest shared snapshots into empty slots that have none locally; bounded by WARM_TIMEOUT."""
        local = {m.checksum.digest for m in self._snapshots.snapshots()}
        empty = [v for v in slots if v.empty and not self._snapshots.snapshots(v.id)]
        if not empty:
            return []
        fetched: list[manifest.Manifest] = []
        try:
            async with asyncio.timeout(WARM_TIMEOUT):
                try:
                    async with asyncio.timeout(WARM_LIST_SECONDS):
                        found = await self.catalog.records(self.namespace(identity))
                except errors.SharedStoreError as exc:
                    self._failed(exc, "warm")
                    return []
                except TimeoutError:
                    log.warning(
                        "shared_warm_timeout",
                        seconds=WARM_LIST_SECONDS,
                        fetched=0,
                        doing="listing the shared snapshots",
                        effect="the restore round goes on with what is in the slot dir",
                    )
                    return []
                fitting = self._fitting(found, identity, max_tokens=max(v.n_ctx for v in empty))
                fresh = sorted(
                    (r for r in fitting if r.snapshot.checksum.digest not in local), key=lambda r: -r.uploaded
                )
                for view in empty:
                    pick = next((r for r in fresh if r.snapshot.tokens <= view.n_ctx), None)
                    if pick is None:
                        break
                    fresh.remove(pick)
                    got = await self.fetch(pick, slot=view.id)
                    if got is not None:
                        fetched.append(got)
        except TimeoutError:
            log.warning(
                "shared_warm_timeout",
                seconds=WARM_TIMEOUT,
                fetched=len(fetched),
                effect="the restore round goes on with what is in the slot dir",
            )
        return fetched

    def _failed(self, exc: errors.SharedStoreError, doing: str) -> None:
        self._count(exc)
        log.warning(
            "shared_store_unavailable",
            doing=doing,
            operation=exc.operation,
            error=str(exc),
            effect="served from the local slot dir only",
        )


_HINTS = {
    outcomes.SharedRefusal.INCOMPATIBLE: "a snapshot of another model, adapters, build or slot count was put "
    "under this server's key prefix; remove the object, and check who may write the bucket",
    outcomes.SharedRefusal.CORRUPT: "the blob was damaged or replaced after it was published; remove the "
    "object and its manifest (the node that made it uploads its snapshots again only under a new checksum)",
    outcomes.SharedRefusal.OVERSIZED: "no manifest is that large: something other than this sidecar wrote "
    "under the manifests prefix; remove the object, and check who may write the bucket",
    outcomes.SharedRefusal.UNREADABLE: "the manifest object does not parse (damaged, or written by another "
    "program); remove it, or upgrade this node if a newer llama-kv-sidecar wrote it",
}
