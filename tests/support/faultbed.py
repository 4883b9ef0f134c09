"""The real sidecar run in-process against a :class:`tests.support.fakellama.FakeLlama`.

:func:`run_sidecar`: ``app.main(settings, ready=...)`` runs as a task of the
test's event loop, its structlog events are captured with
``structlog.testing.capture_logs``, and its listen port (``port=0``) is read
from its own ``listening`` log line. As a subprocess, the sidecar is
:class:`tests.support.sidecarbed.SidecarProcess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from sidecar.app import run as app
from sidecar.core import config
from tests.support.readers import Samples, parse_metrics, sample

METRIC_PREFIX = "llama_sidecar_"


def make_settings(
    server_url: str,
    slot_dir: Path,
    *,
    api_key: str | None = None,
    admin_token: str | None = None,
    request_timeout: float = 0.5,
    action_timeout: float = 5.0,
    interval: float = 0.05,
    down_interval: float = 0.05,
    idle_seconds: float = 0.0,
    min_tokens: int = 10,
) -> config.Settings:
    """Settings for fast tests: short polls and timeouts, saves as soon as a slot is idle."""
    return config.Settings(
        upstream=config.UpstreamSettings(
            url=server_url,
            api_key=api_key,
            request_timeout=request_timeout,
            action_timeout=action_timeout,
            connect_timeout=request_timeout,
        ),
        poll=config.PollSettings(interval=interval, down_interval=down_interval),
        snapshots=config.SnapshotSettings(
            slot_dir=slot_dir, idle_seconds=idle_seconds, min_tokens=min_tokens, min_free_bytes=0, final_timeout=1.0
        ),
        server=config.ServerSettings(host="127.0.0.1", port=0, admin_token=admin_token),
    )


def with_proxy(settings: config.Settings, *, hold_seconds: float = 30.0) -> config.Settings:
    """The same settings with the proxy on, on a free loopback port (see :meth:`Sidecar.proxy_url`)."""
    return dataclasses.replace(
        settings, proxy=config.ProxySettings(host="127.0.0.1", port=0, hold_seconds=hold_seconds)
    )


def open_sockets(pid: int | str = "self") -> int:
    """Sockets among the open file descriptors of a process (this one by default)."""
    count = 0
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            if os.readlink(fd_dir / fd).startswith("socket:"):
                count += 1
    return count


@dataclasses.dataclass(slots=True)
class Sidecar:
    """A running sidecar and an HTTP client for its endpoints."""

    url: str
    task: asyncio.Task[None] | None
    logs: list[MutableMapping[str, Any]]
    session: aiohttp.ClientSession

    async def request(self, method: str, path: str, **kwargs: Any) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=5)
        async with self.session.request(method, self.url + path, timeout=timeout, **kwargs) as resp:
            return resp.status, await resp.text()

    async def get(self, path: str) -> tuple[int, str]:
        return await self.request("GET", path)

    async def metrics(self) -> Samples:
        status, text = await self.get("/metrics")
        assert status == 200, text
        return parse_metrics(text)

    async def metric(self, name: str, **labels: str) -> float:
        """One sample by name (without the ``llama_sidecar_`` prefix) and labels; 0.0 when absent."""
        return sample(await self.metrics(), METRIC_PREFIX + name, **labels)

    async def status(self) -> dict[str, Any]:
        status, text = await self.get("/status")
        assert status == 200, text
        body: dict[str, Any] = json.loads(text)
        return body

    def events(self, name: str) -> list[MutableMapping[str, Any]]:
        return [e for e in list(self.logs) if e.get("event") == name]

    @property
    def proxy_url(self) -> str:
        """The proxy's address, from its ``proxy_listening`` log line (settings made :func:`with_proxy`)."""
        port = next(int(e["port"]) for e in self.events("proxy_listening"))
        return f"http://127.0.0.1:{port}"

    def alive(self) -> bool:
        return self.task is None or not self.task.done()


@contextlib.asynccontextmanager
async def run_sidecar(settings: config.Settings) -> AsyncIterator[Sidecar]:
    """Run ``app.main`` in this loop; yield once it listens; cancel it (final snapshots included) on exit."""
    with structlog.testing.capture_logs() as logs:
        ready = asyncio.Event()
        task = asyncio.create_task(app.main(settings, ready=ready), name="sidecar-under-test")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # raises what app.main raised
            raise AssertionError("app.main returned before it was ready")
        assert ready.is_set(), "the sidecar did not get ready within 10 s"
        port = next(int(e["port"]) for e in logs if e.get("event") == "listening")
        try:
            async with aiohttp.ClientSession() as session:
                yield Sidecar(f"http://127.0.0.1:{port}", task, logs, session)
        finally:
            crashed = task.done() and not task.cancelled() and task.exception() is not None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        if crashed:
            raise AssertionError("the sidecar task crashed") from task.exception()
