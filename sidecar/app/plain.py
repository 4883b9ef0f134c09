"""The wiring of one plain llama-server: its watch, and beside it the shared store and the conversation library.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.app import parts
from sidecar.core import config, events, metrics, protocols
from sidecar.engine import spawn
from sidecar.library import placer, ramtier, reads, tokens
from sidecar.observe import upstream, weights
from sidecar.shared import service
from sidecar.snapshots import store


def wire(
    settings: config.Settings,
    client: upstream.LlamaClient,
    snapshots: store.SnapshotStore,
    stats: metrics.Metrics,
    *,
    starting: Callable[[], bool] | None = None,
) -> parts.Parts:
    """One llama-server: one watch, the shared store and the conversation library if configured.

    ``starting``: True while the launcher brings the server up (launcher mode; see ``spawn.watch``).
    """
    clock = protocols.SystemClock()
    own = snapshots.for_model(None)  # a plain server's snapshots, never a router model's
    shared = _shared_store(settings, own, stats)
    tokenizer = None
    slots_reader = None
    if settings.proxy.host is not None:

        def vocabulary() -> events.Identity | None:
            # Read once the engine, made just below, runs; it tells the tokenizer when the slots empty.
            latest = watched.engine.slots.seen()[0]  # the newest poll's own reading, never an earlier one's
            return latest.identity if latest is not None else None

        tokenizer = tokens.Cached(client.prompts, stats=stats, vocabulary=vocabulary)
        slots_reader = reads.SlotsReader(settings.upstream, stats=stats)
    watched = spawn.watch(
        client=client,
        snapshots=own,
        stats=stats,
        settings=settings,
        clock=clock,
        weights=weights.WeightsIdentifier(parts.cache_dir(settings)).identify,
        before_restore=shared.warm if shared is not None else None,
        detect_router=settings.upstream.router is None,
        prompts=client.prompts,
        starting=starting,
        read_fresh=slots_reader.slots if slots_reader is not None else None,
        # A restart forgets the tokenizer's remembered ids, unless the model and build are the same.
        told=(tokenizer,) if tokenizer is not None else (),
    )
    library = None
    if tokenizer is not None:
        library = placer.Placer(
            engine=watched.engine.slots,  # the placer follows the engine's slot changes from its construction on
            tokenizer=tokenizer,
            snapshots=own,
            stats=stats,
            clock=clock,
            shared=shared,
            hold_seconds=settings.proxy.hold_seconds,
            isolated=settings.upstream.keys is not None,
            ram=ramtier.RamTier(settings.proxy.server_cache_ram_bytes),
            max_unsaved_seconds=settings.snapshots.max_unsaved_seconds,
        )
    return parts.Parts(
        watched.engine,
        watched.loops(),
        watched.gate,
        shared=shared,
        library=library,
        slots_reader=slots_reader,
        quiet=watched.poller.quiet,
    )


def _shared_store(
    settings: config.Settings, snapshots: store.SnapshotStore, stats: metrics.Metrics
) -> service.SharedStore | None:
    """The shared store (--shared-store): uploads after each commit, fetches before each restore round."""
    where = settings.shared.location
    if where is None:
        return None
    shared = service.SharedStore(where, snapshots=snapshots, stats=stats)
    snapshots.subscribe(shared.offer)
    return shared
