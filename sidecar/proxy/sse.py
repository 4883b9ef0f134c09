"""What a completion route's answer looks like, for the relay. Pure code.

Each completion route answers in its API's format: an error event that ends
a cut stream must be one its clients parse (llama-server's own stream errors
are the model, ``server-context.cpp``), and the prompt tokens the server
reused are read from the answer itself, whatever the API:

* OpenAI Chat Completions, ``/completion(s)``, ``/infill``: ``timings.cache_n``
  (and ``usage.prompt_tokens_details.cached_tokens``); a stream error is
  ``data: {"error": {...}}``;
* Anthropic Messages: ``usage.cache_read_input_tokens`` (in ``message_start``
  when streamed); a stream error is ``event: error`` with
  ``{"type": "error", "error": {"type": "api_error", ...}}``;
* OpenAI Responses: ``usage.input_tokens_details.cached_tokens`` (in
  ``response.completed`` when streamed); a stream error is ``event: error``
  with ``{"type": "error", "code", "message", ...}``, plus the ``error``
  object the OpenAI SDKs raise on.

All three carry llama-server's ``n_prompt_tokens_cache`` for the task, so the
last figure found in an answer is that request's own reuse.
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


def error_event(api: Api, message: str) -> bytes:
    """The SSE event that ends a stream llama-server cut, in ``api``'s own format."""
    error = {"code": 502, "message": message, "type": "server_error"}
    if api is Api.ANTHROPIC:
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + _dumps(data) + b"\n\n"
    if api is Api.RESPONSES:
        event: dict[str, object] = {"type": "error", "code": "server_error", "message": message, "param": None}
        event["error"] = error
        return b"event: error\ndata: " + _dumps(event) + b"\n\n"
    return b"data: " + _dumps({"error": error}) + b"\n\n"


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
