"""Whether a streamed request's prompt is over llama-server's context size, asked of llama-server.

llama-server answers a prompt of ``n_ctx`` tokens or more with ``400 exceed_context_size_error``
(``server-context.cpp``), before any event. Agent CLIs compact their conversation on that answer.
The proxy's keep-alives (:mod:`keepalive`) would send ``200`` and SSE headers first, turning it into
an error event the client does not act on. So before the first keep-alive the proxy counts the
prompt's tokens with llama-server's own counting route for the API (the same template and
tokenizer as the completion, run on its HTTP thread: no task, no slot) and compares them with the
slot's context size (``/props``). A prompt over it gets no keep-alive: the client waits for
llama-server's own ``400``, relayed as it is. When the count cannot be had (an API with no
counting route, llama-server away), the keep-alives start as before.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from sidecar.proxy import upclient

COUNTING = {
    "/v1/chat/completions": "/v1/chat/completions/input_tokens",
    "/chat/completions": "/chat/completions/input_tokens",
    "/v1/responses": "/v1/responses/input_tokens",
    "/responses": "/responses/input_tokens",
    "/v1/messages": "/v1/messages/count_tokens",
}
"""Each chat API's route, and llama-server's route that counts its request's prompt tokens."""
PLAIN = frozenset({"/completion", "/completions", "/v1/completions"})
"""Routes whose ``prompt`` string is counted with ``/tokenize`` (special tokens added, as a completion does)."""
ASK_TIMEOUT = 2.0
"""Seconds the count may take before the keep-alives start without it."""
N_CTX_FRESH = 60.0
"""Seconds the context size read from ``/props`` is used before it is read again."""


class Overflow:
    """Counts a request's prompt tokens and compares them with the slot's context size, both asked of llama-server."""

    def __init__(self, client: upclient.Client, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._n_ctx: tuple[float, int] | None = None

    async def exceeds(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> bool:
        """True if llama-server would refuse this prompt as over its context size; False if not, or unknown."""
        sent = [(name, value) for name, value in headers if name.lower() in ("authorization", "x-api-key")]
        sent += [upclient.OWN_AGENT, ("Content-Type", "application/json")]
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                tokens = await self._count(path, body, sent)
                if tokens is None:
                    return False
                n_ctx = await self._context(sent)
        except (upclient.ForwardError, TimeoutError, ValueError, KeyError, TypeError):
            return False
        return n_ctx is not None and tokens >= n_ctx

    async def _count(self, path: str, body: bytes, sent: list[tuple[str, str]]) -> int | None:
        if path in COUNTING:
            found = await self._json("POST", COUNTING[path], sent, body)
            return int(found["input_tokens"]) if found is not None else None
        if path not in PLAIN:
            return None
        prompt = json.loads(body).get("prompt")
        if not isinstance(prompt, str):
            return None  # token ids, several prompts, media: counted by llama-server only
        asked = json.dumps({"content": prompt, "add_special": True, "parse_special": True}).encode()
        found = await self._json("POST", "/tokenize", sent, asked)
        return len(found["tokens"]) if found is not None else None

    async def _context(self, sent: list[tuple[str, str]]) -> int | None:
        if self._n_ctx is not None and self._clock() - self._n_ctx[0] < N_CTX_FRESH:
            return self._n_ctx[1]
        found = await self._json("GET", "/props", [h for h in sent if h[0] != "Content-Type"], b"")
        if found is None:
            return None
        n_ctx = int(found["default_generation_settings"]["n_ctx"])
        self._n_ctx = (self._clock(), n_ctx)
        return n_ctx

    async def _json(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> dict[str, Any] | None:
        up = await self._client.request(method, target, headers, body)
        try:
            text = await up.read()
        except BaseException:
            up.close()
            raise
        up.release()
        if up.status != 200:
            return None
        found = json.loads(text)
        return found if isinstance(found, dict) else None
