"""Content-defined chunking: the cut for bytes whose layout :mod:`~sidecar.blocks.layout` does not know. Pure code.

FastCDC 2020 (the ``pyfastcdc`` package, a Cython port of the Rust
``fastcdc`` crate's v2020 module) puts a cut where a rolling hash of the
last bytes matches a mask, so a cut depends on the bytes around it, not on
its offset: bytes inserted or removed upstream shift the cuts with them, and
the chunks after them still match. Measured on two real slot files sharing
86.5% of their tokens, 16 KiB chunks found 85.6% of the second in the first,
64 KiB chunks 82.3%; the fallback takes 64 KiB, a
quarter of the files for a few points, since what reaches it (recurrent
state, a layout of another build) dedups little anyway.
"""

from __future__ import annotations

import pyfastcdc

AVERAGE = 64 << 10
"""Average chunk: 64 KiB (FastCDC's minimum is a quarter of it, its maximum four times)."""


def cuts(buf: memoryview) -> list[int]:
    """The lengths of ``buf``'s chunks, in order; they sum to ``len(buf)`` (an empty buffer has none)."""
    if not len(buf):
        return []
    chunker = pyfastcdc.FastCDC(AVERAGE)  # one per call: an instance must not be shared between threads
    return [chunk.length for chunk in chunker.cut_buf(buf)]
