"""Wiring and lifecycle of ``llama-kv-sidecar run``.

Starts the HTTP server, then the poller, the engine's action runner, the slot dir's watcher (and, in
launcher mode, llama-server) as tasks of one group; on a signal, takes the final snapshots under a
time budget and shuts down, exiting at once if something hangs past the deadline.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import prometheus_client
import structlog
from prometheus_client import CollectorRegistry

import sidecar
from sidecar.app import agentcheck, figures, history, server, storelog
from sidecar.core import config, errors, events, logfold, metrics, mounts, protocols, rates
from sidecar.engine import gate, report, spawn
from sidecar.launch import argv, supervisor
from sidecar.library import placer, ramtier, reads, tokens
from sidecar.observe import upstream, weights
from sidecar.proxy import listener, relay, sentinel
from sidecar.router import admission, fleet
from sidecar.shared import service
from sidecar.snapshots import dirlock, slotdir, store, upgrade, watcher

log = structlog.get_logger("sidecar.app")


EXIT_MARGIN = 5.0
"""Seconds past --final-timeout a signalled process may take to close its servers before it is ended."""
EXIT_STATUS_FORCED = 1


class Terminate(Exception):
    """Raised inside the task group to stop it on a signal."""


async def _stopper(stop: asyncio.Event) -> None:
    await stop.wait()
    raise Terminate


async def main(
    settings: config.Settings,
    *,
    ready: asyncio.Event | None = None,
    folding: logfold.Folding | None = None,
    launch: argv.Launch | None = None,
) -> None:
    """Run the sidecar until a signal; ``folding``: the logs' folding of repeated lines, whose summaries it runs;
    ``launch``: the llama-server command to start and supervise (launcher mode), None beside a server run elsewhere.
    """
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version=sidecar.__version__)
    snapshots = store.SnapshotStore(
        settings.snapshots.slot_dir,
        clock=protocols.SystemClock(),
        events=storelog.StoreLog(stats),
        store_dir=settings.snapshots.store_dir,
    )
    if snapshots.blocks is not None:  # measured at each scrape: what is staged now, never a stale count
        stats.store_staged.set_function(snapshots.staged.staged_bytes)
    problem = snapshots.check_writable()
    if problem:
        raise errors.ConfigError(problem + ": create it, or fix --slot-dir / LLAMA_SIDECAR_SLOT_DIR")
    lock = dirlock.DirLock(settings.snapshots.slot_dir)
    lock.acquire()
    store_lock = _store_lock(settings.snapshots.store_dir, lock)
    launcher = supervisor.Supervisor(launch, stats=stats) if launch is not None else None
    if launch is not None and launch.listen is not None:
        log.info(
            "proxy_takes_server_address",
            taken=list(launch.taken),
            hosts=list(launch.listen[0]),
            port=launch.listen[1],
            server=launch.url,
            effect="clients reach llama-server at the address its command gave it, through the proxy; "
            "llama-server itself listens on a private loopback port",
            hint="--no-proxy keeps llama-server on its own address (no restore gate, no library); "
            "--proxy-listen puts the proxy elsewhere",
        )
    try:
        if settings.upstream.router is None:
            settings = await _found_mode(settings)
        while True:
            try:
                await _run(settings, snapshots, stats, registry, lock, ready, folding, launcher)
            except* errors.RouterDetected as found:
                settings = _as_router(settings, str(found.exceptions[0]))
            except* errors.ServerNotStarted as failed:
                raise failed.exceptions[0] from None  # the sidecar ends with it: its status, its words
            else:
                return
    finally:
        lock.release()
        if store_lock is not None:
            store_lock.release()


def _store_lock(store_dir: Path | None, slot_lock: dirlock.DirLock) -> dirlock.DirLock | None:
    """The store dir's lock, held for life (see :mod:`~sidecar.snapshots.dirlock`); None without ``--store-dir``."""
    if store_dir is None:
        return None
    held = dirlock.DirLock(store_dir, kind="store dir", remedy="give this one a --store-dir of its own")
    try:
        held.acquire()
    except BaseException:
        slot_lock.release()
        raise
    return held


async def _found_mode(settings: config.Settings) -> config.Settings:
    """Router mode if the server answers now and says it is a router; else as given (the poller watches for it).

    Asked once before anything starts, so a router found here costs no restart of the
    wiring; a server that does not answer yet is recognised by its first /props later.
    """
    async with aiohttp.ClientSession(raise_for_status=False) as session:
        try:
            await upstream.LlamaClient(session, settings.upstream).props()
        except errors.UpstreamIsRouter as exc:
            return _as_router(settings, str(exc))
        except errors.UpstreamError:
            pass
    return settings


def _as_router(settings: config.Settings, why: str) -> config.Settings:
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Parts:
    """What the wiring made for one mode: a plain llama-server, or a router's models."""

    engines: report.Engines
    """The engine, or the fleet's engines in router mode: what the HTTP layer reads and what takes the final
    snapshots."""
    loops: dict[str, Coroutine[Any, Any, None]]
    """The tasks that watch the server(s), by name."""
    restore_gate: gate.Gate
    """Where the proxy holds completion requests."""
    admit: relay.Admit | None = None
    """Router mode: which model's gate a request waits at."""
    shared: service.SharedStore | None = None
    library: relay.Pinner | None = None
    slots_reader: reads.SlotsReader | None = None
    """The library's read of /slots on a routed request's path (closed after the proxy)."""
    quiet: Callable[[float], None] | None = None
    """Hold the poller's reads for a while (a client left a request llama-server runs); None in router mode."""


async def _run(
    settings: config.Settings,
    snapshots: store.SnapshotStore,
    stats: metrics.Metrics,
    registry: CollectorRegistry,
    lock: dirlock.DirLock,
    ready: asyncio.Event | None,
    folding: logfold.Folding | None,
    launcher: supervisor.Supervisor | None,
) -> None:
    await _load(settings, snapshots, stats)
    stop = _stop_on_signals(settings, launcher)
    async with aiohttp.ClientSession(raise_for_status=False) as session:
        client = upstream.LlamaClient(session, settings.upstream)
        if settings.upstream.router:
            parts = _router(settings, client, snapshots, stats)
        else:
            parts = _plain(settings, client, snapshots, stats, starting=launcher.hurried if launcher else None)
        dir_watcher = watcher.Watcher(snapshots, stats, lock)
        samples = history.History()
        app = server.make_app(
            engines=parts.engines,
            snapshots=snapshots,
            registry=registry,
            settings=settings.server,
            liveness=report.Liveness.of(settings),
            samples=samples,
            caps=(settings.snapshots.max_bytes, settings.snapshots.min_free_bytes),
            shared=parts.shared,
            launcher=launcher.status if launcher is not None else None,
            staging=(settings.snapshots.staging, settings.snapshots.staging_note),
        )
        handle = await server.start(app, settings.server)
        log.info("listening", host=handle.host, port=handle.port)
        try:
            agent = await _start_agent(settings.server, parts.engines)
        except BaseException:
            for loop_ in parts.loops.values():
                loop_.close()
            await handle.close()
            raise
        try:
            proxy = await _start_proxy(settings, parts, stats, client.rates)
        except BaseException:
            for loop_ in parts.loops.values():
                loop_.close()  # never started: no "coroutine was never awaited" at exit
            if agent is not None:
                await agent.close()
            await handle.close()
            raise
        dir_watcher.start()
        if ready is not None:
            ready.set()
        gate_ = parts.restore_gate
        launching = {"launcher": launcher.run(gate_.suspect, lambda: gate_.openings)} if launcher is not None else {}
        try:
            await _tasks(parts, dir_watcher, stop, _sample(samples, registry, parts.engines), folding, launching)
        except* Terminate:
            log.info("stopping", reason="signal")
        finally:
            await _close_doors(parts, agent, proxy)
            await _shutdown(parts.engines, settings, dir_watcher, handle, launcher)
            if parts.shared is not None:
                await parts.shared.close()


async def _close_doors(parts: _Parts, agent: agentcheck.Handle | None, proxy: listener.Listener | None) -> None:
    """Close what takes requests from outside, before the final snapshots."""
    if agent is not None:
        await agent.close()  # the balancer sees the node go (its health check) and stops sending to it
    if proxy is not None:
        await proxy.close()  # no new requests may change the slots during the final snapshots
    if parts.slots_reader is not None:
        await parts.slots_reader.close()


def _stop_on_signals(settings: config.Settings, launcher: supervisor.Supervisor | None) -> asyncio.Event:
    """The event SIGTERM and SIGINT set (see :func:`_on_signal`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    budget = settings.snapshots.final_timeout + EXIT_MARGIN + (launcher.stop_timeout if launcher else 0.0)
    at_once = functools.partial(_exit_at_once, launcher) if launcher is not None else None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, stop, budget, at_once)
    return stop


async def _load(settings: config.Settings, snapshots: store.SnapshotStore, stats: metrics.Metrics) -> None:
    """Index the slot dir (or the block store), removing what interrupted saves left."""
    if snapshots.blocks is None:
        log.info(
            "block_store_off",
            effect="each save writes the whole slot to the slot dir again, and every conversation keeps a whole "
            "copy of the prompt it shares with others (an 8B-class model: 128 KiB per token)",
            hint="drop --whole-files, or beside a server started elsewhere put --slot-dir on a tmpfs (the block "
            "store then lives in --state-dir) or set --store-dir to a disk directory: only the blocks the store "
            "lacks are written, shared prefixes are kept once",
        )
    else:
        told = storelog.StoreLog(stats)
        sources = [snapshots.staging]
        if settings.snapshots.convert_dir is not None:
            sources.append(settings.snapshots.convert_dir)
        for source in sources:
            moved = await asyncio.to_thread(
                upgrade.convert,
                slotdir.SlotDir(source, told.io_error),
                slotdir.SlotDir(snapshots.dir, told.io_error),
                snapshots.blocks,
            )
            for finding in moved.findings:
                log.warning("snapshot_not_converted", finding=finding)
            if moved.files:
                log.info(
                    "snapshots_converted",
                    directory=str(source),
                    files=moved.files,
                    bytes=moved.bytes,
                    effect="whole-file snapshots of that directory now live in the block store, and restore as before",
                )
    _say_staging(settings.snapshots)
    if await asyncio.to_thread(mounts.tmpfs_of_small_pages, snapshots.staging):
        log.info(
            "slot_dir_small_pages",
            slot_dir=str(snapshots.staging),
            effect="llama-server reads a snapshot it restores from this tmpfs (mounted without huge=) about 2.5x "
            "slower than from a disk's page cache or a tmpfs of huge pages (288 MB: 75-125 ms against 30-55 ms)",
            hint="mount the slot dir's tmpfs with -o huge=within_size (e.g. mount -t tmpfs -o "
            "size=16g,huge=within_size tmpfs DIR); nothing else changes",
            spare="until then the last file rebuilt for a restore is kept (one slot file of RAM, in "
            "store_staged_bytes) so the next rebuild writes over its pages instead of allocating new ones",
        )
    for finding in await asyncio.to_thread(snapshots.loader.scan, clean=True):
        log.info("slot_dir_cleaned", finding=finding)
    log.info(
        "snapshots_loaded",
        slot_dir=str(snapshots.staging),
        store_dir=None if snapshots.blocks is None else str(snapshots.blocks.root),
        snapshots=len(snapshots.snapshots()),
        server=settings.upstream.url,
    )


def _cache_dir(settings: config.Settings) -> Path:
    """Where the model files' checksums are remembered: the slot dir, or the state dir when the slot dir is the
    RAM staging dir removed at exit (the next start would hash the model again)."""
    state = settings.launch.state_dir
    return state if settings.snapshots.staging == "ram" and state is not None else settings.snapshots.slot_dir


def _say_staging(snap: config.SnapshotSettings) -> None:
    """Where llama-server saves, once at start-up: a cost on disk is a warning with its fix."""
    if snap.staging == "disk" and snap.staging_note:
        log.warning(
            "staging_on_disk",
            slot_dir=str(snap.slot_dir),
            effect=snap.staging_note,
            hint="the snapshots are safe either way; RAM staging only makes saves cheaper",
        )
    elif snap.staging:
        log.info("staging", slot_dir=str(snap.slot_dir), where=snap.staging, store_dir=str(snap.store_dir))


async def _tasks(
    parts: _Parts,
    dir_watcher: watcher.Watcher,
    stop: asyncio.Event,
    sampler: Coroutine[Any, Any, None],
    folding: logfold.Folding | None,
    launching: dict[str, Coroutine[Any, Any, None]],
) -> None:
    """Run every task until one fails or the stop flag is set (then :class:`Terminate` is raised)."""
    async with asyncio.TaskGroup() as group:
        group.create_task(sampler, name="history")
        for name, loop_ in (launching | parts.loops).items():
            group.create_task(loop_, name=name)
        group.create_task(dir_watcher.run(), name="watcher")
        group.create_task(_stopper(stop), name="stopper")
        if parts.shared is not None:
            group.create_task(parts.shared.run(), name="uploader")
        if folding is not None:
            group.create_task(folding.run(), name="log-fold")


def _plain(
    settings: config.Settings,
    client: upstream.LlamaClient,
    snapshots: store.SnapshotStore,
    stats: metrics.Metrics,
    *,
    starting: Callable[[], bool] | None = None,
) -> _Parts:
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

        tokenizer = tokens.Cached(client, stats=stats, vocabulary=vocabulary)
        slots_reader = reads.SlotsReader(settings.upstream, stats=stats)
    watched = spawn.watch(
        client=client,
        snapshots=own,
        stats=stats,
        settings=settings,
        clock=clock,
        weights=weights.WeightsIdentifier(_cache_dir(settings)).identify,
        before_restore=shared.warm if shared is not None else None,
        detect_router=settings.upstream.router is None,
        prompts=client,
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
    return _Parts(
        watched.engine,
        watched.loops(),
        watched.gate,
        shared=shared,
        library=library,
        slots_reader=slots_reader,
        quiet=watched.poller.quiet,
    )


def _router(
    settings: config.Settings, client: upstream.LlamaClient, snapshots: store.SnapshotStore, stats: metrics.Metrics
) -> _Parts:
    """A router: one watch per model, started by the fleet; no library, no shared store (not offered)."""
    models = fleet.Fleet(
        client=client,
        snapshots=snapshots,
        stats=stats,
        settings=settings,
        clock=protocols.SystemClock(),
        weights=weights.WeightsIdentifier(_cache_dir(settings)).identify,
    )
    admit = admission.Admission(models=models, client=client, stats=stats, settings=settings).admit
    return _Parts(models, {"router": models.run()}, models.gate, admit=admit)


def _on_signal(stop: asyncio.Event, budget: float, at_once: Callable[[], None] | None = None) -> None:
    """Stop the task group, and make sure the process ends within ``budget`` seconds whatever hangs.

    A second signal calls ``at_once`` (launcher mode: stop now), else it is ignored.
    """
    if stop.is_set():
        if at_once is not None:
            at_once()
        return
    stop.set()
    timer = threading.Timer(budget, _force_exit, args=(budget,))
    timer.daemon = True  # a process that ends in time does not wait for it
    timer.name = "exit deadline"
    timer.start()


def _force_exit(budget: float) -> None:
    stuck = sorted(t.name for t in threading.enumerate() if t.is_alive() and t is not threading.current_thread())
    log.error(
        "exit_forced",
        seconds=budget,
        threads=stuck,
        effect=f"the process exits now with status {EXIT_STATUS_FORCED}, {budget:g} s after the signal "
        "(--final-timeout plus the margin to close its servers); snapshots committed before stay good",
        hint="a worker thread was blocked, most likely reading the slot dir: check its disk or mount",
    )
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_STATUS_FORCED)


def _exit_at_once(launcher: supervisor.Supervisor) -> None:
    """A second signal in launcher mode: llama-server is killed, and the sidecar exits now."""
    log.warning(
        "exit_at_once",
        effect=f"llama-server is killed and the process exits now with status {EXIT_STATUS_FORCED}: slots whose "
        "final snapshot had not been committed are not saved (the snapshots committed before stay good)",
        hint="send one signal and wait for the final snapshots (--final-timeout) to keep every slot",
    )
    launcher.kill_now()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_STATUS_FORCED)


async def _sample(samples: history.History, registry: CollectorRegistry, engines: report.Engines) -> None:
    """The ``history`` task: a sample of the page's figures every ``history.SAMPLE_SECONDS``, in memory only."""
    while True:
        samples.add(figures.sample(registry, engines.status(), at=time.time()))
        await asyncio.sleep(history.SAMPLE_SECONDS)


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


async def _start_agent(settings: config.ServerSettings, engines: agentcheck.Known) -> agentcheck.Handle | None:
    """The agent-check port (--agent-check-listen), if asked for."""
    if settings.agent_host is None:
        return None
    try:
        agent = await agentcheck.start(engines, host=settings.agent_host, port=settings.agent_port)
    except OSError as exc:
        raise errors.ConfigError(
            f"--agent-check-listen {settings.agent_host}:{settings.agent_port}: cannot listen there "
            f"({exc.strerror or exc})"
        ) from exc
    log.info("agent_check_listening", host=agent.host, port=agent.port)
    return agent


async def _start_proxy(
    settings: config.Settings, parts: _Parts, stats: metrics.Metrics, ledger: rates.Ledger
) -> listener.Listener | None:
    if settings.proxy.host is None:
        return None
    restore_gate = parts.restore_gate
    client = listener.client(settings.upstream)
    handler = relay.Relay(
        client=client,
        restore_gate=restore_gate,
        stats=stats,
        upstream=settings.upstream,
        settings=settings.proxy,
        admin_token=settings.server.admin_token,
        rates=None if settings.upstream.router else ledger,
        pinner=parts.library,
        admit=parts.admit,
        on_leave=functools.partial(parts.quiet, relay.QUIET_SECONDS) if parts.quiet is not None else None,
    )
    try:
        sentry = (
            None  # router mode: each model's engine has its own gate
            if settings.upstream.router
            else sentinel.Sentinel(
                settings.upstream.url, restore_gate, connect_timeout=settings.upstream.connect_timeout
            )
        )
        proxy = await listener.start(handler, client, settings.proxy, stats, sentry=sentry)
    except OSError as exc:
        await client.close()
        raise errors.ConfigError(
            f"--proxy-listen {settings.proxy.host}:{settings.proxy.port}: cannot listen there ({exc.strerror or exc})"
        ) from exc
    except BaseException:
        await client.close()
        raise
    log.info(
        "proxy_listening",
        host=proxy.host,
        port=proxy.port,
        server=settings.upstream.url,
        hold_seconds=settings.proxy.hold_seconds,
    )
    return proxy


async def _shutdown(
    engines: report.Engines,
    settings: config.Settings,
    dir_watcher: watcher.Watcher,
    handle: server.Handle,
    launcher: supervisor.Supervisor | None = None,
) -> None:
    """The final snapshots within --final-timeout; then llama-server is stopped (launcher mode), then the rest."""
    try:
        async with asyncio.timeout(settings.snapshots.final_timeout):
            await engines.final_snapshots()
    except TimeoutError:
        log.error(
            "final_snapshot_timeout",
            seconds=settings.snapshots.final_timeout,
            hint="raise --final-timeout (and the container's stop grace period) for big models",
        )
    except Exception as exc:
        log.error("final_snapshot_failed", error=repr(exc))
    finally:
        if launcher is not None:
            await launcher.stop()
        with contextlib.suppress(Exception):
            await dir_watcher.stop()
        await handle.close()
        log.info("stopped")
