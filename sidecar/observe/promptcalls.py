"""llama-server's prompt calls, as the library's tokenizer and the rewinder ask them: a chat's template,
the token ids of a text and the bytes each stands for, and ids run on a slot.

The calls go through the :class:`~sidecar.observe.upstream.LlamaClient` they belong to (its session,
its timeouts, its checks of every reply).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import aiohttp

from sidecar.core import errors
from sidecar.observe import replies
from sidecar.observe.routercalls import Json


class PromptCalls:
    """``/apply-template``, ``/tokenize`` and one-token ``/completion`` calls of one client."""

    def __init__(
        self,
        json: Json,
        *,
        timeout: aiohttp.ClientTimeout,
        action_timeout: aiohttp.ClientTimeout,
        model: str | None,
    ) -> None:
        """``model``: the router-mode model the client is bound to (named in a completion's body)."""
        self._json = json
        self._timeout = timeout
        self._action_timeout = action_timeout
        self._model = model
        self._query = "" if model is None else urllib.parse.urlencode({"model": model, "autoload": "false"})

    def _at(self, path: str) -> str:
        """``path`` with the model and ``autoload=false`` in its query, for a model view."""
        return path + ("&" if "?" in path else "?") + self._query if self._query else path

    def _bound(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A POST body with the model it is for, for a model view (a router routes a POST by its body's
        ``model``, and refuses one without it)."""
        return payload if self._model is None else {**payload, "model": self._model}

    async def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt text a chat request becomes (``/apply-template`` takes the chat request's own body)."""
        answer = await self._json("POST", self._at("/apply-template"), self._timeout, self._bound(body))
        answer = replies.as_dict(answer, "/apply-template")
        return replies.field(answer, "prompt", str, "/apply-template")

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The token ids a completion of ``text`` starts from (with BOS and special tokens, as completions do)."""
        body = self._bound({"content": text, "add_special": add_special, "parse_special": True})
        answer = replies.as_dict(await self._json("POST", self._at("/tokenize"), self._timeout, body), "/tokenize")
        ids = replies.field(answer, "tokens", list, "/tokenize")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise errors.UpstreamProtocolError(
                "/tokenize answered something other than token ids", endpoint="/tokenize"
            )
        return ids

    async def complete_ids(self, slot: int, ids: list[int]) -> tuple[int, int]:
        """Run ``ids`` on ``slot`` and sample one token; returns the server's (processed, reused) prompt tokens.

        The slot's state then ends at exactly ``ids`` (the sampled token is never evaluated).
        """
        payload = self._bound({"prompt": ids, "n_predict": 1, "id_slot": slot, "cache_prompt": True})
        answer = await self._json("POST", self._at("/completion"), self._action_timeout, payload)
        body = replies.as_dict(answer, "/completion")
        timings = body.get("timings")
        if not isinstance(timings, dict):
            raise errors.UpstreamProtocolError("/completion answered without timings", endpoint="/completion")
        processed, reused = timings.get("prompt_n"), timings.get("cache_n")
        return (processed if isinstance(processed, int) else 0, reused if isinstance(reused, int) else 0)

    async def pieces(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[tuple[int, bytes]]:
        """The token ids of ``text`` and the bytes each stands for (``/tokenize`` with ``with_pieces``)."""
        body = {"content": text, "add_special": add_special, "parse_special": parse_special, "with_pieces": True}
        answer = replies.as_dict(await self._json("POST", "/tokenize", self._timeout, body), "/tokenize")
        out: list[tuple[int, bytes]] = []
        for entry in replies.field(answer, "tokens", list, "/tokenize"):
            token = entry.get("id") if isinstance(entry, dict) else None
            piece = entry.get("piece") if isinstance(entry, dict) else None
            if not isinstance(token, int) or isinstance(token, bool):
                raise errors.UpstreamProtocolError("/tokenize answered a piece without an id", endpoint="/tokenize")
            if isinstance(piece, str):
                out.append((token, piece.encode()))
            elif isinstance(piece, list) and all(isinstance(b, int) and 0 <= b < 256 for b in piece):
                out.append((token, bytes(piece)))
            else:
                raise errors.UpstreamProtocolError("/tokenize answered a piece that is no text", endpoint="/tokenize")
        return out
