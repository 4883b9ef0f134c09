"""Secrets kept out of log lines: the last structlog processor before the renderer. Pure.

Invariants and trade-offs: docs/modules.md, `sidecar/core/redact.py`.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, MutableMapping
from typing import Any

REDACTED = "[redacted]"
SHORTEST = 4
"""Known secrets shorter than this are not searched for (they would blank out ordinary words); the header
net still catches them where a header is written out."""
_HEADER_RE = re.compile(
    r"""(?ix)
    \b((?:proxy-)?authorization|x-api-key)   # the header's name
    (['"]?\s*[:=]\s*['"]?)                   # ': ' in a header line, "': '" in a dict's repr
    (?!\s*(?:bearer\s+)?<)                   # a placeholder such as "Bearer <admin token>" in a hint is kept
    [^'"\r\n]+                               # the value, to the end of its quotes or its line
    """
)


def url(text: str) -> str:
    """``text`` with the password of its user info blanked, for what shows a URL (``/status``, ``/readyz``, the
    page): ``http://user:secret@host:8080`` -> ``http://user:[redacted]@host:8080``. A URL without one is kept."""
    parts = urllib.parse.urlsplit(text)
    if parts.password is None:
        return text
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{name}:{REDACTED}@{host}"))


class Redactor:
    """A structlog processor that blanks secrets out of every string of an event (see the module docstring)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        kept = {s for s in secrets if len(s) >= SHORTEST}
        self._secrets = sorted(kept, key=len, reverse=True)  # the longest first: one key may hold another

    def text(self, value: str) -> str:
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return _HEADER_RE.sub(lambda m: m[1] + m[2] + REDACTED, value)

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.value(v) for v in value)
        return value

    def __call__(self, _logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in event.items():
            if not key.startswith("_"):  # "_record" and "_from_structlog" are ProcessorFormatter's own
                event[key] = self.value(value)
        return event
