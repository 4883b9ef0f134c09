"""Ingest: a file into blocks the store lacks, then its recipe. Blocking I/O.

The file is mapped (``mmap``), cut by :func:`layout.plan`, and each block
hashed where it lies (a run's blocks are slices of the mapping; a grid's
are gathered row piece by row piece). A full K/V range is one block, or
its finer pieces when the store holds the first of them (see
:func:`_choose`). A block the store holds is counted,
not written; the others are written once each (see
:class:`~sidecar.blocks.blockdir.BlockDir`). Only once every block is
durable is the recipe committed: a crash anywhere before leaves blocks no
recipe names (collected later) and never a recipe that names a block the
store lacks. The caller holds the store's lock shared meanwhile (see
:mod:`~sidecar.blocks.locking`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
from collections.abc import Callable, Iterator

import xxhash

from sidecar.blocks import blockdir, chunking, layout, parts, recipe, recipedir
from sidecar.core import hashing


@dataclasses.dataclass(frozen=True, slots=True)
class RegionBytes:
    region: parts.Region
    bytes: int
    """Bytes of the file in this region."""
    written: int
    """Of them, bytes in blocks the store did not hold."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ingested:
    """What one ingest wrote and what it did not need to."""

    name: str
    layout: parts.Layout
    file_bytes: int
    blocks: int
    blocks_written: int
    block_bytes_written: int
    bytes_deduplicated: int
    """Bytes of blocks the store already held (or that came earlier in the same file): not written."""
    recipe_bytes_written: int
    regions: tuple[RegionBytes, ...]

    @property
    def dedup_fraction(self) -> float:
        """Share of the file's bytes the store already held: 0 for a first file, near 1 for a repeat."""
        return self.bytes_deduplicated / self.file_bytes if self.file_bytes else 0.0


def ingest(
    blocks: blockdir.BlockDir,
    recipes: recipedir.RecipeDir,
    name: str,
    source: int,
    *,
    now: float,
    tokens: int,
    fine: int = layout.FINE,
) -> Ingested:
    """Store the regular file open at ``source`` (a descriptor) as recipe ``name``."""
    recipes.of(name)  # a bad name fails before any block is written
    size = os.fstat(source).st_size
    mapped = mmap.mmap(source, size, prot=mmap.PROT_READ) if size else None
    try:
        with memoryview(mapped if mapped is not None else b"") as view:
            if mapped is not None:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            cut = layout.plan(view, chunking.cuts, tokens=tokens, fine=fine)
            checksum = xxhash.xxh3_128(view).hexdigest()
            made_parts: list[recipe.Part] = []
            written = written_bytes = 0
            regions: dict[parts.Region, list[int]] = {}
            for part in cut.parts:
                made: list[recipe.Block] = []
                for data, known in _pieces(view, part, blocks.holds):
                    try:
                        digest = known or hashlib.sha256(data).hexdigest()
                        new = blocks.put(digest, data)
                    finally:  # also when the write fails (a full disk): a slice left unreleased pins the mapping
                        length = len(data)
                        if isinstance(data, memoryview):
                            data.release()
                    written += new
                    written_bytes += length if new else 0
                    tally = regions.setdefault(part.region, [0, 0])
                    tally[0] += length
                    tally[1] += length if new else 0
                    made.append(recipe.Block(digest, length))
                made_parts.append(
                    recipe.Part(part.region, part.rows if isinstance(part, parts.Grid) else 0, tuple(made))
                )
    finally:
        if mapped is not None:
            mapped.close()
    blocks.sync()
    committed = recipe.Recipe(name, size, checksum, hashing.Algorithm.XXH3_128, cut.layout, now, tuple(made_parts))
    recipe_bytes = recipes.write(committed)
    return Ingested(
        name=name,
        layout=cut.layout,
        file_bytes=size,
        blocks=sum(len(p.blocks) for p in made_parts),
        blocks_written=written,
        block_bytes_written=written_bytes,
        bytes_deduplicated=size - written_bytes,
        recipe_bytes_written=recipe_bytes,
        regions=tuple(RegionBytes(r, t[0], t[1]) for r, t in regions.items()),
    )


Held = Callable[[str, int], bool]
"""Whether the store holds the block of this digest and size."""


def _pieces(view: memoryview, part: parts.Part, held: Held) -> Iterator[tuple[memoryview | bytearray, str]]:
    """The bytes of each block of ``part``, in order, each with its sha256 when it was taken already ("" if not)."""
    fine = part.fine or ((),) * len(part.cuts)
    last = max((i for i, split in enumerate(fine) if split), default=-1)
    pos = 0
    for i, (cut, split) in enumerate(zip(part.cuts, fine, strict=True)):
        digest, cuts = _choose(view, part, pos, cut, split, held, last=i == last) if split else ("", (cut,))
        at = pos
        for piece in cuts:
            yield _column(view, part, at, piece), digest
            at += piece
        pos += cut


def _choose(
    view: memoryview, part: parts.Part, pos: int, cut: int, split: tuple[int, ...], held: Held, *, last: bool
) -> tuple[str, tuple[int, ...]]:
    """How to store a cut that has a finer split: (its digest, (cut,)) or ("", the split).

    One block if the store holds it; else the pieces if the store holds the first of them (the range was
    the tail of an earlier save: only the pieces it lacks are new); else, new bytes, one block (fewer,
    larger blocks), but for the ``last`` full range of the layer: its pieces, since a conversation
    sharing this one's prompt most often parts from it there (the end of a system prompt, just before the
    first turn) and then finds the pieces before that point. Every byte is in exactly one block either
    way: the choice changes what is written, never what is rebuilt.
    """
    with _released(_column(view, part, pos, cut)) as whole:
        digest = hashlib.sha256(whole).hexdigest()
        if held(digest, len(whole)):
            return digest, (cut,)
    if last:
        return "", split
    with _released(_column(view, part, pos, split[0])) as first:
        if held(hashlib.sha256(first).hexdigest(), len(first)):
            return "", split
    return digest, (cut,)


@contextlib.contextmanager
def _released(data: memoryview | bytearray) -> Iterator[memoryview | bytearray]:
    """``data``, released at the end (a slice left unreleased pins the mapping)."""
    try:
        yield data
    finally:
        if isinstance(data, memoryview):
            data.release()


def _column(view: memoryview, part: parts.Part, at: int, cut: int) -> memoryview | bytearray:
    """The bytes of the block ``cut`` bytes wide at ``at`` bytes into ``part`` (into each row of a grid)."""
    if isinstance(part, parts.Run):
        return view[part.offset + at : part.offset + at + cut]
    width = sum(part.cuts)
    out = bytearray(cut * part.rows)
    src = part.offset + at
    for row in range(part.rows):
        out[row * cut : (row + 1) * cut] = view[src : src + cut]
        src += width
    return out
