"""The headers the proxy passes on, each way. Pure.

Hop-by-hop headers (:data:`routes.HOP_BY_HOP`, and those a ``Connection``
header names) never pass. To llama-server, ``Host``, ``Content-Length``
(the body is sent whole, its length set anew) and ``Expect`` are dropped;
an admin's ``Authorization`` (the sidecar's token) is replaced by
llama-server's own key, if it has one. To the client, ``Content-Length``
is set anew by the response.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.proxy import routes

DROP_REQUEST = frozenset({"host", "content-length", "expect"})
DROP_RESPONSE = frozenset({"content-length"})
_SKIP_REQUEST = routes.HOP_BY_HOP | DROP_REQUEST
_SKIP_RESPONSE = routes.HOP_BY_HOP | DROP_RESPONSE


def to_server(headers: Iterable[tuple[str, str]], *, admin: bool, api_key: str | None) -> list[tuple[str, str]]:
    """A client's request headers as sent on to llama-server."""
    kept = _pass_on(headers, _SKIP_REQUEST, DROP_REQUEST)
    if admin:
        kept = [(k, v) for k, v in kept if k.lower() != "authorization"]
        if api_key:
            kept.append(("Authorization", f"Bearer {api_key}"))
    return kept


def to_client(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """llama-server's answer headers as sent on to the client."""
    return _pass_on(headers, _SKIP_RESPONSE, DROP_RESPONSE)


def _pass_on(headers: Iterable[tuple[str, str]], skip: frozenset[str], drop: frozenset[str]) -> list[tuple[str, str]]:
    """``routes.end_to_end`` with a fast path for the common case, no Connection header to read."""
    items = list(headers)
    kept = []
    for name, value in items:
        low = name.lower()
        if low == "connection":
            return routes.end_to_end(items, drop=drop)
        if low not in skip:
            kept.append((name, value))
    return kept
