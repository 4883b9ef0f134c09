"""llama-server's replies read field by field: each value checked for its type, anything else an
``errors.UpstreamProtocolError`` naming the endpoint and the field. Pure.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from sidecar.core import errors, events

_T = TypeVar("_T")

MAX_COUNT = 2**53 - 1
"""Largest size or count (and absolute LoRA scale) taken from a reply: what every JSON reader reads exactly."""


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON number")  # llama-server writes null for a float it cannot represent


def count(value: Any) -> int | None:
    """A size or a count as the fingerprint keeps it; None (unknown) for anything but an integer a JSON reader
    reads exactly (a reply of 2**63 or 10**400 parameters is not a model, and would break the page)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def error_message(text: str) -> str:
    try:
        body = json.loads(text)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


def as_dict(body: Any, endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise errors.UpstreamProtocolError(f"{endpoint} did not return an object", endpoint=endpoint)
    return body


def field(body: dict[str, Any], key: str, kind: type[_T], endpoint: str) -> _T:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise errors.UpstreamProtocolError(
            f"{endpoint}: field {key!r} is missing or not {kind.__name__} (got {value!r:.80})",
            endpoint=endpoint,
        )
    return value


def slot_view(item: Any) -> events.SlotView:
    endpoint = "/slots"
    entry = as_dict(item, endpoint)
    task = entry.get("id_task")
    if task is not None and (not isinstance(task, int) or isinstance(task, bool)):
        raise errors.UpstreamProtocolError(f"/slots: id_task is {task!r:.40}", endpoint=endpoint)
    tokens = entry.get("n_prompt_tokens", 0) if task is not None else 0
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise errors.UpstreamProtocolError(f"/slots: n_prompt_tokens is {tokens!r:.40}", endpoint=endpoint)
    return events.SlotView(
        id=field(entry, "id", int, endpoint),
        n_ctx=field(entry, "n_ctx", int, endpoint),
        processing=field(entry, "is_processing", bool, endpoint),
        task=task,
        tokens=tokens,
    )
