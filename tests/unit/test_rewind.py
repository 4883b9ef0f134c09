"""A slot brought back to its prompt's boundary before a save, and what happens when the server will not."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import structlog

from sidecar.core import errors, events, protocols
from sidecar.engine import saves
from sidecar.save import boundary, rewind

MARKER = [7, 8, 9]
PROMPT = [*range(100, 300), *MARKER]
HELD = [*PROMPT, *range(1000, 1010)]  # the prompt, then the reply as generated


class Server:
    """The calls the rewinder makes: a chat template, /tokenize, a /completion, a save and a /slots read."""

    def __init__(self, staging: Path, *, refuse: bool = False, reprefill: bool = False) -> None:
        self.staging = staging
        self.refuse, self.reprefill = refuse, reprefill
        self.held = list(HELD)
        self.sent: list[list[int]] = []

    async def apply_template(self, body: dict[str, Any]) -> str:
        return f"<bos>{boundary.SENTINEL}<assistant>"

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return list(MARKER)

    async def complete_ids(self, slot: int, ids: list[int]) -> tuple[int, int]:
        self.sent.append(ids)
        if self.refuse:
            raise errors.UpstreamError("HTTP 500: failed to restore context checkpoint", endpoint="/completion")
        self.held = list(ids)
        return (len(ids), 0) if self.reprefill else (1, len(ids) - 1)

    async def save(self, slot: int, filename: str) -> protocols.ActionResult:
        words = struct.pack("<iII", -1, 1, len(self.held)) + struct.pack(f"<{len(self.held)}I", *self.held)
        (self.staging / filename).write_bytes(struct.pack("<III", 0x67677371, 4, len(words) // 4) + words)
        return protocols.ActionResult(slot, filename, len(self.held), 0, 1.0)

    async def view(self, slot: int) -> events.SlotView | None:
        return events.SlotView(slot, 4096, False, 2, len(self.held))

    # the snapshot store's parts: its writer's temp names, its staging's removal
    @property
    def writer(self) -> Server:
        return self

    @property
    def staged(self) -> Server:
        return self

    def temp_name(self, slot: int) -> str:
        return f".tmp-{slot}.bin"

    def remove(self, name: str) -> None:
        (self.staging / name).unlink(missing_ok=True)


def _rewinder(server: Server) -> rewind.Rewinder:
    return rewind.Rewinder(prompts=server, slot_actions=server, snapshots=server)  # type: ignore[arg-type]


VIEW = events.SlotView(0, 4096, False, 1, len(HELD))


async def test_the_slot_is_brought_back_three_tokens_before_the_prompts_end(tmp_path: Path) -> None:
    server = Server(tmp_path)
    after = await _rewinder(server).to_boundary(VIEW)
    assert after.tokens == len(PROMPT) - boundary.MARGIN
    assert server.sent == [PROMPT[: len(PROMPT) - boundary.MARGIN]]
    assert not list(tmp_path.iterdir())  # the scratch save is gone


async def test_a_checkpoint_the_server_refuses_leaves_the_slot_saved_as_it_is(tmp_path: Path) -> None:
    server = Server(tmp_path, refuse=True)
    with structlog.testing.capture_logs() as logs:
        after = await _rewinder(server).to_boundary(VIEW)
    assert after == VIEW  # saved as it is, reply included: its restore is verified by the next request
    (said,) = [e for e in logs if e["event"] == "boundary_rewind_failed"]
    assert "effect" in said
    assert not list(tmp_path.iterdir())


async def test_a_rewind_without_a_checkpoint_is_said_with_what_to_do(tmp_path: Path) -> None:
    server = Server(tmp_path, reprefill=True)
    with structlog.testing.capture_logs() as logs:
        after = await _rewinder(server).to_boundary(VIEW)
    assert after.tokens == len(PROMPT) - boundary.MARGIN
    (said,) = [e for e in logs if e["event"] == "boundary_rewind_reprefilled"]
    assert "--ctx-checkpoints" in said["hint"]


@pytest.mark.parametrize("kind", [events.Memory.ATTENTION, events.Memory.SWA_FULL, events.Memory.UNKNOWN])
def test_only_models_that_cannot_cut_back_a_restore_are_rewound(kind: events.Memory) -> None:
    assert kind not in saves.REWOUND
    assert events.Memory.SWA in saves.REWOUND


async def test_the_rewind_is_told_with_the_slots_content_before_and_after_so_no_one_takes_it_for_a_turn(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path)
    told: list[tuple[int, events.SlotContent, events.SlotContent]] = []
    rewinder = rewind.Rewinder(
        prompts=server,
        slot_actions=server,  # type: ignore[arg-type]
        snapshots=server,  # type: ignore[arg-type]
        rewound=lambda slot, before, after: told.append((slot, before, after)),
    )
    after = await rewinder.to_boundary(VIEW)
    assert VIEW.signature is not None
    assert after.signature is not None
    assert told == [(0, VIEW.signature, after.signature)]
    refused = Server(tmp_path, refuse=True)
    await rewind.Rewinder(
        prompts=refused,
        slot_actions=refused,  # type: ignore[arg-type]
        snapshots=refused,  # type: ignore[arg-type]
        rewound=lambda slot, before, after: told.append((slot, before, after)),
    ).to_boundary(VIEW)
    assert len(told) == 1, "a slot left as it was is not said to be rewound"
