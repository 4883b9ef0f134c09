"""What start-up does with the snapshots before any task runs: the store dir's lock, and the load of the slot
dir (or the block store), converting and cleaning what earlier runs left, with the log of where they live.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from sidecar.app import storelog
from sidecar.core import config, metrics, mounts
from sidecar.snapshots import dirlock, slotdir, store, upgrade

log = structlog.get_logger("sidecar.app")


def store_lock(store_dir: Path | None, slot_lock: dirlock.DirLock) -> dirlock.DirLock | None:
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


async def load(settings: config.Settings, snapshots: store.SnapshotStore, stats: metrics.Metrics) -> None:
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
