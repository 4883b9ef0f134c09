"""Slot files made in memory, laid out as llama.cpp's ``state_seq_save_file`` writes them (pinned build 11434).

For the block store's tests: a KV cache's bytes are a function of the token
at each position (as a real model's are, on the CPU), so two files of
sequences sharing a prefix share the bytes of that prefix, and the tests can
say which blocks must match without a server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

MAGIC = 0x67677371
VERSION = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 3
    k_row: int = 64
    """Bytes per K row (one cell of one layer)."""
    v_row: int = 64
    v_trans: bool = False
    el: int = 2
    """Bytes per V element when transposed (``v_row`` is then ``rows * el``)."""
    ext: bool = False
    streams: int = 1
    seq: int = 0
    """The seq id each cell carries (the slot's)."""


def cell_bytes(token: int, pos: int, layer: int, which: str, size: int) -> bytes:
    """The deterministic KV of one cell: depends on the token, its position, the layer and K/V only."""
    seed = f"{token}:{pos}:{layer}:{which}".encode()
    out = b""
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    return out[:size]


def kv_section(tokens: list[int], shape: Shape, *, start: int = 0) -> bytes:
    """One KV cache's ``state_write`` for a sequence of ``tokens`` at positions ``start``..

    ``start`` > 0 is what a sliding-window cache saves: only the cells of its window.
    """
    n = len(tokens)
    out = [struct.pack("<I", shape.streams)]
    for stream in range(shape.streams):
        if stream != 0 or n == 0:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", n))
        for pos in range(start, start + n):
            out.append(struct.pack("<iI", pos, 1))
            if shape.ext:
                out.append(struct.pack("<iii", 0, 0, tokens[pos]))
            out.append(struct.pack("<i", shape.seq))
        out.append(struct.pack("<IIII", int(shape.v_trans), shape.layers, 0, 0))
        for layer in range(shape.layers):
            out.append(struct.pack("<iQ", 1, shape.k_row))
            out.extend(cell_bytes(t, p, layer, "k", shape.k_row) for p, t in enumerate(tokens, start))
        for layer in range(shape.layers):
            cells = [cell_bytes(t, p, layer, "v", shape.v_row) for p, t in enumerate(tokens, start)]
            if not shape.v_trans:
                out.append(struct.pack("<iQ", 1, shape.v_row))
                out.extend(cells)
                continue
            rows = shape.v_row // shape.el
            out.append(struct.pack("<iII", 1, shape.el, rows))
            for j in range(rows):
                out.extend(c[j * shape.el : (j + 1) * shape.el] for c in cells)
    return b"".join(out)


def slot_file(tokens: list[int], shape: Shape, *, sections: int = 1, tail: bytes = b"", window: int = 0) -> bytes:
    """A whole slot file: header, llama-server's packed token payload, ``sections`` KV caches, then ``tail``.

    ``window`` > 0: a last KV cache of only the last ``window`` tokens, as a sliding-window cache saves it.
    """
    words = struct.pack("<iII", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + struct.pack("<I", 0)
    head = struct.pack("<III", MAGIC, VERSION, len(words) // 4)
    kv = b"".join(kv_section(tokens, shape) for _ in range(sections))
    if window:
        cut = max(0, len(tokens) - window)
        kv += kv_section(tokens[cut:], shape, start=cut)
    return head + words + kv + tail
