"""Whether a request continues the conversation a slot ran last, from the request alone. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/turns.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from sidecar.library import convert, prompt

SAMPLING = frozenset(
    {
        "cache_prompt",
        "frequency_penalty",
        "id_slot",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "min_p",
        "n",
        "n_predict",
        "n_probs",
        "presence_penalty",
        "repeat_last_n",
        "repeat_penalty",
        "seed",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "timings_per_token",
        "top_k",
        "top_logprobs",
        "top_p",
        "typical_p",
        "user",
    }
)
"""Body fields that choose how the server samples or answers, not what prompt it renders."""
_DIGEST = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    head: bytes
    """Digest of what shapes the prompt besides its messages or text (the kind, tools, template options)."""
    marks: tuple[bytes, ...]
    """A chat's chained digest after each message; a text's digest, alone."""
    size: int = 0
    """A text prompt's length in bytes (0 for a chat)."""

    def continued_by(self, other: Key, text: bytes = b"") -> bool:
        """Whether ``other`` (of a request whose text prompt is ``text``) holds this key's prompt from its start."""
        if other.head != self.head or not self.marks:
            return False
        if not self.size:
            n = len(self.marks)
            return len(other.marks) >= n and other.marks[n - 1] == self.marks[-1]
        return len(text) >= self.size and _digest(text[: self.size]) == self.marks[0]

    def same_conversation(self, other: Key, text: bytes = b"") -> bool:
        """Whether ``other`` is this key's conversation, continued or with its later messages edited: it
        continues it, or (a chat) shares its first two messages, past a system prompt that other
        conversations share too. A client that rewrites a late message (an agent's reminders) stays the same
        conversation; another agent on the same system prompt does not."""
        if self.continued_by(other, text):
            return True
        if other.head != self.head or self.size or other.size:
            return False
        shared = 0
        for mine, theirs in zip(self.marks, other.marks, strict=False):
            if mine != theirs:
                break
            shared += 1
        return shared >= SAME_CONVERSATION_MESSAGES

    @property
    def length(self) -> int:
        """How much of a prompt the key holds (messages, or bytes): the longer of two keys a request continues wins."""
        return self.size or len(self.marks)


SAME_CONVERSATION_MESSAGES = 2
"""Leading messages two chats share to be one conversation (a system prompt and the first message)."""


def of(request: prompt.Prompt) -> Key | None:
    """The key of ``request``'s prompt; None for one given as token ids (no round trip to save there)."""
    if request.kind is prompt.Kind.CHAT:
        assert request.chat is not None
        messages = request.chat.get("messages")
        if not isinstance(messages, list):
            return None
        head = _head("chat", request.chat)
        marks = []
        mark = head
        for message in messages:
            mark = _digest(mark + _literal(message))
            marks.append(mark)
        return Key(head, tuple(marks))
    if request.kind is prompt.Kind.TEXT:
        data = request.text.encode()
        return Key(_head("text", request.body), (_digest(data),), len(data)) if data else None
    return None


def _head(kind: str, body: dict[str, Any]) -> bytes:
    shaping = {k: v for k, v in body.items() if k not in SAMPLING and k not in ("messages", "prompt")}
    return _digest(kind.encode() + b"\0" + _canonical(shaping))


def _canonical(value: Any) -> bytes:
    return convert.CANONICAL.encode(value).encode()


def _literal(message: Any) -> bytes:
    """A message as its Python literal (``repr``): two different messages never give one text, and it takes
    half the time of :func:`_canonical` (1.2-2.1 against 3.3-4.4 µs for a message of 400 characters, on a
    2-core AMD EPYC).

    Its keys keep the order they came in: a client that sent the same history with its keys in another
    order would continue no slot's conversation and be routed by its token ids (a miss, never a wrong
    slot). :mod:`.convert` builds the messages of an Anthropic or Responses body in one order.
    """
    return repr(message).encode()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()
