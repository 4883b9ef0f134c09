"""Hand-made views of llama-server's state, for tests of the pure decision code."""

from __future__ import annotations

from sidecar.core import events


def slot(
    slot_id: int = 0, *, task: int | None = None, tokens: int = 0, busy: bool = False, n_ctx: int = 4096
) -> events.SlotView:
    """One slot as a poll of /slots shows it (`task` None: no task has run on it)."""
    return events.SlotView(id=slot_id, n_ctx=n_ctx, processing=busy, task=task, tokens=tokens)
