"""The sidecar's own HTTP endpoints (aiohttp).

``/metrics`` (Prometheus), ``/healthz`` (the process is alive and its poll
loop makes progress: a kubelet liveness probe restarts a stuck sidecar),
``/readyz`` (llama-server healthy and readable with our key, the slot dir
writable and linked, and no restore round owed or running: the restore
gate open), ``/status`` (JSON for humans and scripts; optionally behind
the admin token), ``/`` (the status page for people: HTML, the same
access as ``/status``). ``POST /snapshot`` and ``POST /restore`` exist
only with an admin token and answer 401 without it.

Handlers read the engine through ``report.Engines`` only: one frozen
``report.Status`` per request, and the two admin actions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import math
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import sidecar
from sidecar.app import figures, history, page, view
from sidecar.core import config, events, parse, protocols, tries
from sidecar.engine import lifecycle, report
from sidecar.launch import supervisor
from sidecar.snapshots import store

log = structlog.get_logger("sidecar.server")


class SharedView(Protocol):
    """What the page shows of the shared store (``shared.service.SharedStore``)."""

    def describe(self) -> str: ...

    def waiting(self) -> frozenset[str]:
        """Files still waiting for their upload."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class _Context:
    engines: report.Engines
    snapshots: store.SnapshotStore
    registry: CollectorRegistry
    settings: config.ServerSettings
    liveness: report.Liveness
    clock: protocols.Clock
    history: history.History
    caps: tuple[int, int]
    """--max-bytes and --min-free-bytes, for the page's disk figures."""
    shared: SharedView | None
    tries: tries.Tries
    """Failed admin-token tries per client address (see :mod:`sidecar.core.tries`)."""
    launcher: Callable[[], supervisor.ChildStatus] | None = None
    """Launcher mode: what the sidecar knows of the llama-server it started."""
    staging: tuple[str, str] = ("", "")
    """Where llama-server saves (``ram``, ``disk``, ``given`` or ""), and what staging on disk costs."""


CONTEXT_KEY: web.AppKey[_Context] = web.AppKey("context")


def make_app(
    *,
    engines: report.Engines,
    snapshots: store.SnapshotStore,
    registry: CollectorRegistry,
    settings: config.ServerSettings,
    liveness: report.Liveness,
    clock: protocols.Clock | None = None,
    samples: history.History | None = None,
    caps: tuple[int, int] = (0, 0),
    shared: SharedView | None = None,
    launcher: Callable[[], supervisor.ChildStatus] | None = None,
    staging: tuple[str, str] = ("", ""),
) -> web.Application:
    app = web.Application(client_max_size=64 << 10)
    app[CONTEXT_KEY] = _Context(
        engines,
        snapshots,
        registry,
        settings,
        liveness,
        clock or protocols.SystemClock(),
        samples or history.History(),
        caps,
        shared,
        tries.Tries(),
        launcher,
        staging,
    )
    app.router.add_get("/", _page)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/status", _status)
    app.router.add_post("/snapshot", _snapshot)
    app.router.add_post("/restore", _restore)
    return app


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[CONTEXT_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    stuck = ctx.liveness.stall(ctx.engines.status(), ctx.clock.monotonic())
    if stuck:
        return web.json_response({"status": "stuck", "problem": stuck}, status=503)
    return web.json_response({"status": "ok"})


def _readiness(ctx: _Context, st: report.Status) -> list[str]:
    problems: list[str] = []
    stuck = ctx.liveness.stall(st, ctx.clock.monotonic())
    if stuck:
        problems.append(stuck)
    latest = st.observation
    if latest is None or latest.health is not events.Health.OK:
        problems.append(
            f"llama-server at {st.server_url} is not healthy: " + (latest.problem if latest else "not polled yet")
        )
    elif latest.denied:
        problems.append(
            f"llama-server at {st.server_url} refuses the sidecar ({'; '.join(latest.denied)}): give the sidecar "
            "one of llama-server's API keys (--api-key-file / LLAMA_API_KEY_FILE, or --api-key / LLAMA_API_KEY)"
        )
    writable = ctx.snapshots.disk.check_writable()
    if writable:
        problems.append(writable)
    if st.link_ok is False:
        problems.append(st.link_problem)
    if st.restore_gate:
        problems.append(lifecycle.problem(st.restore_gate))
    if ctx.launcher is not None and (gave_up := ctx.launcher().problem):
        problems.append(gave_up)
    return problems


async def _readyz(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    problems = _readiness(ctx, ctx.engines.status())
    return web.json_response({"ready": not problems, "problems": problems}, status=503 if problems else 200)


async def _status(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    if ctx.settings.status_requires_token and (denied := _authorized(request)) is not None:
        return denied
    st = ctx.engines.status()
    latest = st.observation
    usage = await asyncio.to_thread(ctx.snapshots.disk.usage)
    by_slot: dict[str, list[dict[str, Any]]] = {}
    for m in ctx.snapshots.snapshots():
        by_slot.setdefault(str(m.slot), []).append(
            {"file": m.file, "tokens": m.tokens, "bytes": m.bytes, "created": m.created}
        )
    body: dict[str, Any] = {
        "server": {
            "url": st.server_url,
            "health": latest.health.value if latest else "unknown",
            "problem": latest.problem if latest else "",
            "denied": list(latest.denied) if latest else [],
            "identity": dataclasses.asdict(st.identity) if st.identity else None,
            "memory": st.identity.memory.value if st.identity and st.identity.memory else "unknown",
            "slot_dir_linked": st.link_ok,
        },
        "loop": {
            "seconds_since_progress": round(ctx.clock.monotonic() - st.progress_at, 3),
            "acting": st.acting,
            "allowed_seconds": ctx.liveness.bound(st),
        },
        "slots": [dataclasses.asdict(v) for v in (latest.slots or ())] if latest else [],
        "snapshots": by_slot,
        "last_snapshot": dataclasses.asdict(st.last_snapshot) if st.last_snapshot else None,
        "last_restore": [dataclasses.asdict(r) for r in st.last_restore],
        "disk": dataclasses.asdict(usage),
        "staging": {
            "slot_dir": str(ctx.snapshots.staging),
            "where": ctx.staging[0] or None,
            "cost": ctx.staging[1] or None,
        },
        "time_saved": {
            "prefill_seconds": round(st.saved.seconds, 3),
            "tokens": st.saved.tokens,
            "by": {word: round(seconds, 3) for word, seconds in st.saved.by},
            "prefill_rate_tokens_per_second": None if st.saved.rate is None else round(st.saved.rate, 1),
            "unpriced_tokens": st.saved.unpriced_tokens,
        },
        "launcher": dataclasses.asdict(ctx.launcher()) if ctx.launcher is not None else None,
        "ready": not _readiness(ctx, st),
    }
    return web.json_response(body)


async def _page(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    if ctx.settings.status_requires_token and (denied := _authorized(request)) is not None:
        return denied
    st = ctx.engines.status()
    usage = await asyncio.to_thread(ctx.snapshots.disk.usage)
    inputs = view.Inputs(
        status=st,
        library=[(m, ctx.snapshots.last_used(m.file)) for m in ctx.snapshots.library()],
        usage=usage,
        max_bytes=ctx.caps[0],
        min_free_bytes=ctx.caps[1],
        figures=figures.read(ctx.registry, st),
        samples=ctx.history.samples(),
        now=ctx.clock.wall(),
        shared=ctx.shared.describe() if ctx.shared is not None else None,
        waiting=ctx.shared.waiting() if ctx.shared is not None else frozenset(),
        version=sidecar.__version__,
        launcher=ctx.launcher() if ctx.launcher is not None else None,
        staging=(str(ctx.snapshots.staging), *ctx.staging),
    )
    return web.Response(
        text=page.render(view.build(inputs)),
        content_type="text/html",
        headers={"Cache-Control": "no-store", "Content-Security-Policy": page.CSP, "X-Content-Type-Options": "nosniff"},
    )


def _authorized(request: web.Request) -> web.Response | None:
    """None when the request carries the admin token (``Authorization: Bearer``, scheme in any case).

    An address that sent wrong tokens too often waits (429, unread) before its next try is compared.
    """
    ctx = request.app[CONTEXT_KEY]
    token = ctx.settings.admin_token
    if not token:
        return web.json_response({"error": "admin endpoints are off: start the sidecar with --admin-token"}, status=403)
    address, now = request.remote or "", ctx.clock.monotonic()
    if (wait := ctx.tries.wait(address, now)) > 0:
        return _slow_down(address, wait)
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    # A byte that is not UTF-8 arrives as a lone surrogate (aiohttp decodes with surrogateescape): it is
    # compared as the byte it was, so a bad header is a wrong token (401), never an error.
    offered = given.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(offered, token.encode("utf-8", "surrogateescape")):
        if (wait := ctx.tries.failed(address, now)) > 0:
            log.warning(
                "admin_token_tries_slowed",
                address=address,
                failures=ctx.tries.failures(address),
                wait_seconds=round(wait, 1),
                effect="this address's requests that need the admin token are refused (429) until the wait is over; "
                f"each further wrong token doubles it, up to {ctx.tries.cap:g} s",
                hint="a client with an old or mistyped token, or someone guessing it: check the callers at this "
                "address; the right token clears it",
            )
        return web.json_response({"error": "missing or wrong 'Authorization: Bearer <admin token>'"}, status=401)
    ctx.tries.succeeded(address)
    return None


def _slow_down(address: str, wait: float) -> web.Response:
    seconds = math.ceil(wait)
    body = {
        "error": f"too many wrong admin tokens from {address}: this request was not read; try again in {seconds} s "
        "with the right 'Authorization: Bearer <admin token>'"
    }
    return web.json_response(body, status=429, headers={"Retry-After": str(seconds)})


def _slot_param(request: web.Request) -> int | None:
    raw = request.query.get("slot")
    if raw is None or len(raw) > 4:
        return None
    try:
        return parse.integer(raw)
    except ValueError:
        return None


async def _snapshot(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    slot = _slot_param(request)
    reply = await request.app[CONTEXT_KEY].engines.save_now(slot) if slot is not None else None
    if reply is None:
        return web.json_response({"error": "give ?slot=N of a slot that holds tokens"}, status=400)
    record = dataclasses.asdict(reply.record) if reply.record else None
    return web.json_response({"ok": reply.ok, "result": record}, status=200 if reply.ok else 500)


async def _restore(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    records = await request.app[CONTEXT_KEY].engines.restore_now()
    return web.json_response({"results": [dataclasses.asdict(r) for r in records]})


@dataclasses.dataclass(slots=True)
class Handle:
    runner: web.AppRunner
    host: str
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(app: web.Application, settings: config.ServerSettings) -> Handle:
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    sockets = runner.addresses
    port = sockets[0][1] if sockets else settings.port
    return Handle(runner, settings.host, int(port))
