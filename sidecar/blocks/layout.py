"""Where a llama-server slot file is cut into blocks. Pure code: bytes in, a :class:`Plan` out.

The cut is chosen so that two files holding the same tokens at the same
positions give byte-identical blocks: two conversations sharing a prefix,
or successive saves of one conversation. llama.cpp (pinned build 11434,
``llama_context::state_seq_save_file`` and ``llama_kv_cache::state_write``)
writes a slot file as

* ``u32 magic`` ("ggsq"), ``u32 version`` (4), ``u32 n_words``: the header;
* ``n_words`` words of llama-server's token payload;
* per memory module (one KV cache; two for sliding-window models, the base
  cache then the SWA one; a KV cache then recurrent state for hybrids): the
  KV cache as ``u32 n_stream``, then per stream ``u32 cell_count`` and, when
  it is not 0, the cell metadata (per cell ``i32 pos``, ``u32 n_seq_id``,
  12 bytes of M-RoPE/PLE extension on some models, the seq ids), then
  ``u32 v_trans``, ``u32 n_layer``, ``u32 n_rot_k``, ``u32 n_rot_v``, each
  layer's K (``i32 type``, ``u64 row_size``, ``cell_count`` rows), then each
  layer's V: rows as K when flash attention is on (``v_trans`` 0); else
  (``i32 type``, ``u32 el_size``, ``u32 n_embd_v``) and ``n_embd_v`` rows of
  ``cell_count`` elements: V transposed.

The blocks: the header, the token payload and each stream's cell metadata
on their own (small: they differ between conversations and slots); each
layer's K and non-transposed V rows cut every ``tokens`` cells; a
transposed V layer is a :class:`Grid` of ``n_embd_v`` rows whose column
ranges of ``tokens`` cells are the blocks (a block gathers one piece of each
row), so equal prefixes still give equal blocks. The last, partial range of
each layer is a block of its own; the next save of a longer conversation
replaces only it.

What the parser does not recognise (another version, recurrent state, a
layout of a later build) is cut by content-defined chunking
(:mod:`~sidecar.blocks.chunking`). The plan only says where the cuts are: a
wrong guess costs deduplication, never correctness, since every byte is in
exactly one block and reassembly puts each back where it was.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable

MAGIC = 0x67677371
"""``LLAMA_STATE_SEQ_MAGIC`` ("ggsq")."""
VERSION = 4
"""``LLAMA_STATE_SEQ_VERSION`` of the pinned build; another version is chunked by content."""
TOKENS = 256
"""Cells per K/V block: 512 KiB per block for an 8B-class layer (2 KiB rows), as LMCache's 256-token chunks."""
EXT_BYTES = 12
"""``llama_kv_cell_ext``: ``x``, ``y``, ``tok`` (models with M-RoPE or PLE)."""
MAX_STREAMS = 4096
MAX_LAYERS = 4096
MAX_TYPE = 255
"""``ggml_type`` ids are small; anything above is not a KV header."""
MAX_ROW = 1 << 26
_U32 = struct.Struct("<I")
_KROW = struct.Struct("<iQ")
_VTRANS = struct.Struct("<iII")
_DATA = struct.Struct("<IIII")

Chunker = Callable[[memoryview], list[int]]
"""Content-defined cut lengths of a buffer (they sum to its length)."""


class Region(enum.StrEnum):
    """What the bytes of a part are: reported per region, so dedup can be read per kind."""

    HEADER = "header"
    TOKENS = "tokens"
    CELLS = "cells"
    KEYS = "keys"
    VALUES = "values"
    OPAQUE = "opaque"
    """Chunked by content: a layout the parser does not know (recurrent state, another version)."""
    GLUE = "glue"
    """A few header bytes (counts, a layer's type and row size): never a part of a plan, they are
    merged into the block that follows them (see :func:`_coalesce`)."""


class Layout(enum.StrEnum):
    """How a whole file was split."""

    KV = "kv"
    """Every byte after the token payload parsed as KV cache sections."""
    MIXED = "mixed"
    """KV cache sections, then bytes chunked by content (a hybrid model's recurrent state)."""
    OPAQUE = "opaque"
    """Nothing recognised beyond the header: chunked by content."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """``sum(cuts)`` contiguous bytes at ``offset``, one block per cut."""

    offset: int
    cuts: tuple[int, ...]
    region: Region

    @property
    def length(self) -> int:
        return sum(self.cuts)


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    """``rows`` rows of ``sum(cuts)`` bytes at ``offset``; block ``i`` is column range ``i`` of every row."""

    offset: int
    rows: int
    cuts: tuple[int, ...]
    region: Region

    @property
    def length(self) -> int:
        return self.rows * sum(self.cuts)


Part = Run | Grid


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    parts: tuple[Part, ...]
    layout: Layout


def plan(buf: memoryview, chunker: Chunker, *, tokens: int = TOKENS) -> Plan:
    """The cut of ``buf`` (a whole slot file, or any bytes): parts that tile it in order."""
    size = len(buf)
    if size < 12:
        return Plan(_opaque(buf, 0, chunker), Layout.OPAQUE)
    magic, version, n_words = struct.unpack_from("<III", buf, 0)
    body = 12 + 4 * n_words
    if magic != MAGIC or version != VERSION or body > size:
        return Plan(_opaque(buf, 0, chunker), Layout.OPAQUE)
    parts: list[Part] = [Run(0, (12,), Region.HEADER)]
    if n_words:
        parts.append(Run(12, (4 * n_words,), Region.TOKENS))
    pos, sections = body, 0
    while pos < size:
        found = _kv_section(buf, pos, tokens)
        if found is None:
            break
        section, pos = found
        parts.extend(section)
        sections += 1
    if pos == size:
        return Plan(_coalesce(parts), Layout.KV if sections else Layout.OPAQUE)
    parts.extend(_opaque(buf, pos, chunker))
    return Plan(_coalesce(parts), Layout.MIXED if sections else Layout.OPAQUE)


def _coalesce(parts: list[Part]) -> tuple[Part, ...]:
    """Merge each run of glue bytes into the first block of the run after it.

    The glue before a layer's rows (its type and row size) is the same in
    every file of a model, so the merged first block still lines up across
    files; the glue around the cell metadata goes with the metadata, which
    differs anyway. Glue before a :class:`Grid` (or at the end) stays a
    block of its own: a few bytes, identical across files, stored once.
    """
    out: list[Part] = []
    glue: Run | None = None
    for part in parts:
        if isinstance(part, Run) and part.region is Region.GLUE:
            glue = part if glue is None else Run(glue.offset, (glue.length + part.length,), Region.GLUE)
            continue
        if glue is not None and isinstance(part, Run):
            part = Run(glue.offset, (glue.length + part.cuts[0], *part.cuts[1:]), part.region)  # noqa: PLW2901
        elif glue is not None:
            out.append(Run(glue.offset, glue.cuts, part.region))
        glue = None
        out.append(part)
    if glue is not None:
        out.append(Run(glue.offset, glue.cuts, Region.CELLS))
    return tuple(out)


def _opaque(buf: memoryview, offset: int, chunker: Chunker) -> tuple[Part, ...]:
    if offset >= len(buf):
        return ()
    return (Run(offset, tuple(chunker(buf[offset:])), Region.OPAQUE),)


def _ranges(count: int, width: int, tokens: int) -> tuple[int, ...]:
    """Cut lengths of ``count`` cells of ``width`` bytes every ``tokens`` cells."""
    full, rest = divmod(count, tokens)
    return (tokens * width,) * full + ((rest * width,) if rest else ())


def _kv_section(buf: memoryview, pos: int, tokens: int) -> tuple[list[Part], int] | None:
    """The parts of one KV cache written by ``llama_kv_cache::state_write`` at ``pos``, and its end."""
    size = len(buf)
    if pos + 4 > size:
        return None
    (n_stream,) = _U32.unpack_from(buf, pos)
    if not 1 <= n_stream <= MAX_STREAMS:
        return None
    parts: list[Part] = []
    pos += 4
    start = pos
    for _ in range(n_stream):
        if pos + 4 > size:
            return None
        (cells,) = _U32.unpack_from(buf, pos)
        pos += 4
        if cells == 0:
            continue
        stream = _stream(buf, pos, cells, tokens)
        if stream is None:
            return None
        found, pos = stream
        parts.extend(found)
    return [Run(start - 4, (4,), Region.GLUE), *_tiled(parts, start, pos)], pos


def _tiled(parts: list[Part], start: int, end: int) -> list[Part]:
    """The parts with the ``cell_count`` words between them as glue, so that they tile the section."""
    tiled: list[Part] = []
    pos = start
    for part in parts:
        if part.offset > pos:
            tiled.append(Run(pos, (part.offset - pos,), Region.GLUE))
        tiled.append(part)
        pos = part.offset + part.length
    if end > pos:
        tiled.append(Run(pos, (end - pos,), Region.GLUE))
    return tiled


def _stream(buf: memoryview, pos: int, cells: int, tokens: int) -> tuple[list[Part], int] | None:
    for ext in (False, True):
        meta_end = _meta_end(buf, pos, cells, ext)
        if meta_end is None:
            continue
        data = _data(buf, meta_end, cells, tokens)
        if data is not None:
            parts, end = data
            return [Run(pos, (meta_end - pos,), Region.CELLS), *parts], end
    return None


def _meta_end(buf: memoryview, pos: int, cells: int, ext: bool) -> int | None:
    """End of ``cells`` cells of metadata at ``pos``; None if they do not fit."""
    size = len(buf)
    stride = 12 + (EXT_BYTES if ext else 0)
    end = pos + cells * stride
    if end > size:
        return None
    words = buf[pos:end].cast("I") if (end - pos) % 4 == 0 else None
    if words is not None and all(n == 1 for n in words[1 :: stride // 4]):
        return end  # the usual case: each cell of the saved sequence carries its one seq id
    for _ in range(cells):  # the general case, cell by cell
        if pos + 8 > size:
            return None
        (n_seq,) = _U32.unpack_from(buf, pos + 4)
        pos += 8 + (EXT_BYTES if ext else 0) + 4 * n_seq
        if n_seq > MAX_STREAMS or pos > size:
            return None
    return pos


def _data(buf: memoryview, pos: int, cells: int, tokens: int) -> tuple[list[Part], int] | None:
    """The K and V parts of ``state_write_data`` at ``pos``; None if it does not parse as one."""
    size = len(buf)
    if pos + _DATA.size > size:
        return None
    v_trans, n_layer, _, _ = _DATA.unpack_from(buf, pos)
    if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        return None
    parts: list[Part] = [Run(pos, (_DATA.size,), Region.GLUE)]
    pos += _DATA.size
    for _ in range(n_layer):
        row = _row_header(buf, pos)
        if row is None or pos + _KROW.size + row * cells > size:
            return None
        parts.append(Run(pos, (_KROW.size,), Region.GLUE))
        parts.append(Run(pos + _KROW.size, _ranges(cells, row, tokens), Region.KEYS))
        pos += _KROW.size + row * cells
    for _ in range(n_layer):  # a layer without V (``if (!v) continue``) writes nothing: stop at what parses
        found = _v_layer(buf, pos, cells, tokens, bool(v_trans))
        if found is None:
            break
        parts.extend(found[0])
        pos = found[1]
    return parts, pos


def _row_header(buf: memoryview, pos: int) -> int | None:
    if pos + _KROW.size > len(buf):
        return None
    kind, row = _KROW.unpack_from(buf, pos)
    return row if 0 <= kind <= MAX_TYPE and 1 <= row <= MAX_ROW else None


def _v_layer(buf: memoryview, pos: int, cells: int, tokens: int, trans: bool) -> tuple[list[Part], int] | None:
    size = len(buf)
    if not trans:
        row = _row_header(buf, pos)
        if row is None or pos + _KROW.size + row * cells > size:
            return None
        head = Run(pos, (_KROW.size,), Region.GLUE)
        return [head, Run(pos + _KROW.size, _ranges(cells, row, tokens), Region.VALUES)], pos + _KROW.size + row * cells
    if pos + _VTRANS.size > size:
        return None
    kind, el, rows = _VTRANS.unpack_from(buf, pos)
    end = pos + _VTRANS.size + rows * cells * el
    if not (0 <= kind <= MAX_TYPE and 1 <= el <= 16 and 1 <= rows <= MAX_ROW) or end > size:
        return None
    head = Run(pos, (_VTRANS.size,), Region.GLUE)
    return [head, Grid(pos + _VTRANS.size, rows, _ranges(cells, el, tokens), Region.VALUES)], end
