"""The only module that talks HTTP to llama-server.

``LlamaClient`` wraps one session and turns every reply, checked field by field, into typed values
or an ``errors.Upstream*`` exception; in router mode it is bound to one model and never makes the
router load it.

Invariants and trade-offs: docs/modules.md, `sidecar/observe/upstream.py`.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar.core import config, errors, events, protocols, rates
from sidecar.observe import promptcalls, replies, routercalls

_ACTIVITY = (
    "llamacpp:n_decode_total",
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:requests_deferred",
)
MAX_BODY = 8 << 20
"""Largest reply read from llama-server, in bytes (a /slots reply with prompts is big)."""


class LlamaClient:
    """Typed calls to llama-server's /health, /slots, /props, /metrics and slot actions."""

    def __init__(
        self, session: aiohttp.ClientSession, settings: config.UpstreamSettings, *, model: str | None = None
    ) -> None:
        self._session = session
        self.model = model
        """The router-mode model this client is bound to; None for a plain llama-server."""
        self._query = "" if model is None else urllib.parse.urlencode({"model": model, "autoload": "false"})
        self._base = settings.url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=settings.request_timeout, connect=settings.connect_timeout)
        self._action_timeout = aiohttp.ClientTimeout(total=settings.action_timeout, connect=settings.connect_timeout)
        self.total_slots: int | None = None
        """The slot count the last /props announced: a /slots reply listing more is refused."""
        self.rates = rates.Ledger()
        """The windows of llama-server's rate gauges this client's /metrics reads ended (see :mod:`rates`)."""
        self.router = routercalls.RouterCalls(
            self._json, self._request, timeout=self._timeout, action_timeout=self._action_timeout
        )
        """Router mode's own calls: the models listed and their states, a model loaded."""
        self.prompts = promptcalls.PromptCalls(
            self._json, timeout=self._timeout, action_timeout=self._action_timeout, model=model
        )
        """The calls about prompts: a chat's template, token ids and their pieces, ids run on a slot."""

    @property
    def url(self) -> str:
        return self._base

    def for_model(self, model: str, settings: config.UpstreamSettings) -> LlamaClient:
        """A client of the same router-mode server bound to ``model`` (sharing the session)."""
        return LlamaClient(self._session, settings, model=model)

    def _at(self, path: str) -> str:
        """``path`` with the model and ``autoload=false`` in its query, for a model view."""
        if not self._query:
            return path
        return path + ("&" if "?" in path else "?") + self._query

    async def health(self) -> tuple[events.Health, str]:
        """The server's state, and what went wrong when it is not OK."""
        if self.model is not None:
            return await self._model_health(self.model)
        try:
            await self._request("GET", "/health", self._timeout)
        except errors.UpstreamUnavailable as exc:
            if exc.status == 503:
                return events.Health.LOADING, "loading the model (/health answered 503)"
            return events.Health.DOWN, str(exc)
        except errors.UpstreamError as exc:
            return events.Health.DOWN, str(exc)
        return events.Health.OK, ""

    async def _model_health(self, model: str) -> tuple[events.Health, str]:
        """A router-mode model's state: OK while its server runs loaded (or asleep), DOWN while unloaded."""
        try:
            status = (await self.router.models()).get(model)
        except errors.UpstreamError as exc:
            return events.Health.DOWN, str(exc)
        if status is None:
            return events.Health.DOWN, f"the router does not list model {model!r} (GET /models)"
        if status in (events.ModelStatus.LOADED, events.ModelStatus.SLEEPING):
            return events.Health.OK, ""
        if status is events.ModelStatus.LOADING:
            return events.Health.LOADING, f"the router is loading model {model!r}"
        return events.Health.UNLOADED, f"model {model!r} is {status.value} (the router runs no server for it)"

    async def slots(self) -> tuple[events.SlotView, ...]:
        return slot_views(await self._json("GET", self._at("/slots"), self._timeout), total_slots=self.total_slots)

    async def props(self) -> tuple[events.Identity, bool]:
        """Read /props: the identity without the model's size, and whether the server sleeps."""
        props = await self._json("GET", self._at("/props"), self._timeout)
        if not isinstance(props, dict):
            raise errors.UpstreamProtocolError("/props did not return an object", endpoint="/props")
        if props.get("role") == "router":
            raise errors.UpstreamIsRouter(
                "llama-server runs in router mode (several models; /props says role router)",
                endpoint="/props",
            )
        settings = replies.field(props, "default_generation_settings", dict, "/props")
        identity = events.Identity(
            build_info=str(props.get("build_info", "")),
            model_path=replies.field(props, "model_path", str, "/props"),
            total_slots=replies.field(props, "total_slots", int, "/props"),
            n_ctx=replies.field(settings, "n_ctx", int, "/props"),
        )
        self.total_slots = identity.total_slots
        return identity, bool(props.get("is_sleeping", False))

    async def model_meta(self) -> tuple[int | None, int | None]:
        """(size in bytes, parameter count) of the loaded model; (None, None) if the server does not say."""
        try:
            models = await self._json("GET", "/v1/models", self._timeout)
            entries = [m for m in models["data"] if self.model is None or m.get("id") == self.model]
            meta = entries[0]["meta"]
        except (errors.UpstreamError, KeyError, IndexError, TypeError, AttributeError):
            return None, None  # older servers: the model size is then not part of the fingerprint
        size = meta.get("size") if isinstance(meta, dict) else None
        params = meta.get("n_params") if isinstance(meta, dict) else None
        return replies.count(size), replies.count(params)

    async def adapters(self) -> tuple[events.Adapter, ...] | None:
        """LoRA adapters and their scales (``GET /lora-adapters``); None if the server does not say.

        The call is a task on the server's loop: it wakes a sleeping server, so
        it is read only when the server comes up or restarts.
        """
        try:
            body = await self._json("GET", self._at("/lora-adapters"), self._timeout)
        except errors.UpstreamRejected:
            return None  # an older server without the endpoint
        if not isinstance(body, list):
            raise errors.UpstreamProtocolError("/lora-adapters did not return a list", endpoint="/lora-adapters")
        found: list[events.Adapter] = []
        for item in body:
            entry = replies.as_dict(item, "/lora-adapters")
            scale = entry.get("scale")
            if (
                not isinstance(scale, int | float)
                or isinstance(scale, bool)
                or not -replies.MAX_COUNT <= scale <= replies.MAX_COUNT
            ):
                raise errors.UpstreamProtocolError(f"/lora-adapters: scale is {scale!r:.40}", endpoint="/lora-adapters")
            found.append(
                events.Adapter(
                    id=replies.field(entry, "id", int, "/lora-adapters"),
                    path=replies.field(entry, "path", str, "/lora-adapters"),
                    scale=float(scale),
                )
            )
        return tuple(found)

    async def counters(self) -> events.Counters:
        status, headers, text = await self._request("GET", self._at("/metrics"), self._timeout)
        del status
        values: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name] = sample.value
        except ValueError as exc:
            raise errors.UpstreamProtocolError(f"/metrics is not Prometheus text: {exc}", endpoint="/metrics") from exc
        self.rates.read(headers.get("Process-Start-Time-Unix"), values)
        start: float | None = None
        try:
            start = float(headers.get("Process-Start-Time-Unix", ""))
        except ValueError:
            start = None
        return events.Counters(
            start_time=start,
            prompt_tokens=values.get("llamacpp:prompt_tokens_total", 0.0),
            cached_tokens=values.get("llamacpp:prompt_tokens_cached_total", 0.0),
            activity=tuple(values.get(name, 0.0) for name in _ACTIVITY),
            processing=values.get("llamacpp:requests_processing", 0.0),
            prompt_seconds=values.get("llamacpp:prompt_seconds_total", 0.0),
        )

    async def save(self, slot: int, filename: str) -> protocols.ActionResult:
        return await self._action(slot, "save", filename, ("n_saved", "n_written", "save_ms"))

    async def restore(self, slot: int, filename: str) -> protocols.ActionResult:
        return await self._action(slot, "restore", filename, ("n_restored", "n_read", "restore_ms"))

    async def erase(self, slot: int) -> int:
        endpoint = "/slots erase"
        payload = {} if self.model is None else {"model": self.model}
        body = replies.as_dict(
            await self._json("POST", self._at(f"/slots/{slot}?action=erase"), self._action_timeout, payload), endpoint
        )
        return replies.field(body, "n_erased", int, endpoint)

    async def _action(
        self, slot: int, action: str, filename: str, keys: tuple[str, str, str]
    ) -> protocols.ActionResult:
        endpoint = f"/slots {action}"
        payload = {"filename": filename} if self.model is None else {"filename": filename, "model": self.model}
        body = replies.as_dict(
            await self._json("POST", self._at(f"/slots/{slot}?action={action}"), self._action_timeout, payload),
            endpoint,
        )
        timings = body.get("timings")
        server_ms = timings.get(keys[2]) if isinstance(timings, dict) else None
        return protocols.ActionResult(
            slot=slot,
            filename=filename,
            tokens=replies.field(body, keys[0], int, endpoint),
            bytes=replies.field(body, keys[1], int, endpoint),
            server_ms=float(server_ms) if isinstance(server_ms, int | float) else 0.0,
        )

    async def _json(self, method: str, path: str, timeout: aiohttp.ClientTimeout, payload: Any = None) -> Any:
        _, _, text = await self._request(method, path, timeout, payload)
        try:
            return json.loads(text, parse_constant=replies.no_constant)
        except ValueError as exc:
            raise errors.UpstreamProtocolError(f"{path} did not return JSON: {text[:120]!r}", endpoint=path) from exc

    async def _request(
        self, method: str, path: str, timeout: aiohttp.ClientTimeout, payload: Any = None
    ) -> tuple[int, Mapping[str, str], str]:
        endpoint = path.split("?", maxsplit=1)[0]
        try:
            async with self._session.request(
                method, self._base + path, json=payload, headers=self._headers, timeout=timeout
            ) as resp:
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(64 << 10):
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise errors.UpstreamProtocolError(
                            f"{endpoint} answered more than {MAX_BODY} bytes", endpoint=endpoint
                        )
                    chunks.append(chunk)
                text = b"".join(chunks).decode("utf-8", errors="replace")
                status, headers = resp.status, resp.headers.copy()  # names stay case-insensitive
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise errors.UpstreamUnavailable(
                f"{endpoint}: no answer within {timeout.total} s", endpoint=endpoint
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise errors.UpstreamUnavailable(f"{endpoint}: {type(exc).__name__}: {exc}", endpoint=endpoint) from exc
        if status == 200:
            return status, headers, text
        raise status_error(endpoint, status, text)


def status_error(endpoint: str, status: int, text: str) -> errors.UpstreamError:
    """The error a reply of ``endpoint`` with HTTP ``status`` (not 200) and body ``text`` stands for."""
    message = f"{endpoint}: HTTP {status}: {replies.error_message(text)}"
    if status == 501:
        return errors.UpstreamNotSupported(message, endpoint=endpoint, status=status)
    if status in (401, 403):
        return errors.UpstreamDenied(message, endpoint=endpoint, status=status)
    if 400 <= status < 500:
        return errors.UpstreamRejected(message, endpoint=endpoint, status=status)
    return errors.UpstreamUnavailable(message, endpoint=endpoint, status=status)


def slot_views(body: Any, *, total_slots: int | None = None) -> tuple[events.SlotView, ...]:
    """The slots of a ``GET /slots`` reply's parsed JSON; raises ``UpstreamProtocolError``.

    ``total_slots``: the count /props announced. A reply listing more slots, or a slot id
    outside ``0 .. total_slots - 1`` or twice, is not this server's: refused before it is
    read item by item (a server reporting 20,000 slots made per-slot metric series of each).
    """
    if not isinstance(body, list):
        raise errors.UpstreamProtocolError("/slots did not return a list", endpoint="/slots")
    if total_slots is not None and len(body) > total_slots:
        raise errors.UpstreamProtocolError(
            f"/slots lists {len(body)} slots, more than the {total_slots} /props announced (total_slots)",
            endpoint="/slots",
        )
    views = tuple(replies.slot_view(item) for item in body)
    return views if total_slots is None else announced(views, total_slots)


def announced(views: tuple[events.SlotView, ...], total_slots: int) -> tuple[events.SlotView, ...]:
    """``views`` if they are at most ``total_slots`` slots of distinct ids below it; else ``UpstreamProtocolError``."""
    ids = [view.id for view in views]
    if len(ids) > total_slots or len(set(ids)) != len(ids) or any(not 0 <= i < total_slots for i in ids):
        raise errors.UpstreamProtocolError(
            f"/slots lists {len(ids)} slots of ids {sorted(ids)[:8]!r:.80} (first 8), not distinct ids below the "
            f"{total_slots} slots /props announced (total_slots)",
            endpoint="/slots",
        )
    return views
