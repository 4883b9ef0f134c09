"""Proving that llama-server writes into the sidecar's slot dir.

The server's ``--slot-save-path`` and the sidecar's ``--slot-dir`` must be
one directory seen from both sides; nothing in the server's replies says
which directory it writes to. Once per server process the sidecar has the
server save an empty slot under a probe name (a 44-byte file, nothing
stalls) and looks for it. A committed save proves the link as well.
"""

from __future__ import annotations

import asyncio
import dataclasses

import structlog

from sidecar.core import errors
from sidecar.slots import actions
from sidecar.snapshots import store

log = structlog.get_logger("sidecar.probe")


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    ok: bool | None
    """True: the server writes into the slot dir; False: it does not; None: not known yet."""
    problem: str = ""
    """What is wrong and what to do, when ``ok`` is False."""


UNKNOWN = Link(None)
PROBE_SECONDS = 5.0
"""Longest the probe's save may take: a few ms on any server. A request that takes the slot just as the
probe is sent makes llama-server hold the save until that request ends, and the probe holds the one road
for slot actions meanwhile: past this it gives up, so that saves and restores go on."""


def not_supported(slot_dir: str) -> Link:
    return Link(
        False,
        "llama-server refuses slot saves (HTTP 501): start it with "
        f"--slot-save-path {slot_dir} (the sidecar's --slot-dir, same directory)",
    )


async def probe(slot_actions: actions.SlotActions, snapshots: store.SnapshotStore, slot: int) -> Link:
    """Have the server save ``slot`` (idle and never used) under a probe name; hold ``slot_actions.lock``."""
    name = snapshots.writer.probe_name()
    try:
        async with asyncio.timeout(PROBE_SECONDS):
            await slot_actions.save(slot, name)
    except TimeoutError:
        log.warning(
            "slot_dir_probe_failed",
            error=f"llama-server did not answer the probe's save of slot {slot} within {PROBE_SECONDS:g} s",
            reason="most likely a request took the slot as the probe was sent: llama-server holds the save of a "
            "busy slot until its request ends (else the server is too loaded to answer a few-ms save in time)",
            effect="the probe gave up so that saves and restores go on; the next save proves or disproves the "
            "link, and the probe's file is removed if llama-server writes it later",
        )
        return UNKNOWN
    except errors.UpstreamNotSupported:
        return not_supported(str(snapshots.staging))
    except errors.UpstreamError as exc:
        log.warning("slot_dir_probe_failed", error=str(exc), effect="the next save proves or disproves the link")
        return UNKNOWN
    seen = await asyncio.to_thread(snapshots.staged.exists, name)
    await asyncio.to_thread(snapshots.staged.remove, name)
    if seen:
        return Link(True)
    return Link(
        False,
        f"llama-server saved a probe file that did not appear in {snapshots.staging}: "
        "--slot-dir must be the directory llama-server was given as --slot-save-path "
        "(the same volume, seen from both)",
    )
