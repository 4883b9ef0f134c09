"""Repeated log lines of one kind folded into one line with a count per interval. Pure.

Malformed requests made 2.39 MB of log a second: each one a line of aiohttp's
with its traceback. A line that repeats says nothing new after its first
time, and a log that fills its disk, or buries the one line that matters,
is an outage of its own. So, per kind of line (a logger and its message
template, or an event name), the first one of an interval of ``every``
seconds is logged at once and in full; the others until the interval ends
are only counted, and :meth:`Fold.due` gives the count of each kind whose
interval has ended, for one summary line each. The next one of the kind
after that opens a new interval and is logged in full again.

At most ``MAX_KINDS`` kinds are followed at once; a line of another kind is
then logged unfolded (kinds are message templates and event names: a few
dozen at most, unless something puts varying text in a template).
"""

from __future__ import annotations

import dataclasses

MAX_KINDS = 1024
"""Kinds followed at once; past it a new kind is not folded."""


@dataclasses.dataclass(frozen=True, slots=True)
class Folded:
    """``count`` lines of ``kind`` were not logged in the interval that ended (``seconds`` long)."""

    kind: str
    count: int
    seconds: float


@dataclasses.dataclass(slots=True)
class _Interval:
    until: float
    folded: int = 0


class Fold:
    """``offer(kind, now)`` for every line: True to log it now; ``due(now)``: the summaries to log."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._open: dict[str, _Interval] = {}
        self._ended: list[Folded] = []
        """Counts of intervals that a new line of their kind closed before :meth:`due` was called."""

    def offer(self, kind: str, now: float) -> bool:
        """Whether to log this line of ``kind`` now (the first of its interval); else it is counted."""
        interval = self._open.get(kind)
        if interval is not None and now < interval.until:
            interval.folded += 1
            return False
        if interval is None and len(self._open) >= MAX_KINDS:
            return True
        if interval is not None and interval.folded:
            self._ended.append(Folded(kind, interval.folded, self.every))
        self._open[kind] = _Interval(until=now + self.every)
        return True

    def due(self, now: float) -> list[Folded]:
        """The kinds whose interval ended with lines folded, each once; intervals that ended are closed."""
        out, self._ended = self._ended, []
        for kind, interval in list(self._open.items()):
            if now < interval.until:
                continue
            del self._open[kind]
            if interval.folded:
                out.append(Folded(kind, interval.folded, self.every))
        return out
