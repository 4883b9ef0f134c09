"""Vertex AI's ``POST /predict``: which routes a body would reach, checked before it is forwarded (pure).

With ``AIP_MODE=PREDICTION`` llama-server (``register_gcp_compat`` in
``tools/server/server-http.cpp``) runs each of up to 128 ``instances``
through the handler its ``@requestFormat`` names: a camelCase alias of a
registered path (``chatCompletions``, ``slots``) or the path itself
(``/slots/:id_slot``), with the query string of ``/predict`` as its
parameters. ``{"@requestFormat": "/slots/:id_slot"}`` with
``/predict?id_slot=1&action=save`` is a slot action. The proxy forwards a
body only when it reads it as llama-server will and every instance names a
route of :data:`ALLOWED`; anything else (a slot format, a name it does not
know, duplicate keys, JSON it cannot read) needs the admin token.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from sidecar.proxy import routes


class Check(enum.StrEnum):
    ALLOWED = "allowed"
    SLOT_ACTION = "slot_action"
    UNREADABLE = "unreadable"
    """Not a JSON object with an ``instances`` list of objects each naming a format as a string,
    or not read the same by the proxy and llama-server (duplicate keys, NaN)."""
    UNKNOWN = "unknown"


def gcp_format(path: str) -> str:
    """llama-server's ``path_to_gcp_format``: ``/v1/chat/completions`` -> ``chatCompletions``."""
    s = path[3:] if len(path) > 3 and path.startswith("/v1") else path
    s = s.removeprefix("/")
    out: list[str] = []
    cap = False
    for c in s:
        if c == ":":
            break
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


_PATHS = routes.COMPLETION_ROUTES | routes.OTHER_POST_ROUTES | {"/health", "/v1/health", "/metrics", "/v1/models"}
ALLOWED = frozenset(_PATHS | {gcp_format(p) for p in _PATHS}) - {"slots", "/slots", "/slots/:id_slot"}
"""Formats that reach no slot action: the routes the proxy forwards anyway, by path or alias."""
SLOT_FORMATS = frozenset({"slots", "/slots/:id_slot"})
"""``slots`` is the alias of both ``/slots`` and ``/slots/:id_slot``; which one wins is the server's hash order."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check(body: bytes) -> Check:
    try:
        data = json.loads(body, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return Check.UNREADABLE
    instances = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(instances, list):
        return Check.UNREADABLE
    verdict = Check.ALLOWED
    for instance in instances:
        fmt = instance.get("@requestFormat") if isinstance(instance, dict) else None
        if not isinstance(fmt, str):
            return Check.UNREADABLE
        if fmt in SLOT_FORMATS or fmt.startswith(routes.SLOT_ACTION_PREFIX):
            return Check.SLOT_ACTION
        if fmt not in ALLOWED:
            verdict = Check.UNKNOWN
    return verdict
