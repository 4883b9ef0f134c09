"""Bringing a slot back to its prompt's boundary before it is saved, on models that cannot cut a state back.

On recurrent and hybrid models a snapshot serves only requests it is a prefix of, so before a save
the slot is brought back, from llama-server's context checkpoint, to where its last prompt ended.

Invariants and trade-offs: docs/modules.md, `sidecar/save/boundary.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

MARGIN = 3
"""Tokens the boundary snapshot stops short of the prompt's end: the server checkpoints 4 before it,
and needs at least one token to process."""
SENTINEL = "\u2063sidecar-boundary\u2063"
"""A user message no chat template alters: what the template puts after it is its generation prompt."""


class Prompts(Protocol):
    """The calls to llama-server this needs (``observe.upstream.LlamaClient``)."""

    async def apply_template(self, body: dict[str, Any]) -> str: ...

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    async def complete_ids(self, slot: int, ids: list[int]) -> tuple[int, int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Rewind:
    """What bringing one slot back to its boundary did."""

    held: int
    """Tokens the slot held before."""
    boundary: int
    """Tokens it holds after."""
    processed: int
    """Prompt tokens the server processed to get there (1 when it used its checkpoint)."""
    reused: int
    """Prompt tokens it reused."""
    seconds: float


def marker_text(rendered: str) -> str | None:
    """The generation prompt in ``rendered`` (the template applied to one :data:`SENTINEL` user message)."""
    at = rendered.rfind(SENTINEL)
    if at < 0:
        return None
    tail = rendered[at + len(SENTINEL) :]
    return tail or None


def prompt_end(ids: Sequence[int], marker: Sequence[int]) -> int | None:
    """The index right after the last occurrence of ``marker`` in ``ids``; None if it does not occur.

    The marker's first token is not compared when it has more than two: tokenized on its own it can
    differ from what the end of the message before it made of it (``?<`` in one token, say).
    """
    if len(marker) > 2:
        marker = marker[1:]
    m = len(marker)
    if m == 0 or m > len(ids):
        return None
    first = marker[0]
    for start in range(len(ids) - m, -1, -1):
        if ids[start] == first and list(ids[start : start + m]) == list(marker):
            return start + m
    return None


def target(end: int | None, held: int) -> int | None:
    """How many tokens the slot should keep: :data:`MARGIN` before the prompt's ``end``; None: keep it as it is."""
    if end is None:
        return None
    keep = end - MARGIN
    if keep <= 0 or keep >= held:
        return None  # no prompt to speak of, or the slot holds no reply past the boundary already
    return keep
