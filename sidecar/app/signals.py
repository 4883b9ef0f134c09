"""SIGTERM and SIGINT: the stop flag, and the deadline past which the process ends whatever hangs.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable

import structlog

from sidecar.core import config
from sidecar.launch import supervisor

log = structlog.get_logger("sidecar.app")

EXIT_MARGIN = 5.0
"""Seconds past --final-timeout a signalled process may take to close its servers before it is ended."""
EXIT_STATUS_FORCED = 1


def stop_on_signals(settings: config.Settings, launcher: supervisor.Supervisor | None) -> asyncio.Event:
    """The event SIGTERM and SIGINT set (see :func:`on_signal`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    budget = settings.snapshots.final_timeout + EXIT_MARGIN + (launcher.stop_timeout if launcher else 0.0)
    at_once = functools.partial(_exit_at_once, launcher) if launcher is not None else None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, stop, budget, at_once)
    return stop


def on_signal(stop: asyncio.Event, budget: float, at_once: Callable[[], None] | None = None) -> None:
    """Stop the task group, and make sure the process ends within ``budget`` seconds whatever hangs.

    A second signal calls ``at_once`` (launcher mode: stop now), else it is ignored.
    """
    if stop.is_set():
        if at_once is not None:
            at_once()
        return
    stop.set()
    timer = threading.Timer(budget, _force_exit, args=(budget,))
    timer.daemon = True  # a process that ends in time does not wait for it
    timer.name = "exit deadline"
    timer.start()


def _force_exit(budget: float) -> None:
    stuck = sorted(t.name for t in threading.enumerate() if t.is_alive() and t is not threading.current_thread())
    log.error(
        "exit_forced",
        seconds=budget,
        threads=stuck,
        effect=f"the process exits now with status {EXIT_STATUS_FORCED}, {budget:g} s after the signal "
        "(--final-timeout plus the margin to close its servers); snapshots committed before stay good",
        hint="a worker thread was blocked, most likely reading the slot dir: check its disk or mount",
    )
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_STATUS_FORCED)


def _exit_at_once(launcher: supervisor.Supervisor) -> None:
    """A second signal in launcher mode: llama-server is killed, and the sidecar exits now."""
    log.warning(
        "exit_at_once",
        effect=f"llama-server is killed and the process exits now with status {EXIT_STATUS_FORCED}: slots whose "
        "final snapshot had not been committed are not saved (the snapshots committed before stay good)",
        hint="send one signal and wait for the final snapshots (--final-timeout) to keep every slot",
    )
    launcher.kill_now()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_STATUS_FORCED)
