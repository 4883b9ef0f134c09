"""An in-memory llama-server behind the ``protocols.Upstream`` seam, and a hand-driven clock.

For unit tests of the engine, poller, snapshotter and restorer: the slots,
counters and health are plain attributes the test sets; saves really write
a file into the slot dir (the server's ``--slot-save-path``) and restores
really read one, so the real ``store.SnapshotStore`` commits and checks
them. Every call is recorded in ``calls`` in order, and ``hooks`` let a
test act in the middle of a call (a request that takes a slot while a
restore is in flight, a save the server holds).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

from sidecar.core import errors, events, protocols

IDENTITY = events.Identity(build_info="b11434-515e85511", model_path="/models/gemma3.gguf", total_slots=2, n_ctx=8192)
N_CTX = 4096
BYTES_PER_TOKEN = 10
HEADER = 44


def slot(slot_id: int, *, task: int | None = None, tokens: int = 0, busy: bool = False) -> events.SlotView:
    return events.SlotView(id=slot_id, n_ctx=N_CTX, processing=busy, task=task, tokens=tokens)


Hook = Callable[[int, str], Awaitable[None]]


class MemLlama:
    url = "http://mem-llama"

    def __init__(self, slot_dir: Path, n_slots: int = 2) -> None:
        self.dir = slot_dir
        self.health_state = events.Health.OK
        self.slot_views = [slot(i) for i in range(n_slots)]
        self.identity = dataclasses.replace(IDENTITY, total_slots=n_slots)
        self.sleeping = False
        self.router = False
        """Answer /props as a router-mode llama-server does (``"role": "router"``)."""
        self.start_time: float | None = 1_764_000_000.0
        self.prompt_tokens = 0.0
        self.cached_tokens = 0.0
        self.prompt_seconds = 0.0
        self.decodes = 0.0
        self.save_ms = 1.0
        """``timings.save_ms`` of each save."""
        self.metrics_text_digits: int | None = None
        """Print counters with this many significant digits, as llama-server does (6)."""
        self.calls: list[tuple[str, object]] = []
        self.hooks: dict[str, Hook] = {}
        """'save' / 'restore' → awaited inside the call, before the server acts."""
        self.fail: dict[str, errors.UpstreamError] = {}
        """'save' / 'restore' / 'slots' → raised by that call."""

    # ---- test helpers ------------------------------------------------------------------

    def set_slot(self, slot_id: int, **changes: object) -> None:
        self.slot_views[slot_id] = dataclasses.replace(self.slot_views[slot_id], **changes)  # type: ignore[arg-type]

    def run_turn(self, slot_id: int, *, task: int, tokens: int, cached: int = 0) -> None:
        """A whole request on ``slot_id``, start to end, between two polls."""
        self.set_slot(slot_id, task=task, tokens=tokens, processing=False)
        self.prompt_tokens += tokens - cached
        self.cached_tokens += cached
        self.decodes += 1

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # ---- protocols.Upstream ------------------------------------------------------------

    async def health(self) -> tuple[events.Health, str]:
        self.calls.append(("health", None))
        return self.health_state, "" if self.health_state is events.Health.OK else "not ok"

    async def slots(self) -> tuple[events.SlotView, ...]:
        self.calls.append(("slots", None))
        if "slots" in self.fail:
            raise self.fail["slots"]
        return tuple(self.slot_views)

    async def props(self) -> tuple[events.Identity, bool]:
        self.calls.append(("props", None))
        if self.router:
            raise errors.UpstreamIsRouter("llama-server runs in router mode", endpoint="/props")
        return self.identity, self.sleeping

    async def model_meta(self) -> tuple[int | None, int | None]:
        return None, None

    async def adapters(self) -> tuple[events.Adapter, ...] | None:
        self.calls.append(("adapters", None))
        return ()

    async def counters(self) -> events.Counters:
        self.calls.append(("counters", None))
        values: tuple[float, ...] = (self.decodes, self.prompt_tokens, self.cached_tokens)
        if self.metrics_text_digits is not None:
            values = tuple(float(f"{v:.{self.metrics_text_digits}g}") for v in values)
        return events.Counters(
            start_time=self.start_time,
            prompt_tokens=values[1],
            cached_tokens=values[2],
            activity=values,
            processing=float(sum(v.processing for v in self.slot_views)),
            prompt_seconds=self.prompt_seconds,
        )

    async def save(self, slot_id: int, filename: str) -> protocols.ActionResult:
        self.calls.append(("save", (slot_id, filename)))
        if "save" in self.hooks:
            await self.hooks["save"](slot_id, filename)
        if "save" in self.fail:
            raise self.fail["save"]
        view = self.slot_views[slot_id]
        data = bytes([slot_id]) * HEADER + (view.task or 0).to_bytes(8, "little") * (view.tokens * BYTES_PER_TOKEN // 8)
        (self.dir / filename).write_bytes(data)
        return protocols.ActionResult(slot_id, filename, view.tokens, len(data), self.save_ms)

    async def erase(self, slot_id: int) -> int:
        self.calls.append(("erase", slot_id))
        if "erase" in self.fail:
            raise self.fail["erase"]
        tokens = self.slot_views[slot_id].tokens
        self.set_slot(slot_id, tokens=0)
        return tokens

    async def restore(self, slot_id: int, filename: str) -> protocols.ActionResult:
        self.calls.append(("restore", (slot_id, filename)))
        if "restore" in self.hooks:
            await self.hooks["restore"](slot_id, filename)
        if "restore" in self.fail:
            raise self.fail["restore"]
        data = (self.dir / filename).read_bytes()
        tokens = (len(data) - HEADER) // BYTES_PER_TOKEN
        self.set_slot(slot_id, tokens=tokens)
        return protocols.ActionResult(slot_id, filename, tokens, len(data), 1.0)


async def forever(slot_id: int, filename: str) -> None:
    """A hook for a call the server holds (a slot action deferred behind a long generation)."""
    del slot_id, filename
    await asyncio.Event().wait()
