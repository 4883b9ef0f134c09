"""What a completion route's answer looks like, for the relay. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/sse.py`.
"""

from __future__ import annotations

import enum
import json
import re

from sidecar.proxy import routes


class Api(enum.StrEnum):
    OPENAI = "openai"
    """Chat Completions, ``/completion(s)``, ``/infill`` and every other route: OpenAI-style errors."""
    ANTHROPIC = "anthropic"
    RESPONSES = "responses"


def api_of(raw_path: str) -> Api:
    """The API whose format the answer to ``POST raw_path`` has."""
    segments = routes.decoded_path(raw_path).lower().split("/")
    if "messages" in segments:
        return Api.ANTHROPIC  # /v1/messages, also under an --api-prefix
    if "responses" in segments:
        return Api.RESPONSES
    return Api.OPENAI


def is_event_stream(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "text/event-stream"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type for an HTTP status (its API's table); any other status is an ``api_error``."""


def error_event(api: Api, message: str, *, status: int = 502, kind: str = "server_error") -> bytes:
    """The SSE event that ends a stream in ``api``'s own format: llama-server cut it, or the answer that
    would have come with ``status`` (of OpenAI-style type ``kind``) after the stream's headers were sent."""
    error = {"code": status, "message": message, "type": kind}
    if api is Api.ANTHROPIC:
        data = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
        return b"event: error\ndata: " + _dumps(data) + b"\n\n"
    if api is Api.RESPONSES:
        event: dict[str, object] = {"type": "error", "code": kind, "message": message, "param": None}
        event["error"] = error
        return b"event: error\ndata: " + _dumps(event) + b"\n\n"
    return b"data: " + _dumps({"error": error}) + b"\n\n"


def answer_as_event(api: Api, status: int, reason: str, body: bytes) -> bytes:
    """A whole (error) answer of ``status`` as the error event of ``api``'s stream: its message and type
    as the answer gives them (an OpenAI-style or Anthropic error object), else its text."""
    message, kind = "", ""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            message = str(error.get("message") or "")
            kind = str(error.get("type") or "")
    if not message:
        message = body.decode("utf-8", "replace").strip() or f"{status} {reason}"
    return error_event(api, message, status=status, kind=kind or ("server_error" if status >= 500 else "error"))


def keep_alive(api: Api) -> bytes:
    """What keeps ``api``'s stream alive before its first event: Anthropic's own ``ping`` event (its SDKs
    skip it anywhere in a stream), an SSE comment for the others (every SSE parser skips it)."""
    if api is Api.ANTHROPIC:
        return b'event: ping\ndata: {"type":"ping"}\n\n'
    return b": keep-alive\n\n"


def comment(name: str, value: str) -> bytes:
    """An SSE comment line ``: name: value``, which every SSE parser skips (``value`` on one line)."""
    return b": " + f"{name}: {value}".replace("\r", " ").replace("\n", " ").encode() + b"\n\n"


_STREAM_KEY = re.compile(rb'"stream"\s*:\s*true')


def asks_stream(body: bytes) -> bool:
    """Whether a JSON request body asks for a streamed answer (``"stream": true`` at its top level)."""
    if _STREAM_KEY.search(body) is None:
        return False  # the common non-streamed body is not parsed: the pattern is in every streamed one
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


def _dumps(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


_KEYS = (b'"cache_n"', b'"cached_tokens"', b'"cache_read_input_tokens"')
"""The keys of a reuse figure as llama-server writes them; one whose quote is escaped is inside generated text."""
_FIGURE = re.compile(rb"\s*:\s*(\d+)")
_BACKSLASH = ord("\\")


def cached_tokens(data: bytes) -> int | None:
    """The last prompt-reuse figure in ``data`` (an answer, or a chunk of a stream); None if it has none.

    Searched from the end, one key at a time (``bytes.rfind``): llama-server writes the figures last, and a
    non-streamed answer can hold a whole prompt before them. The regular expression this replaces (the
    tests' oracle) took 0.6 ms over a 30 KB answer, before its first byte was relayed; this takes 0.013 ms.
    """
    found: tuple[int, int] | None = None  # (where, figure) of the last figure
    for key in _KEYS:
        end = len(data)
        while (at := data.rfind(key, 0, end)) >= 0:
            end = at
            if found is not None and at < found[0]:
                break  # a later figure of another key is already found
            if at and data[at - 1] == _BACKSLASH:
                continue  # an escaped quote: the key is inside a string (generated text)
            figure = _FIGURE.match(data, at + len(key))
            if figure is not None:
                found = at, int(figure[1])
                break
    return found[1] if found is not None else None


def only_comments(chunk: bytes) -> bool:
    """Whether ``chunk`` holds nothing but SSE comments (llama-server's ``:`` pings) and blank lines."""
    return all(not line or line.startswith(b":") for line in chunk.splitlines())
