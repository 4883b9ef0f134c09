"""The sidecar's own HTTP endpoints (aiohttp).

``/metrics`` (Prometheus), ``/healthz`` (the process is alive and its loop
turns), ``/readyz`` (llama-server reachable and the slot dir writable and
linked), ``/status`` (JSON for humans and scripts). ``POST /snapshot`` and
``POST /restore`` exist only with an admin token and answer 401 without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar import config, engine, events, policy, store

ENGINE_KEY = web.AppKey("engine", engine.Engine)
STORE_KEY = web.AppKey("store", store.SnapshotStore)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
TOKEN_KEY = web.AppKey("token", str)


def make_app(
    *, core: engine.Engine, snapshots: store.SnapshotStore, registry: CollectorRegistry, admin_token: str | None
) -> web.Application:
    app = web.Application(client_max_size=64 << 10)
    app[ENGINE_KEY] = core
    app[STORE_KEY] = snapshots
    app[REGISTRY_KEY] = registry
    app[TOKEN_KEY] = admin_token or ""
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/status", _status)
    app.router.add_post("/snapshot", _snapshot)
    app.router.add_post("/restore", _restore)
    return app


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _readiness(app: web.Application) -> list[str]:
    core, snaps = app[ENGINE_KEY], app[STORE_KEY]
    problems: list[str] = []
    latest = core.latest
    if latest is None or latest.health is not events.Health.OK:
        problems.append(
            f"llama-server at {core.server_url} is not healthy: " + (latest.problem if latest else "not polled yet")
        )
    writable = snaps.check_writable()
    if writable:
        problems.append(writable)
    if core.link_ok is False:
        problems.append(core.link_problem)
    return problems


async def _readyz(request: web.Request) -> web.Response:
    problems = _readiness(request.app)
    return web.json_response({"ready": not problems, "problems": problems}, status=503 if problems else 200)


async def _status(request: web.Request) -> web.Response:
    core, snaps = request.app[ENGINE_KEY], request.app[STORE_KEY]
    latest = core.latest
    usage = await asyncio.to_thread(snaps.usage)
    by_slot: dict[str, list[dict[str, Any]]] = {}
    for m in snaps.snapshots():
        by_slot.setdefault(str(m.slot), []).append(
            {"file": m.file, "tokens": m.tokens, "bytes": m.bytes, "created": m.created}
        )
    body: dict[str, Any] = {
        "server": {
            "url": core.server_url,
            "health": latest.health.value if latest else "unknown",
            "problem": latest.problem if latest else "",
            "identity": dataclasses.asdict(core.identity) if core.identity else None,
            "slot_dir_linked": core.link_ok,
        },
        "slots": [dataclasses.asdict(v) for v in (latest.slots or ())] if latest else [],
        "snapshots": by_slot,
        "last_snapshot": dataclasses.asdict(core.saver.last) if core.saver.last else None,
        "last_restore": [dataclasses.asdict(r) for r in core.restorer.last],
        "disk": dataclasses.asdict(usage),
        "ready": not _readiness(request.app),
    }
    return web.json_response(body)


def _authorized(request: web.Request) -> web.Response | None:
    token = request.app[TOKEN_KEY]
    if not token:
        return web.json_response({"error": "admin endpoints are off: start the sidecar with --admin-token"}, status=403)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        return web.json_response({"error": "missing or wrong 'Authorization: Bearer <admin token>'"}, status=401)
    return None


def _slot_param(request: web.Request) -> int | None:
    raw = request.query.get("slot")
    if raw is None or not raw.isdigit() or len(raw) > 4:
        return None
    return int(raw)


async def _snapshot(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    core = request.app[ENGINE_KEY]
    slot = _slot_param(request)
    latest = core.latest
    view = latest.slot(slot) if latest is not None and slot is not None else None
    if view is None or view.signature is None:
        return web.json_response({"error": "give ?slot=N of a slot that holds tokens"}, status=400)
    ok = await core.save(policy.Save(view.id, view.signature, view.tokens, policy.SaveReason.MANUAL))
    last = core.saver.last
    return web.json_response(
        {"ok": ok, "result": dataclasses.asdict(last) if last else None}, status=200 if ok else 500
    )


async def _restore(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    core = request.app[ENGINE_KEY]
    records = await core.restore_now()
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
