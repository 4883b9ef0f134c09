"""Whether, and when, the launcher starts llama-server again after it ended on its own. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/launch/restarts.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

CRASH_LOOP_EXITS = 5
"""Ends within :data:`CRASH_LOOP_SECONDS` that make a crash loop."""
CRASH_LOOP_SECONDS = 60.0
FIRST_DELAY = 0.25
"""Seconds before the second restart within the window (before jitter); the first is at once."""
MAX_DELAY = 10.0
"""The longest wait between two starts, in seconds (before jitter)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    restart: bool
    delay: float
    """Seconds to wait before the restart (0 when there is none)."""
    recent: int
    """Ends within the window, this one included."""


def recent(ends: Sequence[float], now: float) -> int:
    """How many of ``ends`` (monotonic seconds) fall within the window that ends at ``now``."""
    return sum(1 for at in ends if now - at < CRASH_LOOP_SECONDS)


def decide(ends: Sequence[float], now: float, *, jitter: float) -> Verdict:
    """After an end at ``now`` (the last of ``ends``): restart, after how long; or give up.

    ``jitter`` is a number in [0, 1) (``random.random()``): the delay is scaled by ``0.5 + jitter / 2``.
    """
    count = recent(ends, now)
    if count >= CRASH_LOOP_EXITS:
        return Verdict(restart=False, delay=0.0, recent=count)
    if count <= 1:
        return Verdict(restart=True, delay=0.0, recent=count)
    base = min(MAX_DELAY, FIRST_DELAY * 2 ** (count - 2))
    return Verdict(restart=True, delay=base * (0.5 + min(max(jitter, 0.0), 1.0) / 2), recent=count)
