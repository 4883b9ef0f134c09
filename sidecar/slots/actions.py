"""The one road by which slot actions (save, restore, erase) reach llama-server.

One action at a time, never sent to a slot that is processing, and a file left by an action that
timed out is removed as soon as it appears.

Invariants and trade-offs: docs/modules.md, `sidecar/slots/actions.py`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from sidecar.core import errors, events, protocols
from sidecar.snapshots import store

log = structlog.get_logger("sidecar.actions")
LEFTOVERS_KEPT = 64
"""Names of abandoned files remembered for removal; older names are forgotten (start-up cleans the rest)."""


class SlotActions:
    def __init__(self, *, client: protocols.Upstream, snapshots: store.SnapshotStore) -> None:
        self._client = client
        self._snapshots = snapshots
        self.lock = asyncio.Lock()
        """Held around each (read the slot, act) pair: never two actions in flight."""
        self._leftovers: dict[str, None] = {}

    async def slots(self) -> tuple[events.SlotView, ...]:
        """Every slot as the server sees it now; raises ``errors.UpstreamError``."""
        return await self._client.slots()

    async def view(self, slot: int) -> events.SlotView | None:
        """One slot as the server sees it now (None if it is not listed); raises ``errors.UpstreamError``."""
        return next((v for v in await self._client.slots() if v.id == slot), None)

    async def save(self, slot: int, filename: str) -> protocols.ActionResult:
        """Have the server write ``slot`` to ``filename`` in the slot dir; hold :attr:`lock`."""
        return await self._send(self._client.save, slot, filename, writes=True)

    async def restore(self, slot: int, filename: str) -> protocols.ActionResult:
        """Have the server read ``filename`` into ``slot``; hold :attr:`lock`."""
        return await self._send(self._client.restore, slot, filename, writes=False)

    async def erase(self, slot: int) -> int:
        """Have the server empty ``slot``; hold :attr:`lock`. Returns the tokens it held."""
        return await self._client.erase(slot)

    def sweep(self) -> list[str]:
        """Remove the files of abandoned saves that have appeared since; returns their names."""
        found = [name for name in self._leftovers if self._snapshots.staged.exists(name)]
        for name in found:
            self._snapshots.staged.remove(name)
            del self._leftovers[name]
            log.info("abandoned_file_removed", file=name, reason="the server wrote it after its save call gave up")
        return found

    async def _send(self, call: _Call, slot: int, filename: str, *, writes: bool) -> protocols.ActionResult:
        await asyncio.to_thread(self.sweep)
        try:
            return await call(slot, filename)
        except (errors.UpstreamError, asyncio.CancelledError):
            if writes:  # the server may still run the save later: remove the file now and when it shows up
                self._snapshots.staged.remove(filename)
                self._leftovers[filename] = None
                while len(self._leftovers) > LEFTOVERS_KEPT:
                    del self._leftovers[next(iter(self._leftovers))]
            raise


class _Call(Protocol):
    async def __call__(self, slot: int, filename: str, /) -> protocols.ActionResult: ...
