"""The placer's read of ``GET /slots`` on a routed request's path, on the relay's own client. I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/library/reads.py`.
"""

from __future__ import annotations

import asyncio
import json

from sidecar.core import config, errors, events, metrics, outcomes
from sidecar.observe import upstream
from sidecar.proxy import listener, upclient

_ENDPOINT = "/slots"
HEDGE_SECONDS = 0.5
"""How long a read waits for its answer before the same read goes out once more on a new connection."""


class SlotsReader:
    """``GET /slots`` of one plain llama-server, on a connection pool of its own."""

    def __init__(self, settings: config.UpstreamSettings, *, stats: metrics.Metrics) -> None:
        self._client = upclient.Client(
            settings.url, connect_timeout=settings.connect_timeout, keepalive=listener.KEEPALIVE
        )
        self._headers = [("Authorization", f"Bearer {settings.api_key}")] if settings.api_key else []
        self._timeout = settings.request_timeout
        self._retries = {a: stats.library_slots_read_retries.labels(a.value) for a in outcomes.SlotsRetry}

    async def slots(self) -> tuple[events.SlotView, ...]:
        """Every slot as the server shows it now; raises ``errors.UpstreamError``."""
        try:
            async with asyncio.timeout(self._timeout):
                status, body = await self._read()
        except TimeoutError as exc:
            raise errors.UpstreamUnavailable(
                f"{_ENDPOINT}: no answer within {self._timeout:g} s", endpoint=_ENDPOINT
            ) from exc
        text = body.decode("utf-8", errors="replace")
        if status != 200:
            raise upstream.status_error(_ENDPOINT, status, text)
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise errors.UpstreamProtocolError(
                f"{_ENDPOINT} did not return JSON: {text[:120]!r}", endpoint=_ENDPOINT
            ) from exc
        return upstream.slot_views(parsed)

    async def _read(self) -> tuple[int, bytes]:
        """The first reply of the read and, if it is slow, of the same read on a new connection.

        The first read runs in the caller's task, so that its request is written before the caller's
        next step (the placer sends its read early, then parses while llama-server answers). Only if
        it has no answer after ``HEDGE_SECONDS`` does the second read start, in a task of its own: if
        that one answers first, the caller's wait on the first is cancelled and the second's reply is
        returned in its place.
        """
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        second: asyncio.Task[tuple[int, bytes]] | None = None
        took_second = False
        settled = False
        """The first read ended (or failed with the second out): the second's answer no longer cancels anything."""

        def take_second(read: asyncio.Task[tuple[int, bytes]]) -> None:
            nonlocal took_second
            if not settled and not took_second and not read.cancelled() and read.exception() is None:
                took_second = True
                me.cancel()

        def ask_again() -> None:
            nonlocal second
            second = loop.create_task(self._attempts(fresh=True), name="slots-read-again")
            second.add_done_callback(take_second)

        timer = loop.call_later(HEDGE_SECONDS, ask_again)
        answered = outcomes.SlotsRetry.NEITHER
        """Which read's answer is returned, once the second went out (counted then)."""
        try:
            try:
                reply = await self._attempts()
            except asyncio.CancelledError:
                if took_second and me.uncancel() == 0:
                    assert second is not None
                    answered = outcomes.SlotsRetry.SECOND
                    return second.result()
                raise
            except errors.UpstreamError:
                settled = True
                if second is None:
                    raise
                timer.cancel()
                reply = await second  # the first failed while the second is out: its outcome is the read's
                answered = outcomes.SlotsRetry.SECOND
                return reply
            else:
                answered = outcomes.SlotsRetry.FIRST
                return reply
        finally:
            settled = True
            timer.cancel()
            if second is not None:
                self._retries[answered].inc()
                await _drop(second)

    async def _attempts(self, *, fresh: bool = False) -> tuple[int, bytes]:
        """The reply's status and body; a kept-alive connection the server closed meanwhile is retried once."""
        for attempt in (1, 2):
            try:
                return await self._once(fresh=fresh)
            except upclient.Lost as exc:
                if attempt == 2:
                    raise errors.UpstreamUnavailable(f"{_ENDPOINT}: {exc}", endpoint=_ENDPOINT) from exc
            except upclient.ForwardError as exc:
                raise errors.UpstreamUnavailable(f"{_ENDPOINT}: {exc}", endpoint=_ENDPOINT) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(self, *, fresh: bool) -> tuple[int, bytes]:
        answer = await self._client.request("GET", _ENDPOINT, self._headers, b"", fresh=fresh)
        try:
            body = await _body(answer)
        except BaseException:
            answer.close()  # cut, too big, or out of time: the connection serves no other request
            raise
        answer.release()
        return answer.status, body

    async def close(self) -> None:
        await self._client.close()


async def _drop(read: asyncio.Future[tuple[int, bytes]]) -> None:
    """Cancel a read still out (its connection closes) and wait for it to end; its outcome is not wanted."""
    if not read.done():
        read.cancel()
        await asyncio.wait({read})
    if not read.cancelled():
        read.exception()  # retrieved, so that asyncio does not report it as never retrieved


async def _body(answer: upclient.Answer) -> bytes:
    """The whole body, at most ``upstream.MAX_BODY`` bytes; raises ``UpstreamProtocolError`` past them."""
    if answer.length is not None and answer.length > upstream.MAX_BODY:
        raise _too_big()
    parts: list[bytes] = []
    size = 0
    while chunk := await answer.readany():
        size += len(chunk)
        if size > upstream.MAX_BODY:
            raise _too_big()
        parts.append(chunk)
    return b"".join(parts)


def _too_big() -> errors.UpstreamProtocolError:
    return errors.UpstreamProtocolError(f"{_ENDPOINT} answered more than {upstream.MAX_BODY} bytes", endpoint=_ENDPOINT)
