"""Tasks nobody awaits: a done-callback retrieves each one's outcome and logs a failure at once.

A task that fails while nobody holds its result is reported by asyncio only
when it is garbage-collected, as ``Task exception was never retrieved``: late,
on stderr, outside the structured log, and without saying what the task was
for. So every task the sidecar starts is awaited, runs in a ``TaskGroup``, or
is passed to :func:`watch`, which logs its failure as ``task_failed`` with the
task's name and what the failure costs. A cancelled task is not a failure.

The log line carries the exception's type, message and the place it was
raised, never a traceback with local variables (they may hold secrets).
"""

from __future__ import annotations

import asyncio
import functools
import traceback
from typing import TypeVar

import structlog

log = structlog.get_logger("sidecar.tasks")

T = TypeVar("T")


def watch(task: asyncio.Task[T], *, effect: str) -> asyncio.Task[T]:
    """``task``, with a done-callback that logs its failure; ``effect``: what the failure costs, in words."""
    task.add_done_callback(functools.partial(_retrieve, effect=effect))
    return task


def _retrieve(task: asyncio.Task[T], *, effect: str) -> None:
    if task.cancelled():
        return
    exc = task.exception()  # retrieved: asyncio no longer reports it as never retrieved
    if exc is None:
        return
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown"
    log.error(
        "task_failed",
        task=task.get_name(),
        error=f"{type(exc).__name__}: {exc}",
        raised_at=where,
        effect=effect,
        hint="this is a fault of the sidecar, not of the setup: report it with this line",
    )
