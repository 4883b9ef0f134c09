"""A slot of a recurrent, hybrid or sliding-window model brought back to its prompt's boundary before a save.

Such a state cannot be cut back (a restored window: see
``sidecar.snapshots.windowcell``), so a snapshot that ends after the reply is
useless to the conversation's next turn. The :class:`Rewinder` reads the
slot's token ids (a save to a temporary file), finds where the prompt ended
(:mod:`.boundary`, pure) and has the server rebuild the slot up to there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import structlog

from sidecar.core import errors, events
from sidecar.save import boundary
from sidecar.slots import actions
from sidecar.snapshots import slotfile, store

log = structlog.get_logger("sidecar.engine")
REPREFILL_SAID = 64
"""Prompt tokens a rewind may process before it is said that the server had no checkpoint to use."""


class Rewound(Protocol):
    def __call__(self, slot: int, before: events.SlotContent, after: events.SlotContent, /) -> None:
        """``slot``'s content went from ``before`` to ``after`` by the sidecar's own request: a rewind, not a turn."""


class Rewinder:
    def __init__(
        self,
        *,
        prompts: boundary.Prompts | None,
        slot_actions: actions.SlotActions,
        snapshots: store.SnapshotStore,
        rewound: Rewound | None = None,
    ) -> None:
        """``rewound``: told of each slot brought back, before its save (the library's book of what slots hold)."""
        self._rewound = rewound
        self._prompts = prompts
        """How the engine brings a slot back to its prompt's boundary (None: it saves slots as they are)."""
        self._marker: list[int] | None = None
        self._marker_read = False
        self._actions = slot_actions
        self._snapshots = snapshots

    async def to_boundary(self, view: events.SlotView) -> events.SlotView:
        """Bring ``view``'s slot back to its prompt's boundary (see :mod:`.boundary`); the slot as it is then.

        Holds the action lock. Anything that goes wrong leaves the slot as it was, saved as it is.
        """
        if self._prompts is None or view.signature is None:
            return view
        started = time.perf_counter()
        temp = self._snapshots.writer.temp_name(view.id)
        try:
            marker = await self._generation_marker()
            if not marker:
                return view
            await self._actions.save(view.id, temp)
            held = await asyncio.to_thread(slotfile.read_tokens, self._snapshots.staging / temp)
        except (errors.UpstreamError, slotfile.SlotFileError, OSError) as exc:
            log.warning(
                "boundary_not_found",
                slot=view.id,
                error=str(exc),
                effect="the slot is saved as it is, reply included: on this model the next turn of its "
                "conversation may not reuse that snapshot",
            )
            return view
        finally:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._snapshots.staged.remove, temp)
        ids = slotfile.unpack_ids(held.data)
        keep = boundary.target(boundary.prompt_end(ids, marker), len(ids))
        if keep is None:
            return view
        try:
            processed, reused = await self._prompts.complete_ids(view.id, ids[:keep])
            after = await self._actions.view(view.id)
        except errors.UpstreamError as exc:
            log.warning("boundary_rewind_failed", slot=view.id, error=str(exc), effect="the slot is saved as it is")
            return view
        if after is None or after.processing or after.tokens != keep:
            log.warning(
                "boundary_rewind_raced",
                slot=view.id,
                effect="a request ran on the slot meanwhile: it is saved as it holds it now",
            )
            return after if after is not None and not after.processing else view
        if self._rewound is not None and view.signature is not None and after.signature is not None:
            self._rewound(view.id, view.signature, after.signature)
        if processed > REPREFILL_SAID and reused == 0:  # the server had no checkpoint to cut back from
            log.warning(
                "boundary_rewind_reprefilled",
                slot=view.id,
                processed_tokens=processed,
                effect="llama-server had no context checkpoint near the prompt's end (or refused it) and "
                "processed the whole prompt again to save it at its boundary: a restore of it is still reused",
                hint="keep llama-server's context checkpoints on (--ctx-checkpoints/--swa-checkpoints > 0, the "
                "default 32)",
            )
        log.info(
            "slot_rewound_to_boundary",
            slot=view.id,
            held_tokens=len(ids),
            boundary_tokens=keep,
            processed_tokens=processed,
            reused_tokens=reused,
            seconds=round(time.perf_counter() - started, 4),
            effect="the snapshot ends where the next request of this conversation still agrees",
        )
        return after

    async def _generation_marker(self) -> list[int] | None:
        """The token ids of the chat template's generation prompt (read once; None: no chat template)."""
        if self._marker_read or self._prompts is None:
            return self._marker
        rendered = await self._prompts.apply_template({"messages": [{"role": "user", "content": boundary.SENTINEL}]})
        text = boundary.marker_text(rendered)
        self._marker = await self._prompts.tokenize(text, add_special=False) if text else None
        self._marker_read = True
        if not self._marker:
            log.warning(
                "boundary_marker_missing",
                effect="llama-server's chat template shows no generation prompt: slots of this recurrent or "
                "hybrid model are saved as they are, reply included",
            )
        return self._marker
