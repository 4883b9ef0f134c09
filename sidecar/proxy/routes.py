"""What a request through the proxy is, decided from its method and request target alone (pure).

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/routes.py`.
"""

from __future__ import annotations

import dataclasses
import enum

from sidecar.core import outcomes
from sidecar.proxy import pathcode


class Verdict(enum.StrEnum):
    FORWARD = "forward"
    SLOT_ACTION = "slot_action"
    """``POST /slots/...``: admin token only."""
    UNKNOWN = "unknown"
    """A write to a path llama-server has no route for (or a method it has none for): admin token only."""
    PREDICT = "predict"
    """Vertex AI's ``POST /predict``: forwarded once its body names only routes that are not slot actions."""
    BAD_PATH = "bad_path"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    route: outcomes.Route
    verdict: Verdict
    target: str = ""
    """What to send llama-server: the decoded path re-encoded, and the query as sent; empty for a bad path."""
    path: str = ""
    """The path as llama-server will route it (decoded)."""


STREAMING_ROUTES = frozenset(
    {
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/responses",
        "/v1/messages",
        "/infill",
    }
)
"""The completion routes that answer a body with ``"stream": true`` with a stream of events (SSE)."""

COMPLETION_ROUTES = STREAMING_ROUTES | frozenset(
    {
        "/v1/audio/transcriptions",
        "/audio/transcriptions",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
        "/v1/systemone",
    }
)
"""llama-server's POST routes that run a task in a slot (``tools/server/server.cpp``, build 11434)."""

OTHER_POST_ROUTES = frozenset(
    {
        "/props",
        "/v1/chat/completions/control",
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/chat/completions/input_tokens",
        "/v1/chat/completions/input_tokens",
        "/responses/input_tokens",
        "/v1/responses/input_tokens",
        "/v1/messages/count_tokens",
        "/lora-adapters",
        "/v1/streams/lookup",
        "/cors-proxy",
        "/tools",
        "/models",
        "/models/load",
        "/models/unload",
    }
)
"""llama-server's other POST routes (router mode's ``/models...`` included): none runs a slot task."""

DELETE_ROUTES = frozenset({"/v1/stream", "/models"})
PREDICT_ROUTE = "/predict"
"""Vertex AI's default ``AIP_PREDICT_ROUTE``; another name is a path the proxy does not know (admin only)."""
SLOT_ACTION_PREFIX = "/slots/"

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that cannot reach a slot action or run a task."""


def _bad() -> Request:
    return Request(outcomes.Route.OTHER, Verdict.BAD_PATH)


def classify(method: str, raw_target: str) -> Request:
    """Decide what the proxy does with ``method raw_target`` (the request target as sent, query included)."""
    target = raw_target.partition("#")[0]
    raw_path, mark, query = target.partition("?")
    if not raw_path.startswith("/") or not pathcode.is_request_target(target):
        return _bad()  # absolute-form, authority-form, '*', or bytes llama-server's parser refuses
    decoded = pathcode.decode(raw_path.encode("ascii"))
    if not pathcode.is_plain(decoded):
        return _bad()
    path = decoded.decode("ascii")
    canonical = pathcode.encode(decoded) + mark + query
    route, verdict = _route(method, path)
    return Request(route, verdict, canonical, path)


def _route(method: str, path: str) -> tuple[outcomes.Route, Verdict]:
    if method in READ_METHODS:
        return outcomes.Route.OTHER, Verdict.FORWARD
    if method == "POST":
        if path.startswith(SLOT_ACTION_PREFIX):
            return outcomes.Route.OTHER, Verdict.SLOT_ACTION
        if path in COMPLETION_ROUTES:
            return outcomes.Route.COMPLETION, Verdict.FORWARD
        if path == PREDICT_ROUTE:
            return outcomes.Route.COMPLETION, Verdict.PREDICT
        if path in OTHER_POST_ROUTES:
            return outcomes.Route.OTHER, Verdict.FORWARD
    if method == "DELETE" and path in DELETE_ROUTES:
        return outcomes.Route.OTHER, Verdict.FORWARD
    return outcomes.Route.OTHER, Verdict.UNKNOWN


def decoded_path(target: str) -> str:
    """The path of ``target`` as llama-server routes it ('' when the proxy would refuse the target)."""
    return classify("GET", target).path


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
