"""Whether, and when, the launcher starts llama-server again after it ended on its own. Pure code.

Every end the launcher did not ask for is followed by a restart. The first
end in the window restarts at once: a server that crashed once (a kill -9,
the OOM killer) is what the launcher is for, and every moment before its
restart is a moment its clients wait at the gate. Each further end in the
window waits a delay that doubles (:data:`FIRST_DELAY`, then twice that,
... capped at :data:`MAX_DELAY`), scaled by a jitter
factor between 0.5 and 1 so that several launchers on one host do not
start their servers in step. Once :data:`CRASH_LOOP_EXITS` ends fall within
:data:`CRASH_LOOP_SECONDS`, the server is in a crash loop (a bad argument,
a model that does not load, a port taken): restarting it again would only
repeat the failure and fill the log, so the launcher stops and says why.

A server that ran for a while before it ended starts again at once: only the
ends inside the window count.
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
