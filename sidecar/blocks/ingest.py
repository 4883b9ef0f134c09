"""Ingest: a file into blocks the store lacks, then its recipe. Blocking I/O.

The file is mapped (``mmap``), cut by :func:`layout.plan`, and each block
hashed where it lies (a run's blocks are slices of the mapping; a grid's
are gathered row piece by row piece). A block the store holds is counted,
not written; the others are written once each (see
:class:`~sidecar.blocks.blockdir.BlockDir`). Only once every block is
durable is the recipe committed: a crash anywhere before leaves blocks no
recipe names (collected later) and never a recipe that names a block the
store lacks. The caller holds the store's lock shared meanwhile (see
:mod:`~sidecar.blocks.locking`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
from collections.abc import Iterator

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
    blocks: blockdir.BlockDir, recipes: recipedir.RecipeDir, name: str, source: int, *, now: float, tokens: int
) -> Ingested:
    """Store the regular file open at ``source`` (a descriptor) as recipe ``name``."""
    recipes.of(name)  # a bad name fails before any block is written
    size = os.fstat(source).st_size
    mapped = mmap.mmap(source, size, prot=mmap.PROT_READ) if size else None
    try:
        with memoryview(mapped if mapped is not None else b"") as view:
            if mapped is not None:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            cut = layout.plan(view, chunking.cuts, tokens=tokens)
            checksum = xxhash.xxh3_128(view).hexdigest()
            made_parts: list[recipe.Part] = []
            written = written_bytes = 0
            regions: dict[parts.Region, list[int]] = {}
            for part in cut.parts:
                made: list[recipe.Block] = []
                for data in _pieces(view, part):
                    try:
                        digest = hashlib.sha256(data).hexdigest()
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


def _pieces(view: memoryview, part: parts.Part) -> Iterator[memoryview | bytearray]:
    """The bytes of each block of ``part``, in order."""
    if isinstance(part, parts.Run):
        pos = part.offset
        for cut in part.cuts:
            yield view[pos : pos + cut]
            pos += cut
        return
    width = sum(part.cuts)
    col = 0
    for cut in part.cuts:
        out = bytearray(cut * part.rows)
        src = part.offset + col
        for row in range(part.rows):
            out[row * cut : (row + 1) * cut] = view[src : src + cut]
            src += width
        yield out
        col += cut
