"""No task fails unobserved: every task the sidecar starts is awaited, in a TaskGroup, or watched."""

from __future__ import annotations

import ast
import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from sidecar.core import tasks
from sidecar.proxy import conns

SIDECAR = Path(__file__).resolve().parents[2] / "sidecar"

AWAITED = {
    ("library/reads.py", "slots-read-again"): "awaited by _drop, which retrieves its exception",
    ("library/slotbook.py", "placer-early-read"): "its done-callback retrieved retrieves it",
    ("library/filling.py", "placer-fetch"): "awaited by _fetch_in (cancelled if the save fails); retrieved too",
    ("engine/gate.py", "event.wait()"): "cancelled after asyncio.wait; an Event's wait cannot fail",
    ("engine/gate.py", "self._open.wait()"): "cancelled after asyncio.wait; an Event's wait cannot fail",
    ("engine/gate.py", "after"): "the router's load task, made with tasks.watch in router/admission.py",
    ("app/doors.py", "doors-close"): "awaited, shielded, by every Closing.close; the lifecycle's own call after the "
    "task group always awaits it",
}
"""Tasks started outside tasks.watch and TaskGroups, each with who retrieves its outcome."""


def _started() -> list[tuple[str, str, bool, bool]]:
    """Each create_task/ensure_future call: (file, its name or argument, watched or in a group, named)."""
    found = []
    for path in sorted(SIDECAR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        watched = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "watch"
            and ast.unparse(node.func.value) == "tasks"
            and node.args
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr == "shield" and node.args and isinstance(node.args[0], ast.Call):
                inner = node.args[0]  # shield(coroutine()) makes a task of it that outlives a cancelled caller
                ok = isinstance(inner.func, ast.Attribute) and ast.unparse(inner.func) == "tasks.watch"
                found.append((str(path.relative_to(SIDECAR)), ast.unparse(inner), ok, True))
                continue
            if node.func.attr not in ("create_task", "ensure_future"):
                continue
            names = [k.value for k in node.keywords if k.arg == "name"]
            label = ast.unparse(names[0]).strip("'\"f") if names else ast.unparse(node.args[0]) if node.args else ""
            grouped = "group" in ast.unparse(node.func.value)  # asyncio.TaskGroup: a failure ends the group
            found.append((str(path.relative_to(SIDECAR)), label, id(node) in watched or grouped, bool(names)))
    return found


def test_every_task_is_watched_in_a_group_or_awaited_where_said() -> None:
    started = _started()
    assert len(started) >= 15, started  # the scan finds the calls
    loose = [(f, label) for f, label, ok, _ in started if not ok and (f, label) not in AWAITED]
    assert not loose, f"tasks whose failure nobody would see (use tasks.watch): {loose}"
    unnamed = [(f, label) for f, label, _, named in started if not named and (f, label) not in AWAITED]
    assert not unnamed, f"tasks without a name: {unnamed}"
    stale = set(AWAITED) - {(f, label) for f, label, _, _ in started}
    assert not stale, f"AWAITED names tasks no longer started: {stale}"


async def test_a_watched_task_that_fails_is_logged_at_once_and_not_reported_unretrieved() -> None:
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))

    async def fail() -> None:
        raise ValueError("negative file descriptor")

    async def cancelled() -> None:
        await asyncio.sleep(3600)

    with structlog.testing.capture_logs() as logs:
        failing = tasks.watch(asyncio.create_task(fail(), name="probe-under-test"), effect="costs this")
        sleeping = tasks.watch(asyncio.create_task(cancelled(), name="cancelled-under-test"), effect="nothing")
        await asyncio.wait({failing})
        sleeping.cancel()
        await asyncio.wait({sleeping})
        await asyncio.sleep(0)  # the done-callbacks run
    del failing, sleeping
    gc.collect()
    loop.set_exception_handler(None)
    failed = [entry for entry in logs if entry["event"] == "task_failed"]
    assert len(failed) == 1, logs
    assert failed[0]["task"] == "probe-under-test"
    assert failed[0]["error"] == "ValueError: negative file descriptor"
    assert "test_tasks.py" in failed[0]["raised_at"]
    assert failed[0]["effect"] == "costs this"
    assert not unretrieved, unretrieved


class _GoneSocket:
    def getsockopt(self, level: int, option: int) -> int:
        raise ValueError("negative file descriptor")  # uvloop's socket once its descriptor is closed


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str) -> Any:
        return _GoneSocket() if name == "socket" else None

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True


async def test_the_half_closed_client_probe_takes_a_socket_gone_under_it_for_a_client_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(conns, "PROBE", 0.0)
    registry = CollectorRegistry()
    server = conns.Server(
        lambda request: None,
        max_connections=4,
        opened=Gauge("opened", "", registry=registry),
        refused=Counter("refused", "", registry=registry),
    )
    protocol = server()
    transport = _Transport()
    protocol.transport = transport  # type: ignore[assignment]
    async with asyncio.timeout(5):
        await protocol._watch()  # the probe loop itself, against a socket closed under it
    assert transport.aborted
