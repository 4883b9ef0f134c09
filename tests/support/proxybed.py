"""The proxy's relay on a loopback port in front of a scripted upstream, for faults and hostile clients.

:class:`Upstream` is an aiohttp low-level server that records every request
it gets (method, raw path, headers, body) and answers by the ``fake`` query
parameter (on any of llama-server's routes, since the proxy forwards writes
only to those):

* ``fake=hang``: never answers; sets ``hung_up`` when the proxy drops the connection;
* ``fake=sse``: an event stream whose events are released one at a time by ``step``;
* ``fake=cut``: two events, then the connection is closed mid-answer (a crash);
* ``fake=prefill-crash-once``: the first request gets a stream's status, headers and a ``:`` ping,
  then the connection is closed before any event (a crash during the prefill); the next gets one event;
* ``fake=short``: a JSON answer that declares 100 bytes and stops after 10 (a crash);
* ``fake=drop-once``: the first request is dropped before any answer byte, the next answered;
* ``fake=drop-twice``: the first two requests are dropped so, the next answered;
* ``fake=loading-once``: the first request gets llama-server's 503 "Loading model";
* anything else: a JSON echo of what arrived.

:func:`run_proxy` starts the real relay and listener (the same ones
``--proxy-listen`` starts) against it, with a gate the test drives in place
of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.core import config, metrics, tries
from sidecar.engine import gate
from sidecar.proxy import listener, placing, relay, upclient


@dataclasses.dataclass(slots=True)
class Arrived:
    method: str
    raw_path: str
    headers: list[tuple[str, str]]
    body: bytes


def _asked(arrived: Arrived) -> bool:
    return (upclient.OWN_AGENT[0].lower(), upclient.OWN_AGENT[1]) in [(k.lower(), v) for k, v in arrived.headers]


class Upstream:
    def __init__(self) -> None:
        self.everything: list[Arrived] = []
        """Every request that reached it: the clients' (``arrived``) and the proxy's own questions (``asked``)."""
        self.hung_up = asyncio.Event()
        self.step = asyncio.Event()
        self.dropped = 0
        self.loading_sent = 0
        self.prefill_crashes = 0

    @property
    def arrived(self) -> list[Arrived]:
        """The clients' requests that reached it (not the proxy's own questions: ``asked``)."""
        return [a for a in self.everything if not _asked(a)]

    def paths(self) -> list[str]:
        return [a.raw_path for a in self.arrived]

    def asked(self) -> list[str]:
        """The paths of the proxy's own questions (CORS headers, a prompt's token count)."""
        return [a.raw_path for a in self.everything if _asked(a)]

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.everything.append(Arrived(request.method, request.raw_path, list(request.headers.items()), body))
        path = request.query.get("fake", "")
        if path == "hang":
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.hung_up.set()
                raise
        if (path == "drop-once" and not self.dropped) or (path == "drop-twice" and self.dropped < 2):
            self.dropped += 1
            assert request.transport is not None
            request.transport.close()
            await asyncio.get_running_loop().create_future()
        if path == "loading-once" and not self.loading_sent:
            self.loading_sent += 1
            error = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            return web.json_response(error, status=503)
        if path == "short":
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
            await response.prepare(request)
            await response.write(b'{"content"')
            assert request.transport is not None
            request.transport.close()
            return response
        if path == "prefill-crash-once":
            return await self._prefill_crash_once(request)
        if path in ("sse", "cut"):
            return await self._events(request, cut=path == "cut")
        echo = {
            "method": request.method,
            "raw_path": request.raw_path,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
        return web.json_response(echo, headers={"X-Upstream": "yes", "Connection": "keep-alive, X-Private"})

    async def _prefill_crash_once(self, request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if not self.prefill_crashes:
            self.prefill_crashes += 1
            await response.write(b": ping\n\n")  # what llama-server sends while it prefills (no event)
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write(b'data: {"timings": {"cache_n": 7}}\n\n')
        await response.write_eof()
        return response

    async def _events(self, request: web.BaseRequest, *, cut: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            await response.write(f"data: {json.dumps({'n': n})}\n\n".encode())
            if cut:
                if n == 1:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                continue
            self.step.clear()
            await self.step.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclasses.dataclass(slots=True)
class Proxy:
    url: str
    port: int
    gate: gate.Gate
    registry: CollectorRegistry

    def count(self, route: str, outcome: str) -> float:
        value = self.registry.get_sample_value(
            "llama_sidecar_proxy_requests_total", {"route": route, "outcome": outcome}
        )
        return value or 0.0

    def held(self) -> float:
        return self.registry.get_sample_value("llama_sidecar_proxy_hold_seconds_count") or 0.0

    def gauge(self, name: str) -> float:
        return self.registry.get_sample_value(f"llama_sidecar_{name}") or 0.0


@contextlib.asynccontextmanager
async def run_proxy(
    upstream_url: str,
    *,
    hold_seconds: float = 5.0,
    max_body_bytes: int = 1 << 20,
    idle_timeout: float = 75.0,
    max_connections: int = 1000,
    max_inflight_body_bytes: int = 256 << 20,
    body_timeout: float = 60.0,
    admin_token: str | None = None,
    api_key: str | None = None,
    gate_open: bool = True,
    pinner: placing.Pinner | None = None,
    admin_tries: tries.Tries | None = None,
) -> AsyncIterator[Proxy]:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="test")
    restore_gate = gate.Gate()
    if gate_open:
        restore_gate.open(seen_at=time.monotonic())
    upstream = config.UpstreamSettings(url=upstream_url, api_key=api_key, connect_timeout=1.0)
    settings = config.ProxySettings(
        host="127.0.0.1",
        port=0,
        hold_seconds=hold_seconds,
        max_body_bytes=max_body_bytes,
        idle_timeout=idle_timeout,
        max_connections=max_connections,
        max_inflight_body_bytes=max_inflight_body_bytes,
        body_timeout=body_timeout,
    )
    client = listener.client(upstream)
    handler = relay.Relay(
        client=client,
        restore_gate=restore_gate,
        stats=stats,
        upstream=upstream,
        settings=settings,
        admin_token=admin_token,
        pinner=pinner,
        admin_tries=admin_tries,
    )
    proxy = await listener.start(handler, client, settings, stats)
    try:
        yield Proxy(f"http://127.0.0.1:{proxy.port}", proxy.port, restore_gate, registry)
    finally:
        await proxy.close()


async def raw_exchange(port: int, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send raw bytes to the proxy and read its answer until it closes or ``timeout`` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
                    if b"\r\n\r\n" in b"".join(chunks):
                        break
        return b"".join(chunks)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    head = answer.split(b"\r\n", 1)[0].split()
    return int(head[1]) if len(head) > 1 else 0


def json_body(answer: bytes) -> Any:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])
