"""The shared store on a request's path: whether it holds a prefix worth fetching, and the download. I/O.

When the best local prefix (a slot's or the library's) is shorter than one
the store holds, :meth:`Fetcher.find` asks whether fetching it beats
prefilling the difference (``SharedStore.worth``, with this server's
measured prefill rate, else the one the snapshot records, else the one this
node kept in its snapshots: ``decide.pick_prefill_rate``). The lookup is
bounded by :data:`LOOKUP_SECONDS` and the download by the proxy's hold; a
store that is down, slow or wrong costs the request at most that wait
(counted in ``shared_store_errors_total``).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from sidecar.core import events, metrics, outcomes
from sidecar.library import routing, seams
from sidecar.restore import savings
from sidecar.shared import decide, records
from sidecar.snapshots import manifest, slotfile, store

log = structlog.get_logger("sidecar.library")
LOOKUP_SECONDS = 2.0
"""Longest a request waits for the shared store to say what it holds for it, in seconds."""


class Fetcher:
    def __init__(
        self, shared: seams.Shared, *, snapshots: store.SnapshotStore, stats: metrics.Metrics, hold_seconds: float
    ) -> None:
        self._shared = shared
        self._snapshots = snapshots
        self._stats = stats
        self._hold = hold_seconds

    async def find(
        self,
        identity: events.Identity,
        chain: tuple[str, ...],
        local: routing.Decision,
        obs: events.Observation,
        owner: str,
    ) -> tuple[routing.Entry, records.SharedRecord] | None:
        """The shared snapshot of ``owner``'s worth fetching for ``chain`` over the best local choice ``local``;
        None if none."""
        if local.slot is None or len(chain) <= local.blocks or not obs.slots:
            return None  # no store, no idle slot to fetch into, or the whole prompt is at hand already
        started = time.perf_counter()
        try:
            async with asyncio.timeout(min(LOOKUP_SECONDS, self._hold)):
                match = await self._shared.lookup(
                    identity, chain, max_tokens=min(v.n_ctx for v in obs.slots), owner=owner
                )
        except TimeoutError:
            self._slow(outcomes.SharedOperation.LIST, LOOKUP_SECONDS, "looking up the request's prefix")
            return None
        if match is None or match.blocks <= local.blocks:
            return None
        counters = obs.counters
        rate, rate_source = decide.pick_prefill_rate(
            server=savings.measured_rate(counters) if counters is not None else None,
            snapshot=match.record.snapshot.prefill_rate,
            kept=next((m.prefill_rate for m in self._snapshots.snapshots() if m.prefill_rate is not None), None),
        )
        cached = local.blocks * slotfile.BLOCK_TOKENS
        estimate = await self._shared.worth(match, cached_tokens=cached, prefill_rate=rate)
        log.info(
            "shared_prefix_found",
            tokens=match.tokens,
            local_tokens=cached,
            bytes=match.record.snapshot.bytes,
            transfer_bytes=estimate.bytes,
            lookup_seconds=round(time.perf_counter() - started, 4),
            prefill_rate=round(rate),
            prefill_rate_from=rate_source.value,
            fetch_seconds=round(estimate.fetch_seconds, 3),
            prefill_seconds=round(estimate.prefill_seconds, 3),
            verdict=estimate.verdict.value,
        )
        if estimate.verdict is not decide.Verdict.FETCH:
            return None
        return routing.Entry(match.record.key, match.record.chain), match.record

    async def download(self, shared: records.SharedRecord, *, slot: int) -> manifest.Manifest | None:
        """The snapshot ``shared`` downloaded into ``slot``'s name; None if the store failed or was too slow."""
        try:
            async with asyncio.timeout(self._hold):
                return await self._shared.fetch(shared, slot=slot)
        except TimeoutError:
            self._slow(outcomes.SharedOperation.GET, self._hold, "downloading the request's prefix")
            return None

    def _slow(self, operation: outcomes.SharedOperation, seconds: float, doing: str) -> None:
        self._stats.shared_errors.labels(operation).inc()
        log.warning(
            "shared_store_slow",
            doing=doing,
            seconds=seconds,
            effect="the request runs without it, prefilled by llama-server (counted in "
            "llama_sidecar_shared_store_errors_total)",
        )
