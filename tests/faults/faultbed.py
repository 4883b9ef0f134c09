"""The real sidecar run against a :class:`fakellama.FakeLlama`, in-process or as a subprocess.

In-process (:func:`run_sidecar`): ``app.main(settings, ready=...)`` runs as a
task of the test's event loop, its structlog events are captured with
``structlog.testing.capture_logs``, and its listen port (``port=0``) is read
from its own ``listening`` log line. As a subprocess (:class:`SidecarProcess`):
``python -m sidecar run ... --log-format json``, its stderr kept in a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from sidecar import app, config

T = TypeVar("T")
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


async def eventually(check: Callable[[], Awaitable[T]], *, timeout: float = 5.0, what: str = "") -> T:
    """Await ``check()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or check}: last value {value!r}")
        await asyncio.sleep(0.02)


async def until(check: Callable[[], T], *, timeout: float = 5.0, what: str = "") -> T:
    """Like :func:`eventually` for a plain (non-async) check."""

    async def wrapped() -> T:
        return check()

    return await eventually(wrapped, timeout=timeout, what=what)


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = float(sample.value)
    return out


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample by name (without the ``llama_sidecar_`` prefix) and labels; 0.0 when absent."""
    return samples.get((METRIC_PREFIX + name, frozenset(labels.items())), 0.0)


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

    async def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, text = await self.get("/metrics")
        assert status == 200, text
        return parse_metrics(text)

    async def metric(self, name: str, **labels: str) -> float:
        return sample(await self.metrics(), name, **labels)

    async def status(self) -> dict[str, Any]:
        status, text = await self.get("/status")
        assert status == 200, text
        body: dict[str, Any] = json.loads(text)
        return body

    def events(self, name: str) -> list[MutableMapping[str, Any]]:
        return [e for e in list(self.logs) if e.get("event") == name]

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


class SidecarProcess:
    """``python -m sidecar run`` with JSON logs in a file; its listen port is read from its log."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "run", "--listen", "127.0.0.1:0", "--log-format", "json", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.port = 0

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def logs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for line in self.lines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
        return out

    async def wait_listening(self, timeout: float = 15.0) -> str:
        async def port() -> int:
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self.proc.returncode}:\n" + "\n".join(self.lines()))
            return next((int(e["port"]) for e in self.logs() if e.get("event") == "listening"), 0)

        self.port = await eventually(port, timeout=timeout, what="the sidecar's 'listening' log line")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)
