"""The content-addressed block store: files in, exact files out, shared blocks kept once. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/blocks/store.py`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sidecar.blocks import assemble, blockdir, collect, ingest, layout, locking, recipedir
from sidecar.core import errors, protocols, safeio


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """What the store holds against what it represents."""

    blocks: int
    unique_bytes: int
    """Bytes of the block files: what the disk holds (temp files not counted)."""
    recipes: int
    represented_bytes: int
    """Sum of the committed files' sizes: what the store would hold without sharing blocks."""
    unreadable: tuple[str, ...] = ()


class BlockStore:
    def __init__(
        self, root: Path, *, clock: protocols.Clock, tokens: int = layout.TOKENS, fine: int = layout.FINE
    ) -> None:
        """``tokens``: cells per K/V block (see :data:`layout.TOKENS`); ``fine``: cells per block of a range
        filled in part or grown save by save (:data:`layout.FINE`). Either may change between runs: a file
        cut otherwise only dedups less against what the store holds, and rebuilds the same."""
        self.root = root
        self._clock = clock
        self._tokens = tokens
        self._fine = fine
        (root / "blocks").mkdir(parents=True, exist_ok=True)
        (root / "recipes").mkdir(exist_ok=True)
        self._recipes = recipedir.RecipeDir(root / "recipes")
        self._tallies = blockdir.Tallies()

    def ingest(self, name: str, source: Path) -> ingest.Ingested:
        """Store the regular file at ``source`` (never a link) as ``name``, replacing any recipe of that name."""
        fd, _ = safeio.open_regular(source)
        try:
            with locking.held(self.root, exclusive=False):
                return ingest.ingest(
                    blockdir.BlockDir(self.root / "blocks"),
                    self._recipes,
                    name,
                    fd,
                    now=self._clock.wall(),
                    tokens=self._tokens,
                    fine=self._fine,
                )
        finally:
            os.close(fd)

    def reassemble(self, name: str, dest: Path, *, reuse: Path | None = None) -> assemble.Assembled:
        """Write the file committed as ``name`` to ``dest``; BlockStoreError (naming the block) if it cannot.

        ``reuse``: a file whose pages the rebuild overwrites (see :func:`assemble.reassemble`)."""
        with locking.held(self.root, exclusive=False):
            made = self._recipes.read(name)
            return assemble.reassemble(blockdir.BlockDir(self.root / "blocks"), made, dest, reuse=reuse)

    def names(self) -> list[str]:
        return self._recipes.names()

    def drop(self, name: str) -> bool:
        """Uncommit ``name`` (False if absent); its blocks no other recipe names go at the next collection."""
        return self._recipes.remove(name)

    def collect(self, *, wait: bool = True) -> collect.Collected:
        """Delete unreferenced blocks and dead temp files; ``wait=False``: give up at once if the store is in use."""
        with locking.held(self.root, exclusive=True, wait=wait) as got:
            if not got:
                return collect.Collected(collect.Outcome.BUSY)
            return collect.collect(blockdir.BlockDir(self.root / "blocks"), self._recipes)

    def usage(self) -> Usage:
        """Blocks and recipes as they are on disk now (no lock: a snapshot of a moving store); the blocks counted
        per folder, each listed again only once it changed (:class:`blockdir.Tallies`)."""
        held = self._tallies.total(blockdir.BlockDir(self.root / "blocks"))
        represented, names = 0, self._recipes.names()
        unreadable: list[str] = []
        for name in names:
            try:
                represented += self._recipes.read(name).size
            except errors.BlockStoreError:  # a damaged recipe is reported, not raised, by a status read
                unreadable.append(name)
        return Usage(held.blocks, held.bytes, len(names), represented, tuple(unreadable))
