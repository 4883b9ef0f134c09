"""Reassembly: a recipe's blocks back into the exact file, checked before anyone sees it. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/blocks/assemble.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import secrets
import stat
from pathlib import Path

import xxhash

from sidecar.blocks import blockdir, recipe
from sidecar.core import errors, hashing, outcomes, safeio

TEMP_PREFIX = ".tmp-"


@dataclasses.dataclass(frozen=True, slots=True)
class Assembled:
    name: str
    bytes: int
    blocks: int


def reassemble(blocks: blockdir.BlockDir, made: recipe.Recipe, dest: Path, *, reuse: Path | None = None) -> Assembled:
    """Write the file of ``made`` to ``dest`` (replacing it), byte-identical and checked.

    ``reuse``: a file of ours beside ``dest`` whose pages are overwritten rather than new ones allocated
    (taken by a rename: it is gone afterwards, whatever happens; a link or anything but a regular file
    there is removed, unread and unwritten, and a new file made).
    """
    temp = dest.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}-{dest.name}"[:255]
    out = _open_temp(temp, reuse)
    try:
        try:
            digest = _write(blocks, made, out)
            os.ftruncate(out, made.size)  # a reused file longer than this one loses its tail
        finally:
            os.close(out)
        if made.algorithm is not hashing.Algorithm.XXH3_128 or digest != made.checksum:
            _blame(blocks, made)
        os.replace(temp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return Assembled(made.name, made.size, len(made.blocks()))


def _open_temp(temp: Path, reuse: Path | None) -> int:
    """A descriptor open for writing at offset 0 on ``temp``: ``reuse`` renamed to it, or a new file."""
    if reuse is not None:
        try:
            os.rename(reuse, temp)
        except OSError:
            pass  # none to reuse (taken, given up) or not renamable: a new file
        else:
            try:  # not a link, a FIFO (O_NONBLOCK: no wait for a reader) nor a file linked elsewhere too
                fd = os.open(temp, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    return fd
            if fd >= 0:
                os.close(fd)
            os.unlink(temp)
    return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)


def _write(blocks: blockdir.BlockDir, made: recipe.Recipe, out: int) -> str:
    hasher = xxhash.xxh3_128()
    largest = max((b.size for b in made.blocks()), default=0)
    grid = max((p.size for p in made.parts if p.rows), default=0)
    buf = mmap.mmap(-1, max(largest, 1))
    table = mmap.mmap(-1, max(grid, 1))
    try:
        with memoryview(buf) as view, memoryview(table) as rows:
            for part in made.parts:
                if not part.rows:
                    for block in part.blocks:
                        data = _read(blocks, made.name, block, view)
                        hasher.update(data)
                        _write_all(out, data)
                        data.release()
                    continue
                width, col = part.width, 0
                for block in part.blocks:
                    data = _read(blocks, made.name, block, view)
                    cut = block.size // part.rows
                    for row in range(part.rows):
                        at = row * width + col
                        rows[at : at + cut] = data[row * cut : (row + 1) * cut]
                    data.release()
                    col += cut
                hasher.update(rows[: part.size])
                _write_all(out, rows[: part.size])
    finally:
        buf.close()
        table.close()
    return hasher.hexdigest()


def _read(blocks: blockdir.BlockDir, name: str, block: recipe.Block, view: memoryview) -> memoryview:
    """The bytes of ``block`` in ``view``; BlockStoreError if it is missing, not regular or of another size."""
    try:
        fd, st = safeio.open_regular(blocks.of(block.digest))
    except FileNotFoundError as exc:
        raise _error(name, block, outcomes.BlockProblem.MISSING, "is missing from the block store") from exc
    except safeio.Refused as exc:
        raise _error(name, block, outcomes.BlockProblem.NOT_REGULAR, f"is refused: {exc}") from exc
    except OSError as exc:
        raise _error(name, block, outcomes.BlockProblem.IO, f"could not be opened: {exc.strerror or exc}") from exc
    try:
        if st.st_size != block.size:
            raise _error(
                name, block, outcomes.BlockProblem.TRUNCATED, f"holds {st.st_size} bytes, its recipe says {block.size}"
            )
        got = 0
        while got < block.size:
            n = os.readv(fd, [view[got : block.size]])
            if n <= 0:
                raise _error(
                    name, block, outcomes.BlockProblem.TRUNCATED, f"ended after {got} of its {block.size} bytes"
                )
            got += n
    except OSError as exc:
        raise _error(name, block, outcomes.BlockProblem.IO, f"could not be read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return view[: block.size]


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _blame(blocks: blockdir.BlockDir, made: recipe.Recipe) -> None:
    """Raise naming the first block whose bytes do not hash to its name (the file failed its checksum)."""
    for block in made.blocks():
        try:
            actual = hashing.file_digest(blocks.of(block.digest), hashing.Algorithm.SHA256)
        except OSError as exc:
            raise _error(made.name, block, outcomes.BlockProblem.IO, f"could not be read: {exc}") from exc
        if actual != block.digest:
            raise _error(made.name, block, outcomes.BlockProblem.CORRUPT, "no longer holds the bytes it is named for")
    raise errors.BlockStoreError(
        f"the file rebuilt from recipe {made.name!r} fails its checksum although every block is intact: "
        "the recipe does not describe the file it was made from",
        reason=outcomes.BlockProblem.CORRUPT,
        name=made.name,
    )


def _error(name: str, block: recipe.Block, reason: outcomes.BlockProblem, what: str) -> errors.BlockStoreError:
    return errors.BlockStoreError(
        f"block {block.digest} of recipe {name!r} {what}: the file cannot be rebuilt; "
        "every other recipe that does not name this block still can",
        reason=reason,
        name=name,
        block=block.digest,
    )
