"""Logging: structlog, JSON when not on a TTY, stdlib logs routed through it.

Event names are stable snake_case (``snapshot_committed``) with the data in
key-value pairs, so logs can be grepped and parsed. aiohttp's and watchdog's
stdlib loggers go through the same renderer via ``ProcessorFormatter``.

No line carries a secret: tracebacks are rendered without local variables
(structlog's default shows them, and a handler's locals hold the request's
``Authorization``), and :class:`redact.Redactor` blanks the secrets it is
given, and any header value that names one, out of every line.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import structlog

from sidecar.core import logfold, redact

FORMATS = ("auto", "json", "console")


def configure(*, fmt: str = "auto", level: str = "info", secrets: Iterable[str] = ()) -> logfold.Folding:
    """Configure structlog and stdlib logging once per process; ``secrets`` never appear in a line. Returns its
    folding of repeated lines, to run."""
    folding = logfold.Folding()
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if use_console:
        # The traceback made text here, without locals, so the redactor sees it (the console renderer's own
        # formatter would show locals, after the redactor ran).
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    else:
        transform = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(transform))
        renderer = structlog.processors.JSONRenderer()
    shared.append(redact.Redactor(secrets))
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[folding.processor, *shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    handler.addFilter(folding.filter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
    return folding


class Throttle:
    """At most one line per ``every`` seconds for a repeated warning, each with the count it stands for.

    :meth:`tick` is called for every occurrence: it returns the number of occurrences the line to log now
    stands for (this one and those not logged since the last line), or None to log nothing.
    :meth:`flush` returns the occurrences not logged yet (0 if none), for a last line once the burst is
    over; :attr:`due` is when that flush may run.
    """

    def __init__(self, every: float) -> None:
        self.every = every
        self.unlogged = 0
        self.due = float("-inf")

    def tick(self, now: float) -> int | None:
        self.unlogged += 1
        if now < self.due:
            return None
        return self.flush(now)

    def flush(self, now: float) -> int:
        count, self.unlogged = self.unlogged, 0
        if count:
            self.due = now + self.every
        return count
