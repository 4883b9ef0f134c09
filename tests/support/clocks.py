"""Clocks for the tests (``protocols.Clock``), beside ``protocols.SystemClock``."""

from __future__ import annotations

import time
from collections.abc import Callable


class Wall:
    """The wall clock ``read`` gives (a fixed time, or a counter); the monotonic clock is the system's."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read

    def wall(self) -> float:
        return self._read()

    def monotonic(self) -> float:
        return time.monotonic()
