"""Where a snapshot's bytes live with ``--store-dir``: a recipe in the block store. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/backing.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
from pathlib import Path

from sidecar.blocks import ingest as ingesting
from sidecar.blocks import recipe
from sidecar.blocks import store as blockstore
from sidecar.core import errors, outcomes, protocols, safeio
from sidecar.snapshots import manifest, slotfile

SNAPSHOTS = "snapshots"
"""The folder of ``STORE`` that holds the snapshots' manifests."""
RECIPE_CACHE = 4096
"""Recipes' block lists kept in memory (recipes never change once committed)."""

_PROBLEMS = {
    outcomes.BlockProblem.MISSING: outcomes.SnapshotProblem.SIZE,
    outcomes.BlockProblem.TRUNCATED: outcomes.SnapshotProblem.SIZE,
    outcomes.BlockProblem.CORRUPT: outcomes.SnapshotProblem.CHECKSUM,
    outcomes.BlockProblem.RECIPE: outcomes.SnapshotProblem.MANIFEST,
    outcomes.BlockProblem.NOT_REGULAR: outcomes.SnapshotProblem.NOT_REGULAR,
    outcomes.BlockProblem.IO: outcomes.SnapshotProblem.IO,
}


def snapshot_problem(exc: errors.BlockStoreError) -> outcomes.SnapshotProblem:
    """The snapshot store's reason for a block store refusal: proof of bad content, or an I/O error."""
    return _PROBLEMS.get(outcomes.BlockProblem(exc.reason), outcomes.SnapshotProblem.IO)


def recipe_name(record: manifest.Manifest) -> str:
    return record.recipe or Path(record.file).stem


@dataclasses.dataclass(slots=True)
class Figures:
    """Running totals since start (the metrics' counters) and the bytes staged now (a gauge)."""

    block_bytes_written: int = 0
    manifest_bytes_written: int = 0
    """Recipes and snapshot manifests."""
    deduplicated_bytes: int = 0
    staged_bytes: int = 0


class Blocks:
    """The block store under ``root`` as the snapshot store uses it."""

    def __init__(self, root: Path, *, clock: protocols.Clock) -> None:
        self.root = root
        self.store = blockstore.BlockStore(root, clock=clock)
        self.figures = Figures()
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[tuple[str, int], ...]] = {}

    # ---- writing -----------------------------------------------------------------

    def ingest(self, name: str, source: Path) -> ingesting.Ingested:
        """Store the staged file ``source`` as recipe ``name``; SnapshotError (reason ``io``) if the store cannot."""
        try:
            made = self.store.ingest(name, source)
        except errors.BlockStoreError as exc:
            raise errors.SnapshotError(str(exc), reason=snapshot_problem(exc)) from exc
        except OSError as exc:
            raise errors.SnapshotError(
                f"the block store could not take {source.name}: {exc.strerror or exc}",
                reason=outcomes.SnapshotProblem.IO,
            ) from exc
        with self._lock:
            self.figures.block_bytes_written += made.block_bytes_written
            self.figures.manifest_bytes_written += made.recipe_bytes_written
            self.figures.deduplicated_bytes += made.bytes_deduplicated
        return made

    def wrote_manifest(self, size: int) -> None:
        with self._lock:
            self.figures.manifest_bytes_written += size

    def drop(self, name: str) -> bool:
        self._digests.pop(name, None)
        try:
            return self.store.drop(name)
        except OSError:
            return False

    def collect(self) -> None:
        """Delete the blocks no recipe names, unless an ingest or reassembly holds the store (then: next time)."""
        with contextlib.suppress(OSError):
            self.store.collect(wait=False)

    # ---- reading -----------------------------------------------------------------

    def recipe(self, name: str) -> recipe.Recipe:
        return self.store._recipes.read(name)

    def check(self, record: manifest.Manifest) -> None:
        """Raise SnapshotError unless the recipe matches the manifest and holds every block whole (sizes only).

        The bytes themselves are proven by the reassembly's checksum, right before a restore.
        """
        name = recipe_name(record)
        try:
            made = self.recipe(name)
        except errors.BlockStoreError as exc:
            raise errors.SnapshotError(f"{record.file}: {exc}", reason=snapshot_problem(exc)) from exc
        if made.size != record.bytes or made.checksum != record.checksum.digest:
            raise errors.SnapshotError(
                f"{record.file}: its recipe describes another file ({made.size} bytes) than its manifest "
                f"({record.bytes} bytes)",
                reason=outcomes.SnapshotProblem.MANIFEST,
            )
        blocks = self.store.root / "blocks"
        for block in made.blocks():
            try:
                st = safeio.lstat_regular(blocks / block.digest[:2] / block.digest)
            except FileNotFoundError:
                raise errors.SnapshotError(
                    f"{record.file}: block {block.digest} is missing from the block store",
                    reason=outcomes.SnapshotProblem.SIZE,
                ) from None
            except safeio.Refused as exc:
                raise errors.SnapshotError(
                    f"{record.file}: block {block.digest} refused: {exc}", reason=outcomes.SnapshotProblem.NOT_REGULAR
                ) from exc
            except OSError as exc:
                raise errors.SnapshotError(
                    f"{record.file}: block {block.digest} could not be read: {exc}", reason=outcomes.SnapshotProblem.IO
                ) from exc
            if st.st_size != block.size:
                raise errors.SnapshotError(
                    f"{record.file}: block {block.digest} holds {st.st_size} bytes, its recipe says {block.size}",
                    reason=outcomes.SnapshotProblem.SIZE,
                )

    def stage(self, record: manifest.Manifest, dest: Path, *, reuse: Path | None = None) -> None:
        """Rebuild the exact file of ``record`` at ``dest``, checked against its checksum; SnapshotError if not.

        ``reuse``: a staged file of ours whose pages the rebuild overwrites (it is gone afterwards)."""
        try:
            made = self.recipe(recipe_name(record))
            if made.checksum != record.checksum.digest:
                raise errors.SnapshotError(
                    f"{record.file}: its recipe's checksum is not its manifest's",
                    reason=outcomes.SnapshotProblem.MANIFEST,
                )
            with self._lock:
                self.figures.staged_bytes += made.size
            try:
                self.store.reassemble(made.name, dest, reuse=reuse)
            except BaseException:
                self.unstaged(made.size)
                raise
        except errors.BlockStoreError as exc:
            raise errors.SnapshotError(f"{record.file}: {exc}", reason=snapshot_problem(exc)) from exc
        except OSError as exc:
            raise errors.SnapshotError(
                f"{record.file} could not be rebuilt: {exc.strerror or exc}", reason=outcomes.SnapshotProblem.IO
            ) from exc

    def unstaged(self, size: int) -> None:
        with self._lock:
            self.figures.staged_bytes = max(0, self.figures.staged_bytes - size)

    def digests(self, record: manifest.Manifest) -> tuple[tuple[str, int], ...]:
        """(digest, size) of the blocks of ``record`` (cached); empty if its recipe cannot be read."""
        name = recipe_name(record)
        known = self._digests.get(name)
        if known is None:
            try:
                made = self.recipe(name)
            except errors.BlockStoreError:
                return ()
            known = tuple((b.digest, b.size) for b in made.blocks())
            if len(self._digests) > RECIPE_CACHE:
                self._digests.clear()
            self._digests[name] = known
        return known

    def read_tokens(self, record: manifest.Manifest) -> slotfile.SlotTokens:
        """The token ids at the head of the snapshot's file, from its leading blocks (the file is not rebuilt)."""
        try:
            made = self.recipe(recipe_name(record))
        except errors.BlockStoreError as exc:
            raise slotfile.SlotFileError(str(exc), reason="missing") from exc
        head = bytearray()
        need = slotfile.HEAD_BYTES
        blocks = self.store.root / "blocks"
        for part in made.parts:
            if part.rows or len(head) >= need:
                break
            for block in part.blocks:
                head += safeio.read_bounded(blocks / block.digest[:2] / block.digest, block.size)
                if len(head) >= slotfile.HEAD_BYTES:
                    need = slotfile.head_size(bytes(head[: slotfile.HEAD_BYTES]))
                if len(head) >= need:
                    break
        return slotfile.read_tokens_from(io.BytesIO(bytes(head)), made.size, record.file)

    def usage(self) -> blockstore.Usage:
        return self.store.usage()

    def orphans(self, names: set[str]) -> list[str]:
        """Recipes no manifest names (an ingest that died before its manifest)."""
        return [n for n in self.store.names() if n not in names]


def remove_quietly(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True
