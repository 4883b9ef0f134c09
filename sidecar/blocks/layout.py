"""Where a llama-server slot file is cut into blocks. Pure code: bytes in, a ``parts.Plan`` out.

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
layer's K and non-transposed V rows cut per ``tokens``-aligned range of
positions (see ``kvcache.groups``); a transposed V layer is a
:class:`~sidecar.blocks.parts.Grid` of ``n_embd_v`` rows whose column
ranges of the same cells are the blocks (a block gathers one piece of each
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

import struct
from collections.abc import Callable

from sidecar.blocks import kvcache, parts

MAGIC = 0x67677371
"""``LLAMA_STATE_SEQ_MAGIC`` ("ggsq")."""
VERSION = 4
"""``LLAMA_STATE_SEQ_VERSION`` of the pinned build; another version is chunked by content."""
TOKENS = 256
"""Positions per K/V block: 512 KiB per block for an 8B-class layer (2 KiB rows), as LMCache's 256-token chunks."""

Chunker = Callable[[memoryview], list[int]]
"""Content-defined cut lengths of a buffer (they sum to its length)."""


def plan(buf: memoryview, chunker: Chunker, *, tokens: int = TOKENS) -> parts.Plan:
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
        found = kvcache.section(buf, pos, tokens)
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
            part = parts.Run(glue.offset, (glue.length + part.cuts[0], *part.cuts[1:]), part.region)  # noqa: PLW2901
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
