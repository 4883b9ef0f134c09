"""Where a llama-server slot file is cut into blocks. Pure code: bytes in, a ``parts.Plan`` out.

Invariants and trade-offs: docs/modules.md, `sidecar/blocks/layout.py`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from sidecar.blocks import kvcache, parts

MAGIC = 0x67677371
"""``LLAMA_STATE_SEQ_MAGIC`` ("ggsq")."""
VERSION = 4
"""``LLAMA_STATE_SEQ_VERSION`` of the pinned build; another version is chunked by content."""
TOKENS = 256
"""Positions per K/V block: 512 KiB per block for an 8B-class layer (2 KiB rows), as LMCache's 256-token chunks."""
FINE = 16
"""Positions per K/V block of a range a save fills only in part, and of a full range that grew save by save
(see :func:`kvcache.grains`): 32 KiB for an 8B-class layer, as vLLM's 16-token blocks; a turn then writes
8 positions per layer beyond its own on average instead of 128."""

Chunker = Callable[[memoryview], list[int]]
"""Content-defined cut lengths of a buffer (they sum to its length)."""


def plan(buf: memoryview, chunker: Chunker, *, tokens: int = TOKENS, fine: int = FINE) -> parts.Plan:
    """The cut of ``buf`` (a whole slot file, or any bytes): pieces that tile it in order."""
    size = len(buf)
    if size < 12:
        return parts.Plan(_opaque(buf, 0, chunker), parts.Layout.OPAQUE)
    magic, version, n_words = struct.unpack_from("<III", buf, 0)
    body = 12 + 4 * n_words
    if magic != MAGIC or version != VERSION or body > size:
        return parts.Plan(_opaque(buf, 0, chunker), parts.Layout.OPAQUE)
    pieces: list[parts.Part] = [parts.Run(0, (12,), parts.Region.HEADER)]
    if n_words:
        pieces.append(parts.Run(12, (4 * n_words,), parts.Region.TOKENS))
    pos, sections = body, 0
    while pos < size:
        found = kvcache.section(buf, pos, tokens, fine)
        if found is None:
            break
        section, pos = found
        pieces.extend(section)
        sections += 1
    if pos == size:
        return parts.Plan(_coalesce(pieces), parts.Layout.KV if sections else parts.Layout.OPAQUE)
    pieces.extend(_opaque(buf, pos, chunker))
    return parts.Plan(_coalesce(pieces), parts.Layout.MIXED if sections else parts.Layout.OPAQUE)


def _coalesce(pieces: list[parts.Part]) -> tuple[parts.Part, ...]:
    """Merge each run of glue bytes into the first block of the run after it.

    The glue before a layer's rows (its type and row size) is the same in
    every file of a model, so the merged first block still lines up across
    files; the glue around the cell metadata goes with the metadata, which
    differs anyway. Glue before a :class:`parts.Grid` (or at the end) stays a
    block of its own: a few bytes, identical across files, stored once.
    """
    out: list[parts.Part] = []
    glue: parts.Run | None = None
    for part in pieces:
        if isinstance(part, parts.Run) and part.region is parts.Region.GLUE:
            glue = part if glue is None else parts.Run(glue.offset, (glue.length + part.length,), parts.Region.GLUE)
            continue
        if glue is not None and isinstance(part, parts.Run):
            fine = part.fine
            if fine and fine[0]:
                fine = ((glue.length + fine[0][0], *fine[0][1:]), *fine[1:])
            part = parts.Run(glue.offset, (glue.length + part.cuts[0], *part.cuts[1:]), part.region, fine)  # noqa: PLW2901
        elif glue is not None:
            out.append(parts.Run(glue.offset, glue.cuts, part.region))
        glue = None
        out.append(part)
    if glue is not None:
        out.append(parts.Run(glue.offset, glue.cuts, parts.Region.CELLS))
    return tuple(out)


def _opaque(buf: memoryview, offset: int, chunker: Chunker) -> tuple[parts.Part, ...]:
    if offset >= len(buf):
        return ()
    return (parts.Run(offset, tuple(chunker(buf[offset:])), parts.Region.OPAQUE),)
