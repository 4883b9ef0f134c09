"""Folding (:mod:`fold`) wired into logging: a filter for stdlib records, a processor for the sidecar's own.

* Stdlib records of WARNING and above (aiohttp's ``Error handling request``
  with its traceback for every malformed request, watchdog's) are folded by
  logger and message template: the address or error that varies is in the
  arguments, not the template.
* The sidecar's own warnings that one request can cause each time
  (:data:`PER_REQUEST`) are folded by event name. Others are said once per
  episode or throttled where they are made, and stay as they are.

:meth:`Folding.run` logs a ``log_lines_folded`` line per kind each interval
in which lines of it were folded, and the rest when it is cancelled at
shutdown. Records can come from any thread (watchdog's), so the fold is
behind a lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

from sidecar.core import fold

log = structlog.get_logger("sidecar.logs")

EVERY = 10.0
"""Seconds of an interval: per kind, the first line of each is logged, the others counted in one line."""
PER_REQUEST = frozenset({"proxy_answer_cut", "slot_not_cleared", "shared_store_slow"})
"""The sidecar's own warnings that each request can cause once more."""


class Folding:
    def __init__(self, *, every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self._fold = fold.Fold(every)
        self._clock = clock
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """A ``logging`` filter: False drops a record folded into the count of its kind."""
        if record.levelno < logging.WARNING:
            return True
        return self._offer(f"{record.name}: {record.msg}")

    def processor(self, _: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        """A structlog processor: drops a per-request warning folded into the count of its event."""
        event = event_dict.get("event")
        if method in ("warning", "error") and event in PER_REQUEST and not self._offer(str(event)):
            raise structlog.DropEvent
        return event_dict

    def summarise(self, *, final: bool = False) -> int:
        """Log a line for each kind whose interval ended with lines folded (all of them if ``final``)."""
        with self._lock:
            due = self._fold.due(float("inf") if final else self._clock())
        for folded in due:
            log.warning(
                "log_lines_folded",
                kind=folded.kind,
                lines=folded.count,
                seconds=folded.seconds,
                effect=f"{folded.count} more line(s) of this kind in {folded.seconds:g} s were not written: the "
                "first of each interval is, in full",
                hint="the first line of this kind says what happened (a malformed request names the client's "
                "address); if it keeps repeating, find its cause there",
            )
        return len(due)

    async def run(self) -> None:
        """Summarise every interval until cancelled; then summarise what is left."""
        try:
            while True:
                await asyncio.sleep(self._fold.every)
                self.summarise()
        except asyncio.CancelledError:
            self.summarise(final=True)
            raise

    def _offer(self, kind: str) -> bool:
        with self._lock:
            return self._fold.offer(kind, self._clock())
