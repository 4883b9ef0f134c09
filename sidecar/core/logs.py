"""Logging: structlog, JSON when not on a TTY, stdlib logs routed through it.

Event names are stable snake_case (``snapshot_committed``) with the data in
key-value pairs, so logs can be grepped and parsed. aiohttp's and watchdog's
stdlib loggers go through the same renderer via ``ProcessorFormatter``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

FORMATS = ("auto", "json", "console")


def configure(*, fmt: str = "auto", level: str = "info") -> None:
    """Configure structlog and stdlib logging once per process."""
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if use_console:
        renderer = structlog.dev.ConsoleRenderer()
    else:
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[*shared, renderer],
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
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
