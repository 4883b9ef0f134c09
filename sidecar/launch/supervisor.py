"""Launcher mode: the sidecar starts llama-server as its child, restarts it when it ends, and stops it last.

Invariants and trade-offs: docs/modules.md, `sidecar/launch/supervisor.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from sidecar.core import metrics, outcomes, protocols
from sidecar.launch import argv, child, restarts

log = structlog.get_logger("sidecar.launcher")

STOP_TIMEOUT = 10.0
"""Seconds llama-server has to exit after SIGTERM before it gets SIGKILL."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChildStatus:
    """What ``/status`` and the page show of the launched llama-server."""

    state: outcomes.ChildState
    program: str
    """The program's file name (its arguments may hold a key: not shown)."""
    pid: int | None
    starts: int
    """Processes started so far."""
    last_exit: str = ""
    """How the last one ended, in words ("" before any end)."""
    last_cause: outcomes.ServerExit | None = None
    last_exit_at: float | None = None
    """Unix time of that end."""
    problem: str = ""
    """Why the launcher stopped restarting it, and what to do ("" unless it gave up)."""


def shown(args: tuple[str, ...]) -> list[str]:
    """``args`` for the log, the values of ``--api-key`` and ``--api-key-file`` blanked."""
    out: list[str] = []
    before = ""
    for arg in args:
        flag, eq, _ = arg.partition("=")
        if before in argv.API_KEYS:
            out.append("***")
        elif eq and flag in argv.API_KEYS:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        before = "" if eq or before in argv.API_KEYS else arg
    return out


class Supervisor:
    def __init__(
        self,
        launch: argv.Launch,
        *,
        stats: metrics.Metrics,
        clock: protocols.Clock | None = None,
        stop_timeout: float = STOP_TIMEOUT,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._launch = launch
        self._stats = stats
        self._clock = clock or protocols.SystemClock()
        self.stop_timeout = stop_timeout
        self._jitter = jitter
        self._child: child.Child | None = None
        self._state = outcomes.ChildState.STARTING
        self._starts = 0
        self._ends: list[float] = []
        self._last: tuple[child.Exit, float] | None = None
        self._problem = ""

    def hurried(self) -> bool:
        """Whether the poller should poll a server that is down or loading at once and often: it is coming up."""
        return self._state is not outcomes.ChildState.GAVE_UP

    def status(self) -> ChildStatus:
        last, at = self._last if self._last is not None else (None, None)
        running = self._child is not None and self._child.running
        return ChildStatus(
            state=self._state,
            program=Path(self._launch.argv[0]).name,
            pid=self._child.pid if self._child is not None and running else None,
            starts=self._starts,
            last_exit=last.describe() if last is not None else "",
            last_cause=last.cause if last is not None else None,
            last_exit_at=at,
            problem=self._problem,
        )

    async def run(self, suspect: Callable[[str], None]) -> None:
        """Start the child, and again each time it ends, until a crash loop; ``suspect``: the restore gate's."""
        log.info(
            "launcher_started",
            argv=shown(self._launch.argv),
            added=shown(self._launch.added),
            server=self._launch.url,
        )
        while True:
            started = self._clock.monotonic()
            end = await self._run_once()
            ran = self._clock.monotonic() - started
            if end.cause is outcomes.ServerExit.STOPPED:
                return  # stopped by stop(): this task is being cancelled anyway
            self._ended(end, ran, suspect)
            verdict = restarts.decide(self._ends, self._clock.monotonic(), jitter=self._jitter())
            if not verdict.restart:
                self._give_up(end, verdict.recent)
                await asyncio.Event().wait()  # the sidecar keeps serving its endpoints until it is stopped
            self._state = outcomes.ChildState.RESTARTING
            log.info("server_restarting", delay_seconds=round(verdict.delay, 3), ends_in_window=verdict.recent)
            await asyncio.sleep(verdict.delay)

    async def _run_once(self) -> child.Exit:
        self._state = outcomes.ChildState.STARTING
        try:
            self._child = await child.Child.start(self._launch.argv, env=dict(self._launch.env))
        except OSError as exc:
            return child.Exit(outcomes.ServerExit.NOT_STARTED, error=exc.strerror or str(exc))
        self._starts += 1
        self._state = outcomes.ChildState.RUNNING
        log.info("server_started", pid=self._child.pid, program=Path(self._launch.argv[0]).name, starts=self._starts)
        return await self._child.wait()

    def _ended(self, end: child.Exit, ran: float, suspect: Callable[[str], None]) -> None:
        now = self._clock.monotonic()
        self._ends = [at for at in self._ends if now - at < restarts.CRASH_LOOP_SECONDS] + [now]
        self._last = (end, time.time())
        self._stats.server_exits.labels(end.cause.value).inc()
        log.error(
            "server_exited",
            cause=end.cause.value,
            exit_code=end.code,
            signal=end.signal,
            error=end.error or None,
            ran_seconds=round(ran, 3),
            effect="the restore gate is closed and proxied requests wait; llama-server is started again, and its "
            "slots are restored before they go on",
            hint=_hint(end),
        )
        suspect(f"llama-server {end.describe()}; the launcher starts it again")

    def _give_up(self, end: child.Exit, count: int) -> None:
        self._state = outcomes.ChildState.GAVE_UP
        self._stats.server_crash_loop.set(1)
        self._problem = (
            f"llama-server ended {count} times within {restarts.CRASH_LOOP_SECONDS:g} s (last: {end.describe()}), "
            "so the launcher stopped restarting it: read its last server_output lines in the sidecar's log, fix "
            "the cause (the model path, an argument, the port, memory), then restart llama-kv-sidecar"
        )
        log.error(
            "server_crash_loop",
            ends=count,
            window_seconds=restarts.CRASH_LOOP_SECONDS,
            last=end.describe(),
            effect="llama-server is not started again; the sidecar keeps serving /status and /metrics, /readyz "
            "answers 503, and proxied requests get 503 once they have waited --proxy-hold-seconds",
            hint="read the server_output lines above for the cause (the model path, an argument, the port, memory), "
            "fix it, then restart llama-kv-sidecar",
        )

    async def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after ``stop_timeout``); called after the final snapshots."""
        running = self._child
        if running is None or not running.running:
            self._state = outcomes.ChildState.STOPPED
            return
        self._state = outcomes.ChildState.STOPPING
        end = await running.stop(self.stop_timeout)
        self._state = outcomes.ChildState.STOPPED
        self._stats.server_exits.labels(outcomes.ServerExit.STOPPED.value).inc()
        self._last = (end, time.time())
        log.info("server_stopped", pid=running.pid, how=end.describe())

    def kill_now(self) -> None:
        """SIGKILL to the child at once (a second signal: the user wants out now)."""
        if self._child is not None:
            self._child.kill()


def _hint(end: child.Exit) -> str:
    if end.cause is outcomes.ServerExit.NOT_STARTED:
        return "check the program after '--': it must be an executable llama-server (a path, or a name on PATH)"
    if end.signal == "SIGKILL":
        return "SIGKILL comes from the kernel's OOM killer (see dmesg) or from someone's kill -9"
    if end.signal is not None:
        return "a crash of llama-server: its last server_output lines above may say where"
    return "its last server_output lines above say why it exited"
