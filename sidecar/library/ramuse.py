"""The placer's use of llama-server's RAM prompt cache: what left a slot for it, and whether it served. I/O (logs).

What the cache holds is :mod:`.ramtier`; this keeps its gauge and says once how it turned out.
"""

from __future__ import annotations

import structlog

from sidecar.core import events, metrics
from sidecar.library import ramtier, slotstate
from sidecar.observe import memory
from sidecar.restore import savings
from sidecar.snapshots import slotfile, store

log = structlog.get_logger("sidecar.library")


class RamUse:
    def __init__(
        self, *, tier: ramtier.RamTier, snapshots: store.SnapshotStore, stats: metrics.Metrics, max_unsaved: float
    ) -> None:
        self.tier = tier
        self._snapshots = snapshots
        self._stats = stats
        self._max_unsaved = max_unsaved
        self._ram_said: set[ramtier.State] = set()

    def restarted(self) -> None:
        """llama-server restarted: its RAM cache is empty."""
        self.tier.restarted()
        self._stats.ram_conversations.set(0)

    def loaded(self, held: ramtier.Held) -> None:
        """``held`` went from the RAM cache into a slot."""
        self.tier.loaded(held)
        self._stats.ram_conversations.set(len(self.tier))

    def left(self, state: slotstate.SlotState, tokens: int) -> None:
        """What ``state``'s slot held went to llama-server's RAM prompt cache, ``tokens`` of KV."""
        if not state.chain or state.owner is None or self.tier.state is ramtier.State.OFF:
            return
        newest = next(iter(self._snapshots.snapshots()), None)
        per_token = newest.bytes / newest.tokens if newest is not None and newest.tokens else 0.0
        self.tier.left(state.owner, state.chain, max(1, round(tokens * per_token)), state.turn)
        self._stats.ram_conversations.set(len(self.tier))

    def leaves_unsaved(
        self,
        state: slotstate.SlotState,
        view: events.SlotView,
        counters: events.Counters | None,
        kind: events.Memory | None,
    ) -> bool:
        """Whether ``view``'s slot (``state``) may go to another conversation with no save first: llama-server
        copies what it holds into its RAM cache (shown to work on this server), the conversation has a snapshot
        already, and what a crash would lose of it (the tokens past its newest snapshot) re-prefills within
        ``--max-unsaved-seconds`` at the server's measured rate.

        Never on a model whose state cannot be cut back (``kind``: sliding-window without ``--swa-full``,
        hybrid, recurrent): the RAM copy of such a slot serves the next turn only up to its newest context
        checkpoint, which a short turn does not move, so the conversation would fall back a turn with no crash
        at all (the soak saw it)."""
        if not memory.cuts_back(kind):
            return False
        if self.tier.state is not ramtier.State.CONFIRMED or self._max_unsaved <= 0 or not state.chain:
            return False
        rate = savings.measured_rate(counters) if counters is not None else None
        if not rate:
            return False
        saved = max(
            (
                r.tokens
                for r in self._snapshots.library()
                if r.owner == state.owner
                and r.index is not None
                and slotfile.shared_blocks(r.index.chain, state.chain) == len(r.index.chain)
            ),
            default=0,
        )
        reprefill = max(view.tokens - saved, 0) / rate
        if not saved or reprefill > self._max_unsaved:  # one never saved is saved: a crash loses no whole one
            return False
        self._stats.left_unsaved.observe(reprefill)
        return True

    def judged(self, served: bool) -> None:
        """A request placed on what the RAM cache was said to hold: its answer shows whether it was there."""
        if served:
            self.tier.served()
        else:
            self.tier.missed()
            self._stats.ram_conversations.set(0)
        state = self.tier.state
        if state in self._ram_said or state is ramtier.State.TRYING:
            return
        self._ram_said.add(state)
        if state is ramtier.State.CONFIRMED:
            leaving = (
                f"one leaves its slot unsaved while a crash would lose at most {self._max_unsaved:g} s of "
                "re-prefill of it (--max-unsaved-seconds)"
                if self._max_unsaved > 0
                else "each is still saved before it leaves its slot (--max-unsaved-seconds 0)"
            )
            log.info(
                "server_ram_cache_serves",
                effect="conversations that left their slot come back from llama-server's RAM prompt cache, "
                f"nothing restored; {leaving}",
            )
        else:
            log.warning(
                "server_ram_cache_missed",
                effect="a conversation the library counted on llama-server's RAM prompt cache to hold was "
                "re-prefilled: conversations are swapped in from disk until the server restarts",
                hint="llama-server runs with --cache-ram 0, or one smaller than --server-cache-ram-bytes: set "
                "--server-cache-ram-bytes to its --cache-ram in bytes (0 for none)",
            )
