"""Forward one request to llama-server and relay its answer as it arrives: the proxy's handler.

Here the request is taken in: counted, checked (admin token, API key, path), its body read whole;
a streamed completion gets its keep-alive, a routed one its placement by the library. The client's
response is held until llama-server's first event, so a completion cut before then (a restart) is
sent again, a routed one placed afresh; from the first event on, the answer is relayed as it comes
and never retried: that path from the restore gate to the answer is :mod:`sidecar.proxy.sending`.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/relay.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
from collections.abc import Callable

from aiohttp import web

from sidecar.core import apikeys, config, metrics, outcomes, protocols, tries
from sidecar.core import rates as rates_of
from sidecar.engine import gate
from sidecar.proxy import (
    bodies,
    cors,
    keepalive,
    overflow,
    passon,
    placing,
    predict,
    refusals,
    routes,
    sending,
    sse,
    upclient,
)

Refusal = bodies.Refusal
QUIET_SECONDS = 1.2
"""How long the poller holds its reads once a client left a request llama-server runs: llama-server checks
its client only after a whole second with no task result (see ``Poller.quiet``)."""


_classify = functools.lru_cache(maxsize=256)(routes.classify)
"""The route of a request: clients send the same few paths over and over, so decided once per path."""


class Relay:
    """The proxy's request handler (``handle``): one per listener, shared by every connection."""

    def __init__(
        self,
        *,
        client: upclient.Client,
        restore_gate: gate.Gate,
        stats: metrics.Metrics,
        upstream: config.UpstreamSettings,
        settings: config.ProxySettings,
        admin_token: str | None,
        rates: rates_of.Ledger | None = None,
        clock: protocols.Clock | None = None,
        pinner: placing.Pinner | None = None,
        admit: placing.Admit | None = None,
        admin_tries: tries.Tries | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> None:
        """``on_leave``: called when a client leaves a request sent to llama-server before its answer began
        (the sidecar's poller holds its reads, so that llama-server sees the client gone).
        ``rates``: the windows of llama-server's rate gauges the sidecar's own /metrics reads ended; a client's
        ``GET /metrics`` is answered with the gauges as if those reads had not been made (see :mod:`rates`)."""
        self._pinner = pinner
        self._origins = cors.Origins(client)
        self._overflow = overflow.Overflow(client)
        self._metrics = stats
        self._api_key = upstream.api_key
        self._keys = upstream.keys
        self._settings = settings
        self._admin_token = admin_token
        self._clock = clock or protocols.SystemClock()
        self._admit = admit
        self._tries = admin_tries if admin_tries is not None else tries.Tries()
        """Wrong admin tokens per client address, on requests only the admin token lets through."""
        self._bodies = bodies.Budget(settings.max_inflight_body_bytes, stats.proxy_body_bytes)
        self._sender = sending.Sender(
            client=client,
            restore_gate=restore_gate,
            stats=stats,
            settings=settings,
            clock=self._clock,
            rates=rates,
            admit=admit,
            on_leave=on_leave,
        )
        self._counted = {
            (route, outcome): stats.proxy_requests.labels(route.value, outcome.value)
            for route in outcomes.Route
            for outcome in outcomes.ProxyOutcome
        }

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        kind = _classify(request.method, request.raw_path)
        outcome = outcomes.ProxyOutcome.ERROR
        self._metrics.proxy_inflight.inc()
        try:
            response, outcome = await self._serve(request, kind)
            if not response.prepared:
                await self._as_the_servers(request, response)
        except asyncio.CancelledError:
            outcome = outcomes.ProxyOutcome.CANCELLED
            raise
        finally:
            self._metrics.proxy_inflight.dec()
            self._counted[kind.route, outcome].inc()
        return response

    async def _as_the_servers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """The proxy's own answer (a refusal, a 503) with the headers llama-server puts on every answer: its
        ``Server``, and the CORS headers it gives this request's ``Origin`` (asked of it: see :mod:`cors`)."""
        response.headers.setdefault("Server", keepalive.SERVER)
        if not any(name in response.headers for name in cors.HEADERS):
            response.headers.extend(await self._origins.headers(request.headers.get("Origin")))

    async def _serve(
        self, request: web.BaseRequest, kind: routes.Request
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome]:
        if kind.verdict is routes.Verdict.BAD_PATH:
            return refusals.bad_path(request.raw_path), outcomes.ProxyOutcome.INVALID
        needs_admin = kind.verdict in (routes.Verdict.SLOT_ACTION, routes.Verdict.UNKNOWN)
        address, now = request.remote or "", self._clock.monotonic()
        if needs_admin and (wait := self._tries.wait(address, now)) > 0:
            return refusals.slow_down(address, wait), outcomes.ProxyOutcome.REFUSED
        admin = self._is_admin(request)
        owner = self._owner(request, admin)
        if owner is None:
            return refusals.unauthorized(), outcomes.ProxyOutcome.REFUSED
        if needs_admin and not admin:
            if self._admin_token and "Authorization" in request.headers:
                self._tries.failed(address, now)  # a token was offered for an admin-only request: a wrong one
            if kind.verdict is routes.Verdict.UNKNOWN:
                return refusals.not_found(), outcomes.ProxyOutcome.REFUSED  # what llama-server answers it
            return refusals.refused(kind), outcomes.ProxyOutcome.REFUSED
        if needs_admin:
            self._tries.succeeded(address)
        headers = passon.to_server(request.headers.items(), admin=admin, api_key=self._api_key)
        await _go_on(request)
        body, refusal = await bodies.read(
            request, self._bodies, limit=self._settings.max_body_bytes, timeout=self._settings.body_timeout
        )
        if refusal is not None:
            return refusal
        try:
            keep = self._keep_alive(request, kind, body, now, headers)
            if keep is None:
                return await self._dispatch(request, kind, headers, body, admin=admin, owner=owner)
            try:
                found = await self._dispatch(request, kind, headers, body, admin=admin, owner=owner, keep=keep)
                return await keep.settle(found[0]), found[1]
            finally:
                keep.cancel()
        finally:
            self._bodies.give(len(body))

    def _keep_alive(
        self,
        request: web.BaseRequest,
        kind: routes.Request,
        body: bytes,
        arrived: float,
        headers: list[tuple[str, str]],
    ) -> keepalive.KeepAlive | None:
        """The keep-alive of a streamed completion (see :mod:`keepalive`); None for any other request."""
        if kind.route is not outcomes.Route.COMPLETION or kind.path not in routes.STREAMING_ROUTES:
            return None  # a read (GET) of the same path is no completion
        if not sse.asks_stream(body):
            return None
        delay = keepalive.HEADERS_AFTER - (self._clock.monotonic() - arrived)
        too_long = (
            None if self._admit is not None else functools.partial(self._overflow.exceeds, kind.path, body, headers)
        )
        return keepalive.KeepAlive(
            request, sse.api_of(request.raw_path), delay=max(delay, 0.0), origins=self._origins, too_long=too_long
        )

    async def _dispatch(
        self,
        request: web.BaseRequest,
        kind: routes.Request,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        admin: bool,
        owner: str,
        keep: keepalive.KeepAlive | None = None,
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome]:
        found = predict.check(body) if kind.verdict is routes.Verdict.PREDICT and not admin else None
        if found is not None and found is not predict.Check.ALLOWED:
            return refusals.predict_refused(found), outcomes.ProxyOutcome.REFUSED
        if self._admit is not None and (refused := await self._admit(kind.route, body)) is not None:
            return refused
        if self._pinner is not None and kind.route is outcomes.Route.COMPLETION:
            return await self._sender.pinned(request, kind, headers, body, self._pinner, owner, keep)
        return await self._sender.forward(request, kind, headers, body, keep)

    def _owner(self, request: web.BaseRequest, admin: bool) -> str | None:
        """Whose request this is (``apikeys.NOBODY`` without API keys); None: refused, for want of a key
        llama-server accepts.

        Writes are checked here, before the library reads them; reads (GET, HEAD, OPTIONS) touch no slot
        and go on to llama-server, which checks them itself (its web UI's files are public). An admin's
        request is sent with the sidecar's own key, and counts as that key's.
        """
        if self._keys is None:
            return apikeys.NOBODY
        if admin:
            return self._keys.check(f"Bearer {self._keys.first}", None)
        if request.method in routes.READ_METHODS:
            return apikeys.NOBODY
        return self._keys.check(request.headers.get("Authorization"), request.headers.get("X-Api-Key"))

    def _is_admin(self, request: web.BaseRequest) -> bool:
        if not self._admin_token:
            return False
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        offered = given.encode("utf-8", "surrogateescape")  # a byte that is not UTF-8 is a wrong token, not an error
        return scheme == "Bearer" and hmac.compare_digest(offered, self._admin_token.encode("utf-8", "surrogateescape"))


async def _go_on(request: web.BaseRequest) -> None:
    """The interim ``100 Continue`` a client that sent ``Expect: 100-continue`` waits for before its body
    (llama-server's cpp-httplib sends it; aiohttp's low-level server leaves it to the handler)."""
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        with contextlib.suppress(ConnectionError):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
