"""Relaying llama-server's answer to the client, once its first event has arrived.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/answer.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import structlog
from aiohttp import web

from sidecar.core import outcomes
from sidecar.proxy import sse, upclient

log = structlog.get_logger("sidecar.proxy")

WHOLE_ANSWER_BYTES = 1 << 20
"""Answers with a Content-Length up to this size are read whole and relayed in one write; others chunk by chunk."""
CUT_MESSAGE = (
    "llama-server went away in the middle of this answer (it crashed or was restarted); the part already "
    "sent is all there is: send the request again"
)


@dataclasses.dataclass(slots=True)
class First:
    """What arrived of an answer before anything was sent to the client."""

    whole: bytes | None
    """The whole body of a short answer of known length; None for a streamed answer."""
    head: bytes = b""
    """A streamed answer's first bytes: its first event (and the pings before it)."""
    done: bool = False
    """The streamed answer ended within ``head``."""


@dataclasses.dataclass(slots=True)
class Ended:
    """How an answer's relay ended, for the counts."""

    status: int
    outcome: outcomes.ProxyOutcome
    cached: int | None
    """The prompt tokens the server reused for this request, as its answer says; None if it says nothing."""


async def first_part(up: upclient.Answer) -> First:
    """Read until the answer's first event (or its whole body); raises ``upclient.Lost`` if it is cut first.

    SSE comments (llama-server's ``:`` pings every 30 s) are no event: a
    stream still in its prefill keeps the client waiting for its headers.
    """
    if up.length is not None and up.length <= WHOLE_ANSWER_BYTES:
        return First(await up.read())
    head = b""
    while True:
        chunk = await up.readany()
        if not chunk:
            return First(None, head, done=True)
        head += chunk
        if not sse.only_comments(head):
            return First(None, head)


async def relay(
    request: web.BaseRequest,
    up: upclient.Answer,
    first: First,
    headers: list[tuple[str, str]],
    *,
    counted: bool,
    started: tuple[web.StreamResponse, bytes] | None = None,
) -> tuple[web.StreamResponse, Ended]:
    """Send ``up``'s answer (its ``first`` part already read) to the client; the caller releases ``up``.

    ``counted``: read the answer's prompt-reuse figure (``Ended.cached``, for the library's counts); a
    route the library does not count (``/tokenize``, the web UI's files) is relayed without a look.
    ``started``: the stream the proxy already sent the client (its status and headers: ``headers`` and
    ``up``'s are not sent), and what to write in it first; an answer that is not a stream ends it as
    its error event.

    The answer is written to its end here, a whole one too, and the response returned is prepared and
    ended: nothing the caller does once it returns (the library's end-of-request bookkeeping) delays it.
    """
    if started is not None:
        response, lead = started
        if up.status == 200 and sse.is_event_stream(up.header("content-type") or ""):
            return response, await _stream(request, response, up, first, counted, lead)
        return response, await _as_event(request, response, up, first)
    if first.whole is not None:
        whole = web.Response(status=up.status, reason=up.reason, body=first.whole, headers=headers)
        if request.method == "HEAD" and up.length is not None:
            whole.headers["Content-Length"] = str(up.length)  # the length of the GET's body, as llama-server says
        ended = Ended(up.status, outcomes.ProxyOutcome.OK, sse.cached_tokens(first.whole) if counted else None)
        try:
            await whole.prepare(request)
            await whole.write_eof()
        except ConnectionError:
            ended.outcome = outcomes.ProxyOutcome.CANCELLED
        return whole, ended
    response = web.StreamResponse(status=up.status, reason=up.reason)
    response.headers.extend(headers)
    if up.length is not None:
        response.content_length = up.length
    try:
        await response.prepare(request)
    except ConnectionError:
        return response, Ended(up.status, outcomes.ProxyOutcome.CANCELLED, None)
    return response, await _stream(request, response, up, first, counted, b"")


async def _stream(
    request: web.BaseRequest,
    response: web.StreamResponse,
    up: upclient.Answer,
    first: First,
    counted: bool,
    lead: bytes,
) -> Ended:
    """Write the answer's first part and the rest as it arrives into ``response`` (prepared), to its end."""
    ended = Ended(up.status, outcomes.ProxyOutcome.OK, sse.cached_tokens(first.head) if counted else None)
    try:
        await response.write(lead + first.head)
        while not first.done:
            try:
                chunk = await up.readany()
            except upclient.Lost as exc:
                await _cut(request, response, up, exc)
                ended.outcome = outcomes.ProxyOutcome.ERROR
                return ended
            if not chunk:
                break
            if counted and (found := sse.cached_tokens(chunk)) is not None:
                ended.cached = found
            await response.write(chunk)
        await response.write_eof()
    except ConnectionError:
        ended.outcome = outcomes.ProxyOutcome.CANCELLED
    return ended


async def _as_event(request: web.BaseRequest, response: web.StreamResponse, up: upclient.Answer, first: First) -> Ended:
    """An answer that is no stream (a 400, a 503), for a stream already started: its error event ends it."""
    body = first.whole if first.whole is not None else first.head
    if first.whole is None and not first.done:
        with contextlib.suppress(upclient.Lost):
            body += await up.read()
    ended = Ended(up.status, outcomes.ProxyOutcome.OK, None)
    try:
        await response.write(sse.answer_as_event(sse.api_of(request.raw_path), up.status, up.reason, body))
        await response.write_eof()
    except ConnectionError:
        ended.outcome = outcomes.ProxyOutcome.CANCELLED
    return ended


async def _cut(request: web.BaseRequest, response: web.StreamResponse, up: upclient.Answer, exc: Exception) -> None:
    """llama-server went away mid-answer: end a stream with an error event, cut anything else."""
    stream = sse.is_event_stream(up.header("content-type") or "")
    log.warning(
        "proxy_answer_cut",
        error=exc.__class__.__name__,
        effect="llama-server went away mid-answer; "
        + (
            "the stream was ended with an error event in its API's format (the client sees an API error)"
            if stream
            else "the client's connection was closed before the end of the answer, so it sees a cut answer"
        ),
    )
    if stream and response.content_length is None:
        with contextlib.suppress(ConnectionError):
            await response.write(sse.error_event(sse.api_of(request.raw_path), CUT_MESSAGE))
            await response.write_eof()
        return
    if request.transport is not None:
        request.transport.close()
