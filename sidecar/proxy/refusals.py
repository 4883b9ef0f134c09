"""The proxy's own error answers, in llama-server's (OpenAI-style) shape, so clients show the message.

Each says what was refused, why, and what to do about it. Pure: builds
responses, holds no state (the relay counts and logs them).
"""

from __future__ import annotations

import math

from aiohttp import web

from sidecar.proxy import predict, routes

ADMIN_HINT = "Send 'Authorization: Bearer <sidecar admin token>' to pass one through anyway."
BAD_PATH = (
    "the proxy does not forward this path: it decodes to characters no llama-server route holds "
    "(an escaped '%', backslash, NUL, space, '?' or non-ASCII byte), has '.'/'..' segments, starts "
    "with '//', or is not an origin-form target"
)


def error(status: int, message: str, kind: str, *, headers: dict[str, str] | None = None) -> web.Response:
    """An error in llama-server's (OpenAI-style) shape, so clients show the message."""
    body = {"error": {"code": status, "message": message, "type": kind}}
    return web.json_response(body, status=status, headers=headers)


def bad_path(target: str) -> web.Response:
    """A target the proxy does not forward: llama-server's own ``404`` for a path (no route of its holds it, and
    its handler for unknown paths answers so: ``server-http.cpp``), a ``400`` for a target that is no path."""
    if target.startswith("/"):
        return not_found()
    return error(400, BAD_PATH, "invalid_request_error")


def not_found() -> web.Response:
    """llama-server's answer to a path it has no route for, byte for byte (``server-http.cpp``'s error handler)."""
    body = b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
    return web.Response(status=404, body=body, content_type="application/json", charset="utf-8")


def refused(kind: routes.Request) -> web.Response:
    """A slot action or a write to a path llama-server has no route for, without the admin token."""
    if kind.verdict is routes.Verdict.SLOT_ACTION:
        message = (
            "slot actions (POST /slots/...) are reserved to llama-kv-sidecar: they would overwrite, restore or "
            "erase the snapshots it keeps. " + ADMIN_HINT
        )
    else:
        message = (
            f"the proxy forwards writes only to llama-server's own routes, and {kind.path} (as llama-server "
            "decodes it) is none of them: the path is spelled differently from the route, or the method is "
            "not the route's. " + ADMIN_HINT
        )
    return error(403, message, "permission_error")


def predict_refused(found: predict.Check) -> web.Response:
    why = {
        predict.Check.SLOT_ACTION: "an instance's @requestFormat is a slot action (slots, /slots/:id_slot), "
        "which would overwrite, restore or erase the snapshots llama-kv-sidecar keeps",
        predict.Check.UNKNOWN: "an instance's @requestFormat names no route the proxy forwards",
        predict.Check.UNREADABLE: "the body is not a JSON object with an 'instances' list of objects that each "
        "give '@requestFormat' as a string, read the same by the proxy and llama-server (no duplicate keys)",
    }[found]
    return error(403, f"POST /predict refused: {why}. {ADMIN_HINT}", "permission_error")


def unauthorized() -> web.Response:
    """A write without one of llama-server's API keys: refused before anything reads it, as llama-server would."""
    message = (
        "Invalid API Key: send one of llama-server's API keys as 'Authorization: Bearer <key>' (or 'X-Api-Key'); "
        "the proxy checks it before it reads the request"
    )
    return error(401, message, "authentication_error")


def slow_down(address: str, wait: float) -> web.Response:
    """An admin-only request from an address that sent wrong admin tokens too often: refused unread."""
    seconds = math.ceil(wait)
    message = (
        f"too many wrong admin tokens from {address}: this request was not read; try again in {seconds} s "
        "with the right 'Authorization: Bearer <sidecar admin token>'"
    )
    return error(429, message, "rate_limit_error", headers={"Retry-After": str(seconds)})


def too_big(limit: int) -> web.Response:
    message = f"request body over {limit} bytes: raise --proxy-max-body-bytes if such requests are expected"
    return error(413, message, "invalid_request_error")


def busy(used: int, cap: int) -> web.Response:
    message = (
        f"the proxy holds {used} bytes of request bodies now and this one would take it over "
        f"--proxy-max-inflight-body-bytes ({cap}); retry shortly, or raise the cap if the host has the memory"
    )
    return error(503, message, "unavailable_error", headers={"Retry-After": "1"})


def too_slow(timeout: float, received: int) -> web.Response:
    message = (
        f"request body not received in full within {timeout:g} s ({received} bytes arrived): send it "
        "faster, or raise --proxy-body-timeout"
    )
    return error(408, message, "invalid_request_error", headers={"Connection": "close"})


def unreachable(exc: BaseException) -> web.Response:
    return error(502, f"the proxy could not get an answer from llama-server: {exc}", "server_error")
