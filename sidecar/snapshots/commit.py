"""The checks and names of a commit: what :meth:`Writer.commit` does before a file is visible.

Pure of state: each function works on the slot dir it is given and raises
``errors.SnapshotError`` (with a :class:`outcomes.SnapshotProblem` reason) when a
check fails, removing the file it was checking. The order of the steps is in
:mod:`sidecar.snapshots.store`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from sidecar.core import errors, hashing, outcomes, safeio
from sidecar.snapshots import backing, manifest, slotdir, slotfile, storeevents


@contextlib.contextmanager
def removed_if_failed(fs: slotdir.SlotDir, name: str, doing: str) -> Iterator[None]:
    """Remove ``name`` if the block raises; an OSError becomes a SnapshotError (``io``) saying what failed."""
    try:
        yield
    except safeio.Refused as exc:
        fs.unlink(name)
        raise errors.SnapshotError(f"{doing} refused: {exc}", reason=outcomes.SnapshotProblem.NOT_REGULAR) from exc
    except hashing.Overdue as exc:
        fs.unlink(name)
        raise errors.SnapshotError(f"{doing}: {exc}", reason=outcomes.SnapshotProblem.IO) from exc
    except OSError as exc:
        fs.unlink(name)
        raise errors.SnapshotError(
            f"{doing} failed: {slotdir.describe(exc)}", reason=outcomes.SnapshotProblem.IO
        ) from exc
    except BaseException:
        fs.unlink(name)
        raise


def check_written(fs: slotdir.SlotDir, temp: str, *, tokens: int, written: int, blocked: str) -> os.stat_result:
    """The ``lstat`` of the server's file ``temp`` once it passed the checks that need no read.

    The file must have one name: a file the server just wrote has, and a hard link to a file elsewhere
    (planted at the temp name) would have its mode changed by the commit.
    """
    if blocked:
        raise errors.SnapshotError(blocked, reason=outcomes.SnapshotProblem.IO)
    try:
        st = safeio.lstat_regular(fs.path / temp)
        size = st.st_size
    except FileNotFoundError as exc:
        raise errors.SnapshotError(
            f"the server reported writing {temp} but it is not in {fs.path}: "
            "--slot-dir must be the same directory as llama-server's --slot-save-path",
            reason=outcomes.SnapshotProblem.MISSING,
        ) from exc
    if tokens <= 0:
        raise errors.SnapshotError(
            "the server saved 0 tokens: the slot is empty", reason=outcomes.SnapshotProblem.EMPTY
        )
    if size != written:
        raise errors.SnapshotError(
            f"{temp} has {size} bytes but the server reported writing {written}", reason=outcomes.SnapshotProblem.SIZE
        )
    if st.st_nlink != 1:
        raise safeio.Refused(
            f"{temp} has {st.st_nlink} names: not a file the server just wrote", reason=safeio.NOT_REGULAR
        )
    return st


def still_same(fs: slotdir.SlotDir, temp: str, checked: os.stat_result) -> None:
    """Refuse ``temp`` if its name no longer holds the file that was checked and hashed (a swap before the rename)."""
    if not safeio.same_file(safeio.lstat_regular(fs.path / temp), checked):
        raise safeio.Refused(f"{temp} was replaced after it was checked", reason=safeio.NOT_REGULAR)


def read_index(path: Path, events: storeevents.StoreEvents) -> manifest.Index | None:
    """The content index of a checked file; None (reported) when its token header cannot be read."""
    try:
        held = slotfile.read_tokens(path)
    except slotfile.SlotFileError as exc:
        events.unindexed(path.name, exc.reason)
        return None
    except safeio.Refused as exc:
        events.unindexed(path.name, exc.reason)
        return None
    except OSError as exc:
        events.unindexed(path.name, slotdir.describe(exc))
        return None
    return manifest.Index(
        held.count, slotfile.BLOCK_TOKENS, slotfile.prefix_hashes(held.data), slotfile.whole_hash(held.data)
    )


def free_name(directory: Path, prefix: str, slot: int, now: float) -> str:
    """``<prefix>slot<id>-<stamp>.bin`` for ``now``, moved on by microseconds if a file has that name."""
    stamp = datetime.datetime.fromtimestamp(now, datetime.UTC)
    while True:
        final = f"{prefix}slot{slot}-{stamp.strftime('%Y%m%dT%H%M%S%fZ')}.bin"
        if not (directory / final).exists() and not (directory / (Path(final).stem + ".json")).exists():
            return final
        stamp += datetime.timedelta(microseconds=1)


Make = Callable[[str, manifest.Checksum, manifest.Index | None, float], manifest.Manifest]
"""(final name, checksum, content index, created) → the manifest to commit (its ``bytes`` and ``recipe`` set after)."""


def commit_to_blocks(
    staging: slotdir.SlotDir,
    home: slotdir.SlotDir,
    blocks: backing.Blocks,
    temp: str,
    *,
    slot: int,
    tokens: int,
    written: int,
    blocked: str,
    events: storeevents.StoreEvents,
    make: Make,
    prefix: str,
    now: float,
) -> manifest.Manifest:
    """Commit the staged ``temp`` into the block store: checks, ingest (recipe), manifest last, staged file deleted.

    The recipe is committed before the manifest, so a manifest never names a missing recipe; a manifest that
    cannot be written drops its recipe (its new blocks go at the next collection). The staged file is deleted
    whatever happens: the slot dir holds nothing of ours once this returns.
    """
    path = staging.path / temp
    with removed_if_failed(staging, temp, f"committing {temp}"):
        checked = check_written(staging, temp, tokens=tokens, written=written, blocked=blocked)
        content = read_index(path, events)
        final = free_name(home.path, prefix, slot, now)
        stem = Path(final).stem
        blocks.ingest(stem, path)
        still_same(staging, temp, checked)
        made = blocks.recipe(stem)
        record = dataclasses.replace(
            make(final, manifest.Checksum(made.algorithm, made.checksum), content, now),
            bytes=made.size,
            recipe=stem,
        )
        try:
            text = record.to_json()
            home.write_atomically(stem + ".json", text, mode=0o640)
        except BaseException:
            blocks.drop(stem)
            raise
        blocks.wrote_manifest(len(text))
    staging.unlink(temp)
    return record
