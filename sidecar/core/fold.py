"""Repeated log lines of one kind folded into one line with a count per interval. Pure.

Per kind of line, the first of each interval is logged in full and the rest only counted, for one
summary line when the interval ends: a flood of the same line cannot fill the disk or bury the line
that matters.

Invariants and trade-offs: docs/modules.md, `sidecar/core/fold.py`.
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
