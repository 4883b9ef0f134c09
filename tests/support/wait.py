"""Waiting for a condition instead of sleeping: one loop for threads, one for event loops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class TimedOut(AssertionError):
    """A condition did not come true in time (an assertion failure of the test that waited)."""


def wait_until(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str,
    every: float = 0.05,
    gone: Callable[[], str | None] | None = None,
) -> T:
    """Call `check()` until it returns something truthy and return that.

    `gone()`, when given, returns a message once waiting is pointless (the
    process that should make the condition true has exited); it is raised at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        if gone is not None and (why := gone()) is not None:
            raise TimedOut(f"{why} while waiting for {what}")
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimedOut(f"timed out after {timeout:g} s waiting for {what}: last value {value!r}")
        time.sleep(every)


async def eventually(check: Callable[[], Awaitable[T]], *, timeout: float = 5.0, what: str = "") -> T:
    """Await `check()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimedOut(f"timed out after {timeout:g} s waiting for {what or check}: last value {value!r}")
        await asyncio.sleep(0.02)


async def until(check: Callable[[], T], *, timeout: float = 5.0, what: str = "") -> T:
    """Like `eventually` for a plain (non-async) check."""

    async def wrapped() -> T:
        return check()

    return await eventually(wrapped, timeout=timeout, what=what)
