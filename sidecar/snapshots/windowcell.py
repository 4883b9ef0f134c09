"""One cell no token can attend to, added to a sliding-window slot file so that llama-server reuses it. Pure code.

Why (pinned build 11434, ``tools/server/server-context.cpp``, ``src/llama-kv-cache.cpp``): a slot
file of an iSWA model holds two KV caches, the global layers' (every position) and the windowed
layers' (``state_write`` drops every cell ``is_masked_swa`` hides from the newest one, so it keeps
exactly the last ``n_swa`` positions). Before reusing a cached prefix of ``n_past`` tokens the server
asks for a windowed cell at a position below ``n_past - n_swa`` (``pos_min < pos_min_thold``), one
more than the next token can see; a restored file never has it, so without ``--swa-full`` every
restore is followed by a full re-prefill (``forcing full prompt re-processing``).

The added cell sits at ``pos_max - n_swa``: every position from ``pos_max + 1`` on masks it (its
content is never read: zeros), and it makes the server reuse the file's tokens when the next prompt
extends all of them. A prompt that diverges inside the file still re-prefills (it would need the
positions the window dropped), so snapshots of these models end at the prompt's boundary
(``sidecar.save.rewind``). Anything that does not parse as expected leaves the file as it is.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/windowcell.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

from sidecar.core import events

MAGIC = 0x67677371
VERSION = 4
EXT_BYTES = 12
"""``llama_kv_cell_ext`` (models with M-RoPE or PLE)."""
_U32 = struct.Struct("<I")
_CELL = struct.Struct("<iI")
_KROW = struct.Struct("<iQ")
_VTRANS = struct.Struct("<iII")
_DATA = struct.Struct("<IIII")
MAX_LAYERS = 4096
MAX_ROW = 1 << 26


class Outcome(enum.StrEnum):
    PADDED = "padded"
    """The cell was added."""
    ALREADY = "already"
    """The file holds a cell below the window already (padded before)."""
    SHORT = "short"
    """Every token fits in the window: there is no position below it to put the cell at."""
    WINDOW_MISMATCH = "window_mismatch"
    """The windowed cells do not span the window the model's header states."""
    LAYOUT = "layout"
    """The file is not two KV caches of one stream each as this build writes them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Padding:
    """What to do to a slot file: write ``tail`` at ``offset`` (and cut the file there) when padded."""

    outcome: Outcome
    offset: int = 0
    tail: bytes = b""
    position: int = -1
    """Where the added cell sits."""
    detail: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _Cells:
    start: int
    """Offset of the ``n_stream`` word of the cache."""
    count_at: int
    """Offset of the non-empty stream's ``cell_count`` word."""
    meta_at: int
    meta_end: int
    stride: int
    positions: tuple[int, ...]
    end: int
    """Where the cache ends (after the other streams' empty ``cell_count`` words)."""
    data_end: int = -1
    """Where the non-empty stream's K/V data ends."""


def sections(buf: bytes | memoryview) -> list[int] | None:
    """The offsets of the KV caches in a slot file (and the file's end as the last), None if not one."""
    if len(buf) < 12:
        return None
    magic, version, n_words = struct.unpack_from("<III", buf, 0)
    pos = 12 + 4 * n_words
    if magic != MAGIC or version != VERSION or pos > len(buf):
        return None
    starts = [pos]
    while pos < len(buf):
        found = _cache(buf, pos)
        if found is None:
            return None
        pos = found.end
        starts.append(pos)
    return starts if pos == len(buf) else None


def plan(buf: bytes | memoryview, *, window: int, shape: events.WindowShape = events.WindowShape.STANDARD) -> Padding:
    """What to add to the slot file ``buf`` of a model whose windowed layers see ``window`` positions."""
    if window <= 0:
        return Padding(Outcome.LAYOUT, detail="no window")
    starts = sections(buf)
    if starts is None or len(starts) != 3:
        return Padding(Outcome.LAYOUT, detail="not the two KV caches (global, windowed) of an iSWA model")
    cells = _cache(buf, starts[1])
    if cells is None or not cells.positions:
        return Padding(Outcome.LAYOUT, detail="the windowed cache holds no cell")
    high = max(cells.positions)
    target = high - window
    first = high - window + 1 if shape is events.WindowShape.STANDARD else (high // window) * window
    kept = sorted(cells.positions)
    if target >= 0 and kept[0] == target and kept[1:] == list(range(first, high + 1)):
        return Padding(Outcome.ALREADY, position=target)
    if target < 0 and kept == list(range(0, high + 1)):
        return Padding(Outcome.SHORT, detail=f"{high + 1} positions fit in the window of {window}")
    low = kept[0]
    if kept != list(range(first, high + 1)):
        return Padding(
            Outcome.WINDOW_MISMATCH,
            detail=f"the windowed cells span positions {low}..{high} ({len(cells.positions)} cells); a {shape.value} "
            f"window of {window} would keep {first}..{high}",
        )
    tail = _padded(buf, cells, target)
    if tail is None:
        return Padding(Outcome.LAYOUT, detail="the windowed cache's K/V rows do not parse")
    return Padding(Outcome.PADDED, offset=cells.count_at, tail=tail, position=target)


def _cache(buf: bytes | memoryview, pos: int) -> _Cells | None:
    """One ``llama_kv_cache::state_write`` at ``pos``: its one non-empty stream's cells, and its end."""
    size = len(buf)
    if pos + 4 > size:
        return None
    (n_stream,) = _U32.unpack_from(buf, pos)
    if not 1 <= n_stream <= 4096:
        return None
    start, at = pos, pos + 4
    found: _Cells | None = None
    for _ in range(n_stream):
        if at + 4 > size:
            return None
        (count,) = _U32.unpack_from(buf, at)
        if count == 0:
            at += 4
            continue
        if found is not None:
            return None  # a second non-empty stream: not a one-sequence save
        stream = _stream(buf, start, at, count)
        if stream is None:
            return None
        found = stream
        at = stream.end
    if found is None:
        return _Cells(start, -1, -1, -1, 0, (), at)
    return dataclasses.replace(found, end=at)


def _stream(buf: bytes | memoryview, start: int, count_at: int, count: int) -> _Cells | None:
    meta_at = count_at + 4
    for stride in (12, 12 + EXT_BYTES):
        meta_end = meta_at + count * stride
        if meta_end > len(buf):
            continue
        positions: list[int] = []
        for i in range(count):
            p, n_seq = _CELL.unpack_from(buf, meta_at + i * stride)
            if n_seq != 1:
                break
            positions.append(p)
        else:
            end = _data_end(buf, meta_end, count)
            if end is not None:
                return _Cells(start, count_at, meta_at, meta_end, stride, tuple(positions), end, end)
    return None


def _data_end(buf: bytes | memoryview, pos: int, cells: int) -> int | None:
    layers = _layers(buf, pos, cells)
    return None if layers is None else layers[-1]


def _layers(buf: bytes | memoryview, pos: int, cells: int) -> list[int] | None:
    """Offsets: the data header's end, then each K layer's end, each V layer's end (the last is the data's end)."""
    size = len(buf)
    if pos + _DATA.size > size:
        return None
    v_trans, n_layer, _, _ = _DATA.unpack_from(buf, pos)
    if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        return None
    pos += _DATA.size
    ends = [pos]
    for _ in range(n_layer):
        if pos + _KROW.size > size:
            return None
        kind, row = _KROW.unpack_from(buf, pos)
        pos += _KROW.size + row * cells
        if not (0 <= kind <= 255 and 1 <= row <= MAX_ROW) or pos > size:
            return None
        ends.append(pos)
    for _ in range(n_layer):  # a layer without V writes nothing: stop at what parses
        if not v_trans:
            if pos + _KROW.size > size:
                break
            kind, row = _KROW.unpack_from(buf, pos)
            nxt = pos + _KROW.size + row * cells
            if not (0 <= kind <= 255 and 1 <= row <= MAX_ROW) or nxt > size:
                break
        else:
            if pos + _VTRANS.size > size:
                break
            kind, el, rows = _VTRANS.unpack_from(buf, pos)
            nxt = pos + _VTRANS.size + rows * cells * el
            if not (0 <= kind <= 255 and 1 <= el <= 16 and 1 <= rows <= MAX_ROW) or nxt > size:
                break
        pos = nxt
        ends.append(pos)
    return ends


def _padded(buf: bytes | memoryview, cells: _Cells, position: int) -> bytes | None:
    """The windowed cache from its non-empty stream's ``cell_count`` word on, with a zero cell at ``position``."""
    count = len(cells.positions)
    out = bytearray(_U32.pack(count + 1))
    first = bytes(buf[cells.meta_at : cells.meta_at + cells.stride])
    cell = bytearray(first)
    struct.pack_into("<i", cell, 0, position)
    if cells.stride > 12:
        cell[8 : 8 + EXT_BYTES] = bytes(EXT_BYTES)  # no M-RoPE position or token for a cell nothing reads
    out += cell
    out += buf[cells.meta_at : cells.meta_end]
    pos = cells.meta_end
    v_trans, n_layer, _, _ = _DATA.unpack_from(buf, pos)
    out += buf[pos : pos + _DATA.size]
    pos += _DATA.size
    for _ in range(n_layer):
        _, row = _KROW.unpack_from(buf, pos)
        out += buf[pos : pos + _KROW.size]
        out += bytes(row)
        out += buf[pos + _KROW.size : pos + _KROW.size + row * count]
        pos += _KROW.size + row * count
    while pos < cells.data_end:
        if not v_trans:
            _, row = _KROW.unpack_from(buf, pos)
            out += buf[pos : pos + _KROW.size]
            out += bytes(row)
            out += buf[pos + _KROW.size : pos + _KROW.size + row * count]
            pos += _KROW.size + row * count
        else:
            _, el, rows = _VTRANS.unpack_from(buf, pos)
            out += buf[pos : pos + _VTRANS.size]
            pos += _VTRANS.size
            for _ in range(rows):
                out += bytes(el)
                out += buf[pos : pos + el * count]
                pos += el * count
    if pos != cells.data_end:
        return None
    out += buf[pos:]  # the other streams' empty cell counts (-np N without a unified KV buffer): kept
    return bytes(out)
