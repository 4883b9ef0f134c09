"""What a request through the proxy is, decided from its method and raw path alone (pure).

llama-server (cpp-httplib) percent-decodes the request path once and matches
routes exactly, with an optional ``--api-prefix`` in front. The proxy
classifies the same decoded path it forwards, so ``/slots%2F0`` or a prefix
cannot smuggle a slot action past the check. Paths with ``.``/``..``
segments, backslashes or NUL bytes are refused outright: nothing
llama-server serves needs them.

Completion routes are those that run a task in a slot (and so could take the
slot a restore is about to fill): completions, chat completions, the
Responses and Anthropic Messages APIs, infill, embeddings, reranking and
transcriptions. They wait at the restore gate; every other route
(``/health``, ``/props``, ``/tokenize``, ``/v1/models``, ``GET /slots``, the
web UI...) is forwarded at once.
"""

from __future__ import annotations

import dataclasses
import enum
from urllib.parse import unquote

from sidecar.core import outcomes


class Verdict(enum.StrEnum):
    FORWARD = "forward"
    SLOT_ACTION = "slot_action"
    BAD_PATH = "bad_path"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    route: outcomes.Route
    verdict: Verdict


COMPLETION_ENDINGS = (
    "/completion",
    "/completions",
    "/responses",
    "/messages",
    "/infill",
    "/embedding",
    "/embeddings",
    "/rerank",
    "/reranking",
    "/transcriptions",
)
"""Last path segments of llama-server's slot-task routes (``/v1/chat/completions`` ends in ``/completions``)."""

_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def decoded_path(raw_path: str) -> str:
    """The path as llama-server will see it: query and fragment cut off, percent-decoded once."""
    path = raw_path.partition("?")[0].partition("#")[0]
    return unquote(path, errors="surrogateescape")


def classify(method: str, raw_path: str) -> Request:
    """Decide what the proxy does with ``method raw_path`` (``raw_path`` as sent, query included)."""
    if not raw_path.startswith("/") or raw_path.startswith("//"):
        return Request(outcomes.Route.OTHER, Verdict.BAD_PATH)  # absolute-form or scheme-relative targets
    path = decoded_path(raw_path)
    segments = path.split("/")
    if "\\" in path or "\0" in path or any(s in (".", "..") for s in segments):
        return Request(outcomes.Route.OTHER, Verdict.BAD_PATH)
    folded = "/".join(s for s in segments if s).lower()
    folded = "/" + folded
    if method.upper() not in _READ_METHODS and ("/slots/" in folded + "/"):
        return Request(outcomes.Route.OTHER, Verdict.SLOT_ACTION)
    if method.upper() == "POST" and folded.endswith(COMPLETION_ENDINGS):
        return Request(outcomes.Route.COMPLETION, Verdict.FORWARD)
    return Request(outcomes.Route.OTHER, Verdict.FORWARD)


HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""RFC 9110 §7.6.1 connection-specific headers: never forwarded in either direction."""


def end_to_end(headers: list[tuple[str, str]], *, drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The headers to pass on: hop-by-hop ones, those the Connection header names, and ``drop`` removed."""
    named = {
        token.strip().lower() for name, value in headers if name.lower() == "connection" for token in value.split(",")
    }
    skip = HOP_BY_HOP | named | drop
    return [(name, value) for name, value in headers if name.lower() not in skip]
