"""llama-server's stdout and stderr, one structured log line per line it writes.

Each line becomes a ``server_output`` log line with the stream's name and the
child's pid, cut at :data:`MAX_LINE` bytes (``cut`` says how many were
left out): a child that writes a megabyte without a newline costs the log a
bounded line and the sidecar a bounded buffer. The text is passed on as it
is, never parsed: llama-server does not print prompts unless told to
(``-v`` / ``--verbose``, ``--log-verbosity``), and a user who asks for that
gets it in the sidecar's log as they would on the server's own stderr.
"""

from __future__ import annotations

import asyncio
import collections

import structlog

log = structlog.get_logger("sidecar.llama_server")

MAX_LINE = 2000
"""Bytes of one output line kept in the log; the rest is counted, not kept."""
_CHUNK = 1 << 16


class Lines:
    """Bytes in, whole lines out, each at most :data:`MAX_LINE` bytes (with the count cut off). Pure."""

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self._max = max_line
        self._buf = bytearray()
        self._cut = 0
        """Bytes of the current line dropped so far (it went past the limit)."""

    def feed(self, data: bytes) -> list[tuple[str, int]]:
        """The lines ``data`` completes, as (text, bytes cut off)."""
        done: list[tuple[str, int]] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._take(data[start:end])
            done.append(self._line())
            start = end + 1
        self._take(data[start:])
        return done

    def end(self) -> list[tuple[str, int]]:
        """What is left when the stream ends without a last newline."""
        return [self._line()] if self._buf or self._cut else []

    def _take(self, part: bytes) -> None:
        room = self._max - len(self._buf)
        self._buf += part[: max(room, 0)]
        self._cut += max(len(part) - max(room, 0), 0)

    def _line(self) -> tuple[str, int]:
        text = self._buf.decode("utf-8", "replace").rstrip("\r")
        line = (text, self._cut)
        self._buf, self._cut = bytearray(), 0
        return line


async def relay(
    stream: asyncio.StreamReader, *, name: str, pid: int, tail: collections.deque[str] | None = None
) -> None:
    """Log every line of ``stream`` (the child's ``stdout`` or ``stderr``) until it ends; ``tail`` keeps the last
    ones (what the launcher quotes when the server could not start)."""
    lines = Lines()
    while chunk := await stream.read(_CHUNK):
        for text, cut in lines.feed(chunk):
            _say(text, cut, name=name, pid=pid, tail=tail)
    for text, cut in lines.end():
        _say(text, cut, name=name, pid=pid, tail=tail)


def _say(text: str, cut: int, *, name: str, pid: int, tail: collections.deque[str] | None) -> None:
    if tail is not None and text.strip():
        tail.append(text)
    if cut:
        log.info("server_output", stream=name, pid=pid, line=text, cut=cut)
    else:
        log.info("server_output", stream=name, pid=pid, line=text)
