"""Wiring and lifecycle of ``llama-kv-sidecar run``.

Starts the HTTP server, then the poller, the engine's action runner, the slot dir's watcher (and, in
launcher mode, llama-server) as tasks of one group; on a signal, takes the final snapshots under a
time budget and shuts down, exiting at once if something hangs past the deadline.

What each mode starts is wired apart: :mod:`~sidecar.app.plain` (one llama-server: its watch, the
library, the shared store), :mod:`~sidecar.app.routermode` (one engine per model),
:mod:`~sidecar.app.doors` (the proxy and the agent-check port), :mod:`~sidecar.app.launcher`
(llama-server's supervisor), :mod:`~sidecar.app.startup` (the snapshots loaded before any task) and
:mod:`~sidecar.app.signals` (the stop flag and the exit deadline).

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import prometheus_client
import structlog
from prometheus_client import CollectorRegistry

import sidecar
from sidecar.app import doors, figures, history, launcher, parts, plain, routermode, server, signals, startup, storelog
from sidecar.core import config, errors, logfold, memtune, metrics, protocols
from sidecar.engine import report
from sidecar.launch import argv, supervisor
from sidecar.observe import upstream
from sidecar.snapshots import dirlock, store, watcher

log = structlog.get_logger("sidecar.app")


class Terminate(Exception):
    """Raised inside the task group to stop it on a signal."""


async def _stopper(stop: asyncio.Event, closing: Callable[[], Awaitable[None]]) -> None:
    """On the stop flag, close the doors while the watch still runs, then stop the group.

    A request the proxy took before the signal is placed, its slot's content saved first, by an engine that
    still runs: cancelled first, the engine left it unplaced, to run cold over a turn no snapshot held yet.
    """
    await stop.wait()
    await closing()
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
    problem = snapshots.disk.check_writable()
    if problem:
        raise errors.ConfigError(problem + ": create it, or fix --slot-dir / LLAMA_SIDECAR_SLOT_DIR")
    lock = dirlock.DirLock(settings.snapshots.slot_dir)
    lock.acquire()
    store_lock = startup.store_lock(settings.snapshots.store_dir, lock)
    supervised = launcher.supervise(launch, stats)
    try:
        if settings.upstream.router is None:
            settings = await routermode.found_mode(settings)
        while True:
            try:
                await _run(settings, snapshots, stats, registry, lock, ready, folding, supervised)
            except* errors.RouterDetected as found:
                settings = routermode.as_router(settings, str(found.exceptions[0]))
            except* errors.ServerNotStarted as failed:
                raise failed.exceptions[0] from None  # the sidecar ends with it: its status, its words
            else:
                return
    finally:
        lock.release()
        if store_lock is not None:
            store_lock.release()


async def _run(
    settings: config.Settings,
    snapshots: store.SnapshotStore,
    stats: metrics.Metrics,
    registry: CollectorRegistry,
    lock: dirlock.DirLock,
    ready: asyncio.Event | None,
    folding: logfold.Folding | None,
    supervised: supervisor.Supervisor | None,
) -> None:
    await startup.load(settings, snapshots, stats)
    stop = signals.stop_on_signals(settings, supervised)
    async with aiohttp.ClientSession(raise_for_status=False) as session:
        client = upstream.LlamaClient(session, settings.upstream)
        if settings.upstream.router:
            wired = routermode.wire(settings, client, snapshots, stats)
        else:
            starting = supervised.hurried if supervised else None
            wired = plain.wire(settings, client, snapshots, stats, starting=starting)
        dir_watcher = watcher.Watcher(snapshots, stats, lock)
        samples = history.History()
        app = server.make_app(
            engines=wired.engines,
            snapshots=snapshots,
            registry=registry,
            settings=settings.server,
            liveness=report.Liveness.of(settings),
            samples=samples,
            caps=(settings.snapshots.max_bytes, settings.snapshots.min_free_bytes),
            shared=wired.shared,
            launcher=supervised.status if supervised is not None else None,
            staging=(settings.snapshots.staging, settings.snapshots.staging_note),
        )
        handle = await server.start(app, settings.server)
        log.info("listening", host=handle.host, port=handle.port)
        try:
            agent = await doors.start_agent(settings.server, wired.engines)
        except BaseException:
            wired.close_unstarted()
            await handle.close()
            raise
        try:
            proxy = await doors.start_proxy(settings, wired, stats, client.rates)
        except BaseException:
            wired.close_unstarted()
            if agent is not None:
                await agent.close()
            await handle.close()
            raise
        dir_watcher.start()
        if ready is not None:
            ready.set()
        launching = launcher.tasks(supervised, wired.restore_gate)
        closing = doors.Closing(wired, agent, proxy)
        sampler = _sample(samples, registry, wired.engines)
        try:
            await _tasks(wired, dir_watcher, _stopper(stop, closing.close), sampler, folding, launching)
        except* Terminate:
            log.info("stopping", reason="signal")
        finally:
            await closing.close()
            await _shutdown(wired.engines, settings, dir_watcher, handle, supervised)
            if wired.shared is not None:
                await wired.shared.close()


async def _tasks(
    wired: parts.Parts,
    dir_watcher: watcher.Watcher,
    stopper: Coroutine[Any, Any, None],
    sampler: Coroutine[Any, Any, None],
    folding: logfold.Folding | None,
    launching: dict[str, Coroutine[Any, Any, None]],
) -> None:
    """Run every task until one fails or the ``stopper`` raises :class:`Terminate`."""
    async with asyncio.TaskGroup() as group:
        group.create_task(sampler, name="history")
        group.create_task(_trim(), name="memory-trim")
        for name, loop_ in (launching | wired.loops).items():
            group.create_task(loop_, name=name)
        group.create_task(dir_watcher.run(), name="watcher")
        group.create_task(stopper, name="stopper")
        if wired.shared is not None:
            group.create_task(wired.shared.run(), name="uploader")
        if folding is not None:
            group.create_task(folding.run(), name="log-fold")


async def _sample(samples: history.History, registry: CollectorRegistry, engines: report.Engines) -> None:
    """The ``history`` task: a sample of the page's figures every ``history.SAMPLE_SECONDS``, in memory only."""
    while True:
        samples.add(figures.sample(registry, engines.status(), at=time.time()))
        await asyncio.sleep(history.SAMPLE_SECONDS)


async def _trim() -> None:
    """The ``memory-trim`` task: free heap pages given back every ``memtune.TRIM_SECONDS`` (see memtune)."""
    while True:
        if not await asyncio.to_thread(memtune.trim):
            return  # not glibc: nothing to trim
        await asyncio.sleep(memtune.TRIM_SECONDS)


async def _shutdown(
    engines: report.Engines,
    settings: config.Settings,
    dir_watcher: watcher.Watcher,
    handle: server.Handle,
    supervised: supervisor.Supervisor | None = None,
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
        if supervised is not None:
            await supervised.stop()
        with contextlib.suppress(Exception):
            await dir_watcher.stop()
        await handle.close()
        log.info("stopped")
