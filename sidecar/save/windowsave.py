"""A sliding-window model's slot file made reusable after a restore, right after llama-server wrote it.

The file gets one cell below the window (:mod:`sidecar.snapshots.windowcell`); then, restored, it
serves the next turn of its conversation without ``--swa-full``. Anything unexpected leaves the file as
the server wrote it (said once per reason): the next request's reuse is still checked after a restore,
so nothing wrong is ever restored, at worst a restore is not reused.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from pathlib import Path

import structlog

from sidecar.core import events, protocols
from sidecar.observe import memory
from sidecar.snapshots import windowcell

log = structlog.get_logger("sidecar.engine")

Outcome = windowcell.Outcome

_said: set[tuple[str, Outcome]] = set()


def plan_file(path: Path, window: memory.Window) -> windowcell.Padding:
    """What :func:`windowcell.plan` says of the file at ``path`` (mapped, not read into memory)."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return windowcell.Padding(Outcome.LAYOUT, detail="an empty file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return windowcell.plan(view, window=window.size, shape=window.shape)
            finally:
                view.release()


def pad(path: Path, window: memory.Window) -> tuple[windowcell.Padding, int]:
    """Add the cell to the staged file at ``path`` (not visible to anyone yet) when :func:`plan_file` says so;
    the padding and the bytes it added."""
    padding = plan_file(path, window)
    if padding.outcome is not Outcome.PADDED:
        return padding, 0
    with path.open("r+b") as fh:
        before = os.fstat(fh.fileno()).st_size
        fh.seek(padding.offset)
        fh.write(padding.tail)
        fh.truncate()
        fh.flush()
        return padding, padding.offset + len(padding.tail) - before


def apply(
    path: Path, result: protocols.ActionResult, *, model_path: str, kind: events.Memory | None
) -> protocols.ActionResult:
    """Pad the file the server just wrote for a windowed model; the save's result with the file's new size.

    Blocking (file I/O): run it in a thread.
    """
    if kind is not events.Memory.SWA or result.tokens == 0:
        return result
    window = memory.window_of_file(model_path)
    if window is None:
        return result
    try:
        padding, added = pad(path, window)
    except (OSError, ValueError, struct.error) as exc:
        _say(
            model_path,
            Outcome.LAYOUT,
            f"{type(exc).__name__}: {exc}",
            effect="this snapshot is kept as the server wrote it: restored, llama-server re-prefills it",
        )
        return result
    if padding.outcome is Outcome.PADDED:
        return dataclasses.replace(result, bytes=result.bytes + added)
    if padding.outcome is Outcome.WINDOW_MISMATCH:
        _say(
            model_path,
            padding.outcome,
            padding.detail,
            effect="the model's header does not state the window llama-server keeps: snapshots of this model are "
            "kept as the server writes them, and a restore of one is re-prefilled",
            hint="check the model file's <arch>.attention.sliding_window; run llama-server with --swa-full to "
            "have restores reused anyway",
        )
    elif padding.outcome is Outcome.LAYOUT:
        _say(
            model_path,
            padding.outcome,
            padding.detail,
            effect="a slot file of this model is not laid out as this llama-server build writes one: it is kept as "
            "written, and a restore of it is re-prefilled",
            hint="run the llama-server build the sidecar supports, or --swa-full",
        )
    return result


def _say(model_path: str, outcome: Outcome, detail: str, *, effect: str, hint: str = "") -> None:
    if (model_path, outcome) in _said:
        return
    _said.add((model_path, outcome))
    log.warning(
        "window_cell_not_added",
        reason=outcome.value,
        detail=detail,
        effect=effect,
        **({"hint": hint} if hint else {}),
    )
