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

from sidecar.core import errors, metrics, outcomes, protocols, tasks
from sidecar.launch import argv, child, restarts

log = structlog.get_logger("sidecar.launcher")

STOP_TIMEOUT = 10.0
"""Seconds llama-server has to exit after SIGTERM before it gets SIGKILL."""
SERVING_CHECK = 0.25
"""Seconds between two looks at the restore gate's openings while a run has not served yet."""


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
    """Why it does not come up, and what to do ("" unless it is in a crash loop, or never came up)."""


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
        self._history = restarts.History()
        self._looping = False
        """A crash loop was said and the server has not served since."""
        self._tail: tuple[str, ...] = ()
        """The last run's last stderr lines."""
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

    async def run(self, suspect: Callable[[str], None], openings: Callable[[], int] = lambda: 0) -> None:
        """Start the child, and again each time it ends (see :mod:`~sidecar.launch.restarts`).

        ``suspect``: the restore gate's; ``openings``: how many times the gate has opened (a run during which
        it opened served). Raises :class:`errors.ServerNotStarted` when the server never served and cannot
        come up: the sidecar ends with it.
        """
        log.info(
            "launcher_started",
            argv=shown(self._launch.argv),
            added=shown(self._launch.added),
            server=self._launch.url,
        )
        while True:
            started = self._clock.monotonic()
            end, served = await self._run_once(openings)
            ran = self._clock.monotonic() - started
            if end.cause is outcomes.ServerExit.STOPPED:
                return  # stopped by stop(): this task is being cancelled anyway
            self._ended(end, ran, suspect)
            run = restarts.Run(ran=ran, served=served, killed=end.signal == "SIGKILL")
            self._history = restarts.after(self._history, run)
            verdict = restarts.decide(self._history, run, jitter=self._jitter())
            if verdict.step is restarts.Step.END:
                raise self._not_started(end)
            if verdict.looping and not self._looping:
                self._crash_loop(end)
            self._state = outcomes.ChildState.RESTARTING
            log.info("server_restarting", delay_seconds=round(verdict.delay, 3), short_runs=self._history.short)
            await asyncio.sleep(verdict.delay)

    async def _run_once(self, openings: Callable[[], int]) -> tuple[child.Exit, bool]:
        """One run: how it ended, and whether the restore gate opened meanwhile (it served)."""
        self._state = outcomes.ChildState.STARTING
        self._tail = ()
        try:
            self._child = await child.Child.start(self._launch.argv, env=dict(self._launch.env))
        except OSError as exc:
            return child.Exit(outcomes.ServerExit.NOT_STARTED, error=exc.strerror or str(exc)), False
        self._starts += 1
        self._state = outcomes.ChildState.RUNNING
        log.info("server_started", pid=self._child.pid, program=Path(self._launch.argv[0]).name, starts=self._starts)
        before = openings()
        watching = tasks.watch(
            asyncio.create_task(self._watch_serving(openings, before), name="launcher-serving"),
            effect="a crash loop this run ends is not said to be over until the next run serves",
        )
        try:
            end = await self._child.wait()
        finally:
            watching.cancel()
        self._tail = tuple(self._child.tail)
        return end, openings() != before

    async def _watch_serving(self, openings: Callable[[], int], before: int) -> None:
        """Once the gate opens during this run: a crash loop it ends is said to be over."""
        # A look at a counter: waiting on the gate itself would count as a held request in its restore round.
        while openings() == before:  # noqa: ASYNC110
            await asyncio.sleep(SERVING_CHECK)
        if self._looping:
            self._looping = False
            self._problem = ""
            self._stats.server_crash_loop.set(0)
            log.info("server_crash_loop_over", effect="llama-server serves again; the backoff ends once it stays up")

    def _ended(self, end: child.Exit, ran: float, suspect: Callable[[str], None]) -> None:
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

    def _crash_loop(self, end: child.Exit) -> None:
        """The runs ended before serving :data:`restarts.CRASH_LOOP_EXITS` times in a row (it had served before)."""
        self._looping = True
        self._stats.server_crash_loop.set(1)
        self._problem = (
            f"llama-server ended {self._history.unserved} times in a row before serving (last: {end.describe()}); "
            f"the launcher keeps starting it, at most {restarts.MAX_DELAY:g} s apart: read its last server_output "
            "lines in the sidecar's log and fix the cause (the model path, the port, memory)"
        )
        log.error(
            "server_crash_loop",
            ends=self._history.unserved,
            last=end.describe(),
            last_lines=list(self._tail),
            effect="llama-server does not come up; the launcher keeps starting it (it served before), at most "
            f"{restarts.MAX_DELAY:g} s apart; /readyz answers 503 and proxied requests wait up to "
            "--proxy-hold-seconds",
            hint="read the server_output lines above for the cause (the model path, the port, memory) and fix it: "
            "the next start that serves ends this",
        )

    def _not_started(self, end: child.Exit) -> errors.ServerNotStarted:
        """The sidecar ends: llama-server never served and cannot come up."""
        self._state = outcomes.ChildState.GAVE_UP
        self._stats.server_crash_loop.set(1)
        code = end.code if end.code else 1
        said = " | ".join(self._tail) if self._tail else "(nothing on its stderr)"
        tries = "" if self._history.runs == 1 else f" ({self._history.runs} starts)"
        self._problem = f"llama-server {end.describe()} before it ever served{tries}; its last lines: {said}"
        log.error(
            "server_not_started",
            last=end.describe(),
            starts=self._history.runs,
            last_lines=list(self._tail),
            exit_code=code,
            effect=f"the sidecar stops and exits with status {code}: llama-server never came up",
            hint="read its last lines (an argument, the model path, the port taken, memory), fix the cause, then "
            "start llama-kv-sidecar again",
        )
        return errors.ServerNotStarted(self._problem, exit_code=code)

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
