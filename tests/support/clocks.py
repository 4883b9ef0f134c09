"""The tests' one clock: ``FakeClock`` satisfies ``protocols.Clock`` and moves only when told to."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sidecar.core import protocols

EPOCH = 1_764_000_000.0
"""What ``wall()`` adds to ``now`` by default: a plausible Unix time."""


@dataclasses.dataclass
class FakeClock:
    """Time the test sets (``clock.now = ...``) or moves (``clock.advance(s)``).

    ``monotonic()`` reads ``now`` and ``wall()`` reads ``epoch + now``. ``source``, when
    given, is read in place of ``now`` (a counter, a fixed time, a model's time). ``tick``
    moves ``now`` on before each wall reading, so that every commit gets a name of its own.
    """

    now: float = 100.0
    epoch: float = EPOCH
    tick: float = 0.0
    source: Callable[[], float] | None = None

    def monotonic(self) -> float:
        return self.now if self.source is None else self.source()

    def wall(self) -> float:
        self.now += self.tick
        return self.epoch + self.monotonic()

    def advance(self, seconds: float) -> None:
        self.now += seconds


def reading(source: Callable[[], float]) -> FakeClock:
    """A clock whose wall (and monotonic) time is what ``source`` returns."""
    return FakeClock(epoch=0.0, source=source)


def stepping(start: float = 1_764_400_000.0) -> FakeClock:
    """A clock one second on at each wall reading, from ``start``."""
    return FakeClock(now=start, epoch=0.0, tick=1.0)


_: protocols.Clock = FakeClock()
