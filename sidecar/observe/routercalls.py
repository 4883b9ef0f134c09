"""llama-server's router mode, as the sidecar asks it: the models it lists with their states, and a model loaded.

The calls go through the :class:`~sidecar.observe.upstream.LlamaClient` they belong to (its session,
its timeouts, its checks of every reply).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp

from sidecar.core import errors, events
from sidecar.observe import replies


class Json(Protocol):
    """A call of the client: its reply's parsed JSON."""

    def __call__(
        self, method: str, path: str, timeout: aiohttp.ClientTimeout, payload: Any = None
    ) -> Awaitable[Any]: ...


Request = Callable[[str, str, aiohttp.ClientTimeout, Any], Awaitable[tuple[int, Mapping[str, str], str]]]
"""A call of the client with a JSON payload: its reply's status, headers and text."""


class RouterCalls:
    """The calls only a router-mode server answers."""

    def __init__(
        self, json: Json, request: Request, *, timeout: aiohttp.ClientTimeout, action_timeout: aiohttp.ClientTimeout
    ) -> None:
        self._json = json
        self._request = request
        self._timeout = timeout
        self._action_timeout = action_timeout

    async def models(self) -> dict[str, events.ModelStatus]:
        """The router's models and their states (``GET /models``), by name."""
        body = replies.as_dict(await self._json("GET", "/models", self._timeout), "/models")
        data = body.get("data")
        if not isinstance(data, list):
            raise errors.UpstreamProtocolError("/models: field 'data' is not a list", endpoint="/models")
        found: dict[str, events.ModelStatus] = {}
        for item in data:
            entry = replies.as_dict(item, "/models")
            status = replies.field(entry, "status", dict, "/models")
            found[replies.field(entry, "id", str, "/models")] = events.ModelStatus.parse(str(status.get("value", "")))
        return found

    async def load_model(self, model: str) -> None:
        """Have the router load ``model`` (``POST /models/load``); 400 if it runs already."""
        await self._request("POST", "/models/load", self._action_timeout, {"model": model})
