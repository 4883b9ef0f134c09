"""Bringing a slot back to its prompt's boundary before it is saved, on models that cannot cut a state back.

On a recurrent or hybrid model (``events.Memory.RECURRENT``/``HYBRID``) a
restored state serves a request only if every token of it is a prefix of
the request. A slot that has answered a turn holds the prompt plus the
reply as generated; the next chat turn re-renders that reply through the
chat template (other tokens, a reasoning template drops the thinking), so a
snapshot taken then is useless to it. The next turn still agrees with the
previous prompt, so that is where the snapshot must end.

llama-server keeps context checkpoints of such a slot in RAM, one of them 4
tokens before the end of each prompt. A completion on the slot of the
prompt's first ``P - MARGIN`` token ids with ``n_predict: 1`` makes the
server restore that checkpoint and process one token: the slot then holds
exactly ``P - MARGIN`` prompt tokens, and a save writes that state.

Where the prompt ends is found in the slot's own token ids (read from a
scratch save): right after the last occurrence of the chat template's
generation prompt (what the template adds after a user message, e.g.
``<|im_end|>\\n<|im_start|>assistant\\n``). A slot whose ids hold no such
marker (a raw ``/completion`` client) is saved as it is. The pure parts are
:func:`marker_text`, :func:`prompt_end` and :func:`target`.
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
