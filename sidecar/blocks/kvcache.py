"""One KV cache as ``llama_kv_cache::state_write`` writes it (pinned build 11434): its pieces, or None. Pure code.

See :mod:`~sidecar.blocks.layout` for the layout and why the blocks are cut
where they are. Every check here is a plausibility bound (a type id, a row
size, a count that fits the file): what fails one is not a KV cache, and
the caller chunks it by content instead.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from sidecar.blocks import parts

EXT_BYTES = 12
"""``llama_kv_cell_ext``: ``x``, ``y``, ``tok`` (models with M-RoPE or PLE)."""
MAX_STREAMS = 4096
MAX_LAYERS = 4096
MAX_TYPE = 255
"""``ggml_type`` ids are small; anything above is not a KV header."""
MAX_ROW = 1 << 26
_CELL = struct.Struct("<iI")
_U32 = struct.Struct("<I")
_KROW = struct.Struct("<iQ")
_VTRANS = struct.Struct("<iII")
_DATA = struct.Struct("<IIII")


def groups(positions: Sequence[int], tokens: int) -> tuple[int, ...]:
    """Cells per block: a block ends where a cell's position enters another ``tokens``-aligned range.

    Cutting by position, not by count, keeps blocks aligned when a file
    starts past position 0: a sliding-window cache saves only the cells in
    its window (``is_masked_swa``), so each save starts somewhere else, yet
    the cells of positions 512..767 are one block in every save that holds
    them all. Positions that jump about (not seen in a text model) would cut
    many small blocks: then cells are counted in ``tokens`` instead.
    """
    cuts: list[int] = []
    size, last = 0, None
    for p in positions:
        here = p // tokens
        if size and here != last:
            cuts.append(size)
            size = 0
        size, last = size + 1, here
    if size:
        cuts.append(size)
    if len(cuts) > len(positions) // tokens + 2:
        full, rest = divmod(len(positions), tokens)
        return (tokens,) * full + ((rest,) if rest else ())
    return tuple(cuts)


Grains = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]
"""Cells per block, and per block its finer split (``()``: none; all of it ``()`` when no block has one)."""


def grains(positions: Sequence[int], tokens: int, fine: int) -> Grains:
    """The blocks of :func:`groups` at ``tokens``, each range it does not fill cut at ``fine`` instead.

    A range a save fills only in part is the tail of a growing conversation: cut at ``tokens`` it would be
    written whole again at the next save, ``tokens`` - ``fine`` more positions per layer than a turn adds
    (a 90-token turn wrote 218 positions' worth on average). Cut at ``fine``, the next save finds every
    ``fine`` piece but the last, partial one. A full range keeps one block, with its ``fine`` split beside
    it: the ingest stores it as those pieces when the store holds the first of them (the range grew there
    save by save), else as one block (a prompt prefilled at once). ``fine`` must divide ``tokens``
    (else no range is split), so the pieces of a range line up with the range in every file.
    """
    coarse = groups(positions, tokens)
    if not 0 < fine < tokens or tokens % fine:
        return coarse, ()
    cuts: list[int] = []
    alternatives: list[tuple[int, ...]] = []
    at = 0
    for n in coarse:
        split = groups(positions[at : at + n], fine)
        at += n
        if n == tokens:
            cuts.append(n)
            alternatives.append(split if len(split) > 1 else ())
        else:
            cuts.extend(split)
            alternatives.extend(() for _ in split)
    return tuple(cuts), tuple(alternatives) if any(alternatives) else ()


def section(buf: memoryview, pos: int, tokens: int, fine: int = 0) -> tuple[list[parts.Part], int] | None:
    """The parts of one KV cache written by ``llama_kv_cache::state_write`` at ``pos``, and its end."""
    size = len(buf)
    if pos + 4 > size:
        return None
    (n_stream,) = _U32.unpack_from(buf, pos)
    if not 1 <= n_stream <= MAX_STREAMS:
        return None
    pieces: list[parts.Part] = []
    pos += 4
    start = pos
    for _ in range(n_stream):
        if pos + 4 > size:
            return None
        (cells,) = _U32.unpack_from(buf, pos)
        pos += 4
        if cells == 0:
            continue
        stream = _stream(buf, pos, cells, tokens, fine)
        if stream is None:
            return None
        found, pos = stream
        pieces.extend(found)
    return [parts.Run(start - 4, (4,), parts.Region.GLUE), *_tiled(pieces, start, pos)], pos


def _tiled(pieces: list[parts.Part], start: int, end: int) -> list[parts.Part]:
    """The parts with the ``cell_count`` words between them as glue, so that they tile the section."""
    tiled: list[parts.Part] = []
    pos = start
    for part in pieces:
        if part.offset > pos:
            tiled.append(parts.Run(pos, (part.offset - pos,), parts.Region.GLUE))
        tiled.append(part)
        pos = part.offset + part.length
    if end > pos:
        tiled.append(parts.Run(pos, (end - pos,), parts.Region.GLUE))
    return tiled


def _stream(buf: memoryview, pos: int, cells: int, tokens: int, fine: int) -> tuple[list[parts.Part], int] | None:
    for ext in (False, True):
        meta = _meta(buf, pos, cells, ext)
        if meta is None:
            continue
        meta_end, positions = meta
        data = _data(buf, meta_end, cells, grains(positions, tokens, fine))
        if data is not None:
            pieces, end = data
            return [parts.Run(pos, (meta_end - pos,), parts.Region.CELLS), *pieces], end
    return None


def _meta(buf: memoryview, pos: int, cells: int, ext: bool) -> tuple[int, Sequence[int]] | None:
    """(end, each cell's position) of ``cells`` cells of metadata at ``pos``; None if they do not fit."""
    size = len(buf)
    stride = 12 + (EXT_BYTES if ext else 0)
    end = pos + cells * stride
    if end > size:
        return None
    words = buf[pos:end].cast("i")
    if all(n == 1 for n in words[1 :: stride // 4]):
        return end, words[:: stride // 4]  # the usual case: each cell of the saved sequence has its one seq id
    positions: list[int] = []
    for _ in range(cells):  # the general case, cell by cell
        if pos + 8 > size:
            return None
        at, n_seq = _CELL.unpack_from(buf, pos)
        positions.append(at)
        pos += 8 + (EXT_BYTES if ext else 0) + 4 * n_seq
        if n_seq > MAX_STREAMS or pos > size:
            return None
    return pos, positions


def _scaled(blocks: Grains, size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The grains in bytes, ``size`` bytes a cell."""
    cuts, fine = blocks
    return tuple(n * size for n in cuts), tuple(tuple(n * size for n in split) for split in fine)


def _data(buf: memoryview, pos: int, cells: int, blocks: Grains) -> tuple[list[parts.Part], int] | None:
    """The K and V pieces of ``state_write_data`` at ``pos``; None if it does not parse as one."""
    size = len(buf)
    if pos + _DATA.size > size:
        return None
    v_trans, n_layer, _, _ = _DATA.unpack_from(buf, pos)
    if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        return None
    pieces: list[parts.Part] = [parts.Run(pos, (_DATA.size,), parts.Region.GLUE)]
    pos += _DATA.size
    for _ in range(n_layer):
        row = _row_header(buf, pos)
        if row is None or pos + _KROW.size + row * cells > size:
            return None
        pieces.append(parts.Run(pos, (_KROW.size,), parts.Region.GLUE))
        cuts, fine = _scaled(blocks, row)
        pieces.append(parts.Run(pos + _KROW.size, cuts, parts.Region.KEYS, fine))
        pos += _KROW.size + row * cells
    for _ in range(n_layer):  # a layer without V (``if (!v) continue``) writes nothing: stop at what parses
        found = _v_layer(buf, pos, cells, blocks, bool(v_trans))
        if found is None:
            break
        pieces.extend(found[0])
        pos = found[1]
    return pieces, pos


def _row_header(buf: memoryview, pos: int) -> int | None:
    if pos + _KROW.size > len(buf):
        return None
    kind, row = _KROW.unpack_from(buf, pos)
    return row if 0 <= kind <= MAX_TYPE and 1 <= row <= MAX_ROW else None


def _v_layer(buf: memoryview, pos: int, cells: int, blocks: Grains, trans: bool) -> tuple[list[parts.Part], int] | None:
    size = len(buf)
    if not trans:
        row = _row_header(buf, pos)
        if row is None or pos + _KROW.size + row * cells > size:
            return None
        head = parts.Run(pos, (_KROW.size,), parts.Region.GLUE)
        cuts, fine = _scaled(blocks, row)
        return [head, parts.Run(pos + _KROW.size, cuts, parts.Region.VALUES, fine)], pos + _KROW.size + row * cells
    if pos + _VTRANS.size > size:
        return None
    kind, el, rows = _VTRANS.unpack_from(buf, pos)
    end = pos + _VTRANS.size + rows * cells * el
    if not (0 <= kind <= MAX_TYPE and 1 <= el <= 16 and 1 <= rows <= MAX_ROW) or end > size:
        return None
    head = parts.Run(pos, (_VTRANS.size,), parts.Region.GLUE)
    cuts, fine = _scaled(blocks, el)
    return [head, parts.Grid(pos + _VTRANS.size, rows, cuts, parts.Region.VALUES, fine)], end
