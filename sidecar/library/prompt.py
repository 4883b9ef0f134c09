"""What a completion request's prompt is, for the library's routing. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/prompt.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from typing import Any

from sidecar.core import outcomes
from sidecar.library import convert
from sidecar.proxy import routes

Unrouted = outcomes.Unrouted


class Kind(enum.StrEnum):
    CHAT = "chat"
    """Messages: the server's chat template makes the prompt text."""
    TEXT = "text"
    """A prompt string."""
    IDS = "ids"
    """A prompt given as token ids."""


class Pin(enum.StrEnum):
    BODY = "body"
    """``id_slot`` in the JSON body reaches the task."""
    PLACED = "placed"
    """The route drops ``id_slot`` (Anthropic Messages): the KV is put in an idle slot the server then picks."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    kind: Kind
    body: dict[str, Any]
    """The request body, parsed (forwarded as it came, plus the pin)."""
    text: str = ""
    ids: tuple[int, ...] = ()
    chat: dict[str, Any] | None = None
    """With ``Kind.CHAT``: the Chat Completions body the server renders with its template."""
    pin: Pin = Pin.BODY
    raw: bytes = b""
    """The request body as it came (``body`` parsed from it), for :func:`pinned` to add the pin to."""


_CHAT = ("/chat/completions",)
_TEXT = ("/completion", "/completions")
_ANTHROPIC = ("/messages",)
_RESPONSES = ("/responses",)
_NOT_ROUTED = {
    "/infill": Unrouted.INFILL,
    "/embedding": Unrouted.EMBEDDING,
    "/embeddings": Unrouted.EMBEDDING,
    "/rerank": Unrouted.EMBEDDING,
    "/reranking": Unrouted.EMBEDDING,
    "/transcriptions": Unrouted.AUDIO,
}


class _Api(enum.Enum):
    CHAT = enum.auto()
    ANTHROPIC = enum.auto()
    RESPONSES = enum.auto()
    TEXT = enum.auto()
    OTHER = enum.auto()


@functools.lru_cache(maxsize=256)
def _api(raw_path: str) -> _Api | Unrouted:
    """The API of a request target, or why its route is never routed: decided once per target (clients send
    the same few over and over)."""
    path = routes.decoded_path(raw_path).rstrip("/").lower()
    for ending, reason in _NOT_ROUTED.items():
        if path.endswith(ending):
            return reason
    for endings, api in ((_CHAT, _Api.CHAT), (_ANTHROPIC, _Api.ANTHROPIC), (_RESPONSES, _Api.RESPONSES)):
        if path.endswith(endings):
            return api
    return _Api.TEXT if path.endswith(_TEXT) else _Api.OTHER


def of(raw_path: str, body: bytes) -> Prompt | Unrouted:
    """How to get the token ids of the request ``POST raw_path`` with ``body``; else why it is not routed."""
    api = _api(raw_path)
    if isinstance(api, Unrouted):
        return api
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Unrouted.BODY
    if not isinstance(parsed, dict):
        return Unrouted.BODY
    if parsed.get("id_slot", -1) != -1:
        return Unrouted.OWN_SLOT
    try:
        if api is _Api.CHAT:
            found = _chat(parsed, parsed, Pin.BODY)
        elif api is _Api.ANTHROPIC:
            found = _chat(parsed, convert.anthropic(parsed), Pin.PLACED)
        elif api is _Api.RESPONSES:
            found = _chat(parsed, convert.responses(parsed), Pin.BODY)
        elif api is _Api.TEXT:
            found = _text(parsed)
        else:
            return Unrouted.BODY
    except convert.Refused:
        return Unrouted.BODY  # the server answers it with its own 400
    return dataclasses.replace(found, raw=body) if isinstance(found, Prompt) else found


def may_route(raw_path: str, body: bytes, tokens: int) -> bool:
    """Whether ``of`` may well give a :class:`Prompt` of ``tokens`` ids or more, from the bytes alone (no parse).

    A guess that costs no parse, for work worth starting before it: a route
    that is never routed, a body too short to hold ``tokens`` ids (each is at
    least one byte of it), or one that names its own slot says no.
    """
    return len(body) >= tokens and b'"id_slot"' not in body and not isinstance(_api(raw_path), Unrouted)


def _chat(body: dict[str, Any], chat: dict[str, Any], pin: Pin) -> Prompt | Unrouted:
    if not isinstance(chat.get("messages"), list):
        return Unrouted.BODY
    if convert.has_media(chat):
        return Unrouted.MEDIA
    return Prompt(Kind.CHAT, body, chat=chat, pin=pin)


def _text(body: dict[str, Any]) -> Prompt | Unrouted:
    if body.get("multimodal_data"):
        return Unrouted.MEDIA
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        return Prompt(Kind.TEXT, body, text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return Prompt(Kind.IDS, body, ids=tuple(prompt))
    return Unrouted.BODY  # several prompts, or mixed pieces: no single prefix to route


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


def pinned(prompt: Prompt, slot: int) -> bytes | None:
    """The request body with ``id_slot`` set to ``slot``; None where the route drops it (forward as it came).

    See :func:`_with` for how the field is written. Never raises: the placer has counted the slot as
    taken by then.
    """
    if prompt.pin is Pin.PLACED:
        return None
    return _with(prompt.raw, prompt.body, "id_slot", slot)


def uncached(raw_path: str, body: bytes) -> bytes:
    """The request body with ``cache_prompt`` off, so that llama-server reuses nothing a slot or its RAM cache
    holds for it; as it came where the route drops the field (Anthropic Messages) or the body is no JSON
    object (the server refuses it anyway)."""
    if _api(raw_path) is _Api.ANTHROPIC:
        return body
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(parsed, dict):
        return body
    return _with(body, parsed, "cache_prompt", False)


def _with(raw: bytes, body: dict[str, Any], name: str, value: int | bool) -> bytes:
    """``raw`` (the bytes ``body`` was parsed from) with the field ``name`` set to ``value``.

    The field is written into the body as it came, right after its opening
    brace, where the body has no field of that name of its own (a later key
    of the same name would win) and is UTF-8: the rest goes byte for byte,
    with no second encoding of a prompt of thousands of tokens. Else the
    parsed body is encoded anew with the field (its strings escaped if they
    hold a lone surrogate, which UTF-8 cannot carry).
    """
    if name not in body and raw and json.detect_encoding(raw) == "utf-8":
        brace = raw.find(b"{")  # the body parsed as an object: its first byte but JSON whitespace
        rest = raw[brace + 1 :].lstrip(b" \t\r\n")
        if brace >= 0 and not raw[:brace].strip(b" \t\r\n") and rest[:1] not in (b"}", b""):
            return b'%s{"%s":%s,%s' % (raw[:brace], name.encode(), json.dumps(value).encode(), raw[brace + 1 :])
    changed = {**body, name: value}
    try:
        return json.dumps(changed, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate json.loads let through: escaped, the field must not be lost
        return json.dumps(changed, separators=(",", ":")).encode()
