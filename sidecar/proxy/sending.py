"""Send one request to llama-server until its answer's first event, then relay the answer.

The request waits at the restore gate while it is closed to it, is sent again after a connection
llama-server closed before the first event (a restart), and a routed completion is placed afresh
by the library each time the gate closed on it; from the first event on, the answer is relayed as
it comes and never retried. The rules of each move are the ticket's (:mod:`sidecar.proxy.tickets`).

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/relay.py`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog
from aiohttp import web

from sidecar.core import config, metrics, outcomes, protocols
from sidecar.core import rates as rates_of
from sidecar.engine import gate
from sidecar.proxy import answer, bodies, held, keepalive, passon, placing, refusals, routes, tickets, upclient

log = structlog.get_logger("sidecar.proxy")

_LOADING = b"Loading model"
"""llama-server's 503 message while it loads: the new process cannot serve yet."""
PREFIX_HEADER = "X-Llama-Sidecar-Prefix"
"""The response header that tells the client where its prompt's prefix came from (``--proxy-prefix-header``)."""

Sent = tuple[web.StreamResponse, outcomes.ProxyOutcome]
"""The answer given to the client, and how the request is counted."""


class Sender:
    """The path of one request from the restore gate to its answer's end (see the module's docstring)."""

    def __init__(
        self,
        *,
        client: upclient.Client,
        restore_gate: gate.Gate,
        stats: metrics.Metrics,
        settings: config.ProxySettings,
        clock: protocols.Clock,
        rates: rates_of.Ledger | None = None,
        admit: placing.Admit | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> None:
        """``rates``, ``on_leave``: see :class:`sidecar.proxy.relay.Relay`; ``admit``: router mode's door."""
        self._client = client
        self._gate = restore_gate
        self._metrics = stats
        self._settings = settings
        self._clock = clock
        self._rates = rates
        self._admit = admit
        self._on_leave = on_leave
        self._held = held.HeldTooLong(hold_seconds=settings.hold_seconds, retry_after=settings.retry_after, clock=clock)

    async def pinned(
        self,
        request: web.BaseRequest,
        kind: routes.Request,
        headers: list[tuple[str, str]],
        body: bytes,
        pinner: placing.Pinner,
        owner: str,
        keep: keepalive.KeepAlive | None,
    ) -> Sent:
        """A completion placed by ``pinner`` once the gate is open: a slot is only chosen on a server that can serve.

        If the gate closes before the answer's first event (a crash), the
        placement ends there and the request is placed again once the gate
        opens: the restore round may have put another conversation in its slot.
        """
        target = kind.target
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
                            request, kind, headers, placement.body, ticket, hold, placement=placement, keep=keep
                        )
                        if sent is not tickets.Resume.REPLACE:
                            return sent
            finally:
                ticket.release()

    async def forward(
        self,
        request: web.BaseRequest,
        kind: routes.Request,
        headers: list[tuple[str, str]],
        body: bytes,
        keep: keepalive.KeepAlive | None,
    ) -> Sent:
        """Any request the library does not place: a completion waits at the gate, anything else goes at once."""
        ticket = tickets.Ticket(
            self._clock.monotonic() + self._settings.hold_seconds,
            routed=False,
            gated=kind.route is outcomes.Route.COMPLETION,
        )
        with self._gate.hold(self._metrics) as hold:
            try:
                sent = await self._send(request, kind, headers, body, ticket, hold, keep=keep)
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
        kind: routes.Request,
        headers: list[tuple[str, str]],
        body: bytes,
        ticket: tickets.Ticket,
        hold: gate.Hold,
        *,
        placement: placing.Placement | None = None,
        keep: keepalive.KeepAlive | None = None,
    ) -> Sent | Literal[tickets.Resume.REPLACE]:
        """Send until an answer's first event arrives, then relay it; ``Resume.REPLACE``: a placement to redo."""
        gated = kind.route is outcomes.Route.COMPLETION  # a completion waits at the gate, and may be sent again
        while True:
            if gated and (stopped := await self._through_gate(kind.route, body, ticket, hold)) is not None:
                return stopped
            ticket.send()
            try:
                up = await self._client.request(request.method, kind.target, headers, body)
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
            return await self._relay(request, kind, up, first, placement, keep)

    async def _through_gate(
        self, route: outcomes.Route, body: bytes, ticket: tickets.Ticket, hold: gate.Hold
    ) -> bodies.Refusal | Literal[tickets.Resume.REPLACE] | None:
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

    def _lost(self, exc: BaseException, ticket: tickets.Ticket) -> bodies.Refusal | None:
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
        kind: routes.Request,
        up: upclient.Answer,
        first: answer.First,
        placement: placing.Placement | None,
        keep: keepalive.KeepAlive | None,
    ) -> Sent:
        clean = False
        try:
            if self._rates is not None and first.whole is not None and _is_scrape(request, kind, up):
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


def _is_scrape(request: web.BaseRequest, kind: routes.Request, up: upclient.Answer) -> bool:
    """A client's read of llama-server's own ``/metrics`` (a plain server's: no ``?model=``), answered."""
    return (
        request.method == "GET"
        and up.status == 200
        and request.raw_path.partition("?")[2] == ""
        and kind.path == "/metrics"
    )


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
