"""Forward one request to llama-server and relay its answer as it arrives.

The body is read whole and the client's response held until llama-server's first event, so a
completion cut before then (a restart) is sent again, a routed one placed afresh; from the first
event on, the answer is relayed as it comes and never retried.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/relay.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

import structlog
from aiohttp import web

from sidecar.core import apikeys, config, metrics, outcomes, protocols, tries
from sidecar.core import rates as rates_of
from sidecar.engine import gate
from sidecar.proxy import (
    answer,
    bodies,
    cors,
    held,
    keepalive,
    overflow,
    passon,
    predict,
    refusals,
    routes,
    sse,
    tickets,
    upclient,
)

log = structlog.get_logger("sidecar.proxy")

_LOADING = b"Loading model"
"""llama-server's 503 message while it loads: the new process cannot serve yet."""
PREFIX_HEADER = "X-Llama-Sidecar-Prefix"
"""The response header that tells the client where its prompt's prefix came from (``--proxy-prefix-header``)."""
Refusal = bodies.Refusal
QUIET_SECONDS = 1.2
"""How long the poller holds its reads once a client left a request llama-server runs: llama-server checks
its client only after a whole second with no task result (see ``Poller.quiet``)."""
Admit = Callable[[outcomes.Route, bytes], Awaitable[Refusal | None]]
"""Router mode: waits until a request may be forwarded (its model loaded and restored); or the answer instead."""


class Placement(Protocol):
    """A completion placed by the library: the body to forward, and what its answer came to."""

    @property
    def body(self) -> bytes:
        """The body to forward (pinned with ``id_slot`` where the route takes it, or as it came)."""

    @property
    def header(self) -> str:
        """The value of :data:`PREFIX_HEADER` for the client; "" for none."""

    @property
    def counted(self) -> bool:
        """Whether :meth:`answered` needs the answer's reuse figure (``Ended.cached``); else it is not read."""

    @property
    def later(self) -> bool:
        """Not placed: a request let through before the restore round ended waits for the whole round."""

    def answered(self, ended: answer.Ended) -> None:
        """llama-server's answer was relayed (to its end, or cut): count it from its own figures."""


class Pinner(Protocol):
    """Places a completion before it is forwarded (the library pins it to the slot that holds its KV)."""

    def pin(
        self, raw_path: str, body: bytes, *, owner: str, ticket: tickets.Ticket
    ) -> contextlib.AbstractAsyncContextManager[Placement]:
        """The placement, valid until the request ends; never raises for a bad request.

        ``owner``: whose conversation it is (``apikeys.NOBODY`` without API keys): only that owner's KV serves it.
        ``ticket``: the request's admission, let through by the gate (``Ticket.within``: the slots restored so far
        by the restore round that let it through early); the pinner reserves the slot it pins it to there.
        """

    async def prepare(self, raw_path: str, body: bytes, *, owner: str) -> str | None:
        """What needs no slot (the token ids), done while the request waits for a restore round; never raises.

        Returns the snapshot file whose restore the request waits for (None: the whole round).
        """


_classify = functools.lru_cache(maxsize=256)(routes.classify)
"""The route of a request: clients send the same few paths over and over, so decided once per path."""


class Relay:
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
        pinner: Pinner | None = None,
        admit: Admit | None = None,
        admin_tries: tries.Tries | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> None:
        """``on_leave``: called when a client leaves a request sent to llama-server before its answer began
        (the sidecar's poller holds its reads, so that llama-server sees the client gone).
        ``rates``: the windows of llama-server's rate gauges the sidecar's own /metrics reads ended; a client's
        ``GET /metrics`` is answered with the gauges as if those reads had not been made (see :mod:`rates`)."""
        self._rates = rates
        self._pinner = pinner
        self._on_leave = on_leave
        self._client = client
        self._origins = cors.Origins(client)
        self._overflow = overflow.Overflow(client)
        self._gate = restore_gate
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
        self._held = held.HeldTooLong(
            hold_seconds=settings.hold_seconds, retry_after=settings.retry_after, clock=self._clock
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
            return await self._pinned(request, kind.target, headers, body, self._pinner, owner, keep)
        return await self._forward(request, kind.route, kind.target, headers, body, keep)

    async def _pinned(
        self,
        request: web.BaseRequest,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        pinner: Pinner,
        owner: str,
        keep: keepalive.KeepAlive | None,
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome]:
        """A completion placed by ``pinner`` once the gate is open: a slot is only chosen on a server that can serve.

        If the gate closes before the answer's first event (a crash), the
        placement ends there and the request is placed again once the gate
        opens: the restore round may have put another conversation in its slot.
        """
        ticket = tickets.Ticket(self._clock.monotonic() + self._settings.hold_seconds)
        with self._gate.hold(self._metrics) as hold:
            try:
                while True:
                    if not self._gate.lets(hold):
                        meanwhile = functools.partial(pinner.prepare, target, body, owner=owner)
                        if not await self._wait(ticket, hold, meanwhile if ticket.prepares else None):
                            return self._held_too_long(), outcomes.ProxyOutcome.HELD_TIMEOUT
                    ticket.let_through(frozenset(hold.early.ready) if hold.early is not None else None)
                    async with pinner.pin(target, body, owner=owner, ticket=ticket) as placement:
                        if placement.later:
                            ticket.later()
                            hold.leave_early()
                            continue
                        ticket.place()
                        if keep is not None and placement.header and self._settings.prefix_header:
                            keep.header = (PREFIX_HEADER, placement.header)
                        sent = await self._send(
                            request,
                            outcomes.Route.COMPLETION,
                            target,
                            headers,
                            placement.body,
                            ticket,
                            hold,
                            placement=placement,
                            keep=keep,
                        )
                        if sent is not tickets.Resume.REPLACE:
                            return sent
            finally:
                ticket.release()

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

    async def _forward(
        self,
        request: web.BaseRequest,
        route: outcomes.Route,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        keep: keepalive.KeepAlive | None,
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome]:
        ticket = tickets.Ticket(
            self._clock.monotonic() + self._settings.hold_seconds,
            routed=False,
            gated=route is outcomes.Route.COMPLETION,
        )
        with self._gate.hold(self._metrics) as hold:
            try:
                sent = await self._send(request, route, target, headers, body, ticket, hold, keep=keep)
            finally:
                ticket.release()
        assert sent is not tickets.Resume.REPLACE  # only a routed request is placed again
        return sent

    async def _wait(
        self,
        ticket: tickets.Ticket,
        hold: gate.Hold,
        meanwhile: Callable[[], Awaitable[str | None]] | None = None,
    ) -> bool:
        """Wait at the gate until the request's deadline; False if it stayed closed (``meanwhile``: see gate)."""
        return await hold.wait(ticket.deadline - self._clock.monotonic(), meanwhile=meanwhile)

    async def _send(
        self,
        request: web.BaseRequest,
        route: outcomes.Route,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        ticket: tickets.Ticket,
        hold: gate.Hold,
        *,
        placement: Placement | None = None,
        keep: keepalive.KeepAlive | None = None,
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome] | Literal[tickets.Resume.REPLACE]:
        """Send until an answer's first event arrives, then relay it; ``Resume.REPLACE``: a placement to redo."""
        gated = ticket.gated
        while True:
            if gated and (stopped := await self._through_gate(route, body, ticket, hold)) is not None:
                return stopped
            ticket.send()
            try:
                up = await self._client.request(request.method, target, headers, body)
            except asyncio.CancelledError:
                self._left()  # a non-streamed answer's headers come at its end: the client left before
                raise
            except upclient.ConnectFailed as exc:
                # Nothing listens: a crash the poller may not have seen yet. The request never
                # reached llama-server, so a completion can wait and be sent when it is back.
                self._gate.suspect(f"the proxy could not connect to llama-server ({exc.__class__.__name__})")
                if not gated:
                    return refusals.unreachable(exc), outcomes.ProxyOutcome.ERROR
                continue
            except upclient.Lost as exc:
                if (refused := self._lost(exc, ticket)) is not None:
                    return refused
                continue
            if gated and up.status == 503:
                whole, text = await _read_all(up)
                if _LOADING not in text:
                    return whole, outcomes.ProxyOutcome.OK
                self._gate.suspect("llama-server answered 503 'Loading model': a new process")
                continue
            try:
                first = await answer.first_part(up)
            except upclient.Lost as exc:
                up.close()
                if (refused := self._lost(exc, ticket)) is not None:
                    return refused
                continue
            except BaseException:
                up.close()  # the client went away in the prefill: llama-server sees the connection drop and stops
                self._left()
                raise
            ticket.first_event()
            return await self._relay(request, up, first, placement, keep)

    async def _through_gate(
        self, route: outcomes.Route, body: bytes, ticket: tickets.Ticket, hold: gate.Hold
    ) -> Refusal | Literal[tickets.Resume.REPLACE] | None:
        """Wait while the gate is closed to this request; None: send it now."""
        if self._gate.lets(hold):
            return None
        if ticket.closed() is tickets.Resume.REPLACE:
            return tickets.Resume.REPLACE  # placed again once the gate opens: the round changed the slots
        if not await self._wait(ticket, hold):
            return self._held_too_long(), outcomes.ProxyOutcome.HELD_TIMEOUT
        if self._admit is not None and (refused := await self._admit(route, body)) is not None:
            # Router mode: the router is back, but the model it ran may not be (a kill -9 takes
            # its child servers). A request let through now would have the router load the
            # model for it and take the slot before the restore: it goes through the load
            # and the model's gate, as a new request does.
            return refused
        return None

    def _lost(self, exc: BaseException, ticket: tickets.Ticket) -> Refusal | None:
        """The connection closed before the answer's first event: None to send again, else the answer to give.

        A crash, or a kept-alive connection llama-server closed just then. Sent
        once more at once: after a crash that attempt finds nothing listening,
        and waits at the gate like any other. A second such failure (the dying
        process still held the listening socket) closes the gate: a completion
        is then sent a last time after the restart and restore.
        """
        replay = ticket.lost()
        if replay is tickets.Replay.GIVE_UP:
            return refusals.unreachable(exc), outcomes.ProxyOutcome.ERROR
        if replay is tickets.Replay.SUSPECT:
            self._gate.suspect(f"llama-server closed the connection twice ({exc.__class__.__name__})")
        log.info(
            "proxy_request_replayed",
            error=exc.__class__.__name__,
            effect="llama-server closed the connection before the answer's first event; the request is sent "
            "once more (after the restart and restore, if llama-server is gone), and nothing was sent to the client",
        )
        return None

    def _left(self) -> None:
        if self._on_leave is not None:
            self._on_leave()

    def _held_too_long(self) -> web.Response:
        return self._held.answer(self._gate.reason or "the restore gate kept closing")

    async def _relay(
        self,
        request: web.BaseRequest,
        up: upclient.Answer,
        first: answer.First,
        placement: Placement | None,
        keep: keepalive.KeepAlive | None,
    ) -> tuple[web.StreamResponse, outcomes.ProxyOutcome]:
        clean = False
        try:
            if self._rates is not None and first.whole is not None and _is_scrape(request, up):
                first = answer.First(
                    rates_of.for_client(self._rates, up.header("process-start-time-unix"), first.whole)
                )
            started = await keep.stop() if keep is not None else None
            headers = passon.to_client(up.headers)
            if placement is not None and placement.header and self._settings.prefix_header:
                headers.append((PREFIX_HEADER, placement.header))
            counted = placement is not None and placement.counted
            response, ended = await answer.relay(request, up, first, headers, counted=counted, started=started)
            clean = ended.outcome is outcomes.ProxyOutcome.OK
            if placement is not None:
                placement.answered(ended)
            return response, ended.outcome
        finally:
            if clean:
                up.release()
                if first.whole is None and up.chunked and self._gate.is_open:
                    self._client.open_spare()  # llama-server closed this one: the next request finds a new one ready
            else:
                up.close()  # a cut or cancelled answer: llama-server sees the connection drop and stops the task


def _is_scrape(request: web.BaseRequest, up: upclient.Answer) -> bool:
    """A client's read of llama-server's own ``/metrics`` (a plain server's: no ``?model=``), answered."""
    return (
        request.method == "GET"
        and up.status == 200
        and request.raw_path.partition("?")[2] == ""
        and _classify("GET", request.raw_path).path == "/metrics"
    )


async def _go_on(request: web.BaseRequest) -> None:
    """The interim ``100 Continue`` a client that sent ``Expect: 100-continue`` waits for before its body
    (llama-server's cpp-httplib sends it; aiohttp's low-level server leaves it to the handler)."""
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        with contextlib.suppress(ConnectionError):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


async def _read_all(up: upclient.Answer) -> tuple[web.Response, bytes]:
    """A short answer read whole (a 503), to look into it before relaying it."""
    try:
        body = await up.read()
    except upclient.Lost:
        body = b""
    finally:
        up.close()
    headers = routes.end_to_end(up.headers, drop=passon.DROP_RESPONSE)
    return web.Response(status=up.status, reason=up.reason, body=body, headers=headers), body
