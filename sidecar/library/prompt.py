"""What a completion request's prompt is, for the library's routing. Pure code.

The proxy routes a request by the token ids its prompt becomes. This module
only reads the request: :func:`of` says how to get those ids from
llama-server (a chat request through ``/apply-template`` then ``/tokenize``,
a text prompt through ``/tokenize``, or ids given as they are), and
:func:`pinned` writes ``id_slot`` into the body. Requests the library does
not route (several prompts, infill, embeddings, the Anthropic and Responses
APIs, a body that is not a JSON object, a request that picks its own slot)
give None and are forwarded as they came.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from sidecar.proxy import routes


class Kind(enum.StrEnum):
    CHAT = "chat"
    """Messages: the server's chat template makes the prompt text."""
    TEXT = "text"
    """A prompt string."""
    IDS = "ids"
    """A prompt given as token ids."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    kind: Kind
    body: dict[str, Any]
    """The request body, parsed."""
    text: str = ""
    ids: tuple[int, ...] = ()


_CHAT_ENDINGS = ("/chat/completions",)
_TEXT_ENDINGS = ("/completion", "/completions")


def of(raw_path: str, body: bytes) -> Prompt | None:
    """How to get the token ids of the request ``POST raw_path`` with ``body``; None: not routed."""
    path = routes.decoded_path(raw_path).rstrip("/").lower()
    chat = path.endswith(_CHAT_ENDINGS)
    if not chat and not path.endswith(_TEXT_ENDINGS):
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict) or parsed.get("id_slot", -1) != -1:
        return None
    if chat:
        return Prompt(Kind.CHAT, parsed) if isinstance(parsed.get("messages"), list) else None
    prompt = parsed.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        return Prompt(Kind.TEXT, parsed, text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return Prompt(Kind.IDS, parsed, ids=tuple(prompt))
    return None


SPECIAL_TOKENS = 8
"""More tokens than a completion adds to a text prompt (BOS and the like)."""


def shorter_than(prompt: Prompt, tokens: int) -> bool:
    """Whether ``prompt`` surely becomes fewer than ``tokens`` ids, without asking the server.

    Every token of a text covers at least one byte of it, so a text of fewer
    bytes cannot fill the count; a chat's template adds text of its own, so
    only its server-side ids tell.
    """
    if prompt.kind is Kind.IDS:
        return len(prompt.ids) < tokens
    if prompt.kind is Kind.TEXT:
        return len(prompt.text.encode()) + SPECIAL_TOKENS < tokens
    return False


def pinned(prompt: Prompt, slot: int) -> bytes:
    """The request body with ``id_slot`` set to ``slot``."""
    return json.dumps({**prompt.body, "id_slot": slot}, ensure_ascii=False, separators=(",", ":")).encode()
