"""Router mode: recognising a llama-server router, the settings it takes, and its wiring (one engine per model).

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import dataclasses

import aiohttp
import structlog

from sidecar.app import parts
from sidecar.core import config, errors, metrics, protocols
from sidecar.observe import upstream, weights
from sidecar.router import admission, fleet
from sidecar.snapshots import store

log = structlog.get_logger("sidecar.app")


async def found_mode(settings: config.Settings) -> config.Settings:
    """Router mode if the server answers now and says it is a router; else as given (the poller watches for it).

    Asked once before anything starts, so a router found here costs no restart of the
    wiring; a server that does not answer yet is recognised by its first /props later.
    """
    async with aiohttp.ClientSession(raise_for_status=False) as session:
        try:
            await upstream.LlamaClient(session, settings.upstream).props()
        except errors.UpstreamIsRouter as exc:
            return as_router(settings, str(exc))
        except errors.UpstreamError:
            pass
    return settings


def as_router(settings: config.Settings, why: str) -> config.Settings:
    """The settings of router mode, once a server the sidecar was not told about says it is a router."""
    log.info(
        "router_mode_detected",
        reason=why,
        effect="the sidecar watches in router mode (restarting its watching if it had begun): one engine "
        "per model, snapshot files named after the model",
        hint="--router / LLAMA_SIDECAR_ROUTER=1 says it up front; --no-router (=0) forces plain mode",
    )
    shared = settings.shared
    if shared.location is not None:
        log.error(
            "shared_store_off_in_router_mode",
            effect="snapshots are not uploaded to or fetched from --shared-store: it is offered only beside a "
            "plain llama-server",
            hint="drop --shared-store, or run one llama-server per model",
        )
        shared = dataclasses.replace(shared, location=None)
    upstream_settings = dataclasses.replace(settings.upstream, router=True)
    return dataclasses.replace(settings, upstream=upstream_settings, shared=shared)


def wire(
    settings: config.Settings, client: upstream.LlamaClient, snapshots: store.SnapshotStore, stats: metrics.Metrics
) -> parts.Parts:
    """A router: one watch per model, started by the fleet; no library, no shared store (not offered)."""
    models = fleet.Fleet(
        client=client,
        snapshots=snapshots,
        stats=stats,
        settings=settings,
        clock=protocols.SystemClock(),
        weights=weights.WeightsIdentifier(parts.cache_dir(settings)).identify,
    )
    admit = admission.Admission(models=models, client=client, stats=stats, settings=settings).admit
    return parts.Parts(models, {"router": models.run()}, models.gate, admit=admit)
