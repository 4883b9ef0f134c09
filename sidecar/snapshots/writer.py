"""Snapshots committed: a file the server wrote checked, hashed and published. Blocking I/O."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from sidecar.core import apikeys, hashing
from sidecar.snapshots import backing, manifest, slotdir
from sidecar.snapshots import commit as checks
from sidecar.snapshots.directory import FILE_MODE, PROBE_PREFIX, TEMP_PREFIX, Directory
from sidecar.snapshots.staging import Staging

PROBE_BYTES = 4096
"""Bytes :meth:`Writer.probe_write` writes: one page, enough to find a full or read-only disk."""


class Writer:
    """Commits the files the server of one view wrote; ``model``: its model (see ``SnapshotStore.for_model``)."""

    def __init__(self, directory: Directory, staging: Staging, model: str | None) -> None:
        self._dir = directory
        self._staging = staging
        self._model = model
        self._prefix = "" if model is None else manifest.model_tag(model) + "--"

    def temp_name(self, slot: int) -> str:
        return f"{TEMP_PREFIX}{self._prefix}slot{slot}-{secrets.token_hex(6)}.bin"

    def probe_name(self) -> str:
        return f"{PROBE_PREFIX}{secrets.token_hex(6)}.bin"

    def probe_write(self) -> str | None:
        """None if a small file can be written and synced where manifests are kept, else why not.

        Asked while that disk refuses saves (see :mod:`sidecar.save.storefault`); the file is removed at once,
        and a probe file left by a crash goes at the next start-up's scan.
        """
        path = self._dir.path / self.probe_name()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            backing.remove_quietly(path)
            return slotdir.describe(exc)
        backing.remove_quietly(path)
        return None

    def commit(
        self,
        temp: str,
        *,
        slot: int,
        tokens: int,
        written: int,
        task: int | None,
        fingerprint: manifest.Fingerprint,
        pause: float = 0.0,
        created: float | None = None,
        prefill_rate: float | None = None,
        owner: str = apikeys.NOBODY,
    ) -> manifest.Manifest:
        """Check, hash and publish a file the server just wrote; see the module docstring.

        ``pause``: the hash's pause after each chunk (``hashing.PACE`` while other slots generate).
        ``created``: Unix time of the server's save (None: now); a commit made later than the save
        (see :mod:`sidecar.save.snapshotter`) still dates the snapshot by its content.
        ``prefill_rate``: the writing server's measured prompt tokens per second (see ``Manifest``).
        ``owner``: whose conversation the slot held (see ``Manifest``).
        """

        def make(
            final: str, checksum: manifest.Checksum, content: manifest.Index | None, now: float, size: int = 0
        ) -> manifest.Manifest:
            return manifest.Manifest(
                slot=slot,
                file=final,
                tokens=tokens,
                bytes=size,
                checksum=checksum,
                generation=self._dir.index.next_generation(),
                created=now,
                task=task,
                fingerprint=fingerprint,
                index=content,
                model=self._model,
                prefill_rate=prefill_rate,
                owner=owner,
            )

        if self._dir.blocks is not None:
            with self._staging.released(temp):
                committed = checks.commit_to_blocks(
                    self._staging.staged_in(temp),
                    self._dir.fs,
                    self._dir.blocks,
                    temp,
                    slot=slot,
                    tokens=tokens,
                    written=written,
                    blocked=self._dir.index.blocked,
                    events=self._dir.events,
                    make=make,
                    prefix=self._prefix,
                    now=self._dir.clock.wall() if created is None else created,
                )
            return self._publish(committed)
        fs, path = self._dir.fs, self._dir.path / temp
        with checks.removed_if_failed(fs, temp, f"committing {temp}"):
            checked = checks.check_written(fs, temp, tokens=tokens, written=written, blocked=self._dir.index.blocked)
            size = checked.st_size
            # The mode is set through the descriptor that hashed the file: a link planted at the temp name
            # after the server wrote it makes the commit fail, and changes no other file.
            digest = hashing.digest_and_sync(path, pause=pause, limit=size, mode=FILE_MODE, same_as=checked)
            content = checks.read_index(path, self._dir.events)
            now = self._dir.clock.wall() if created is None else created
            final = checks.free_name(self._dir.path, self._prefix, slot, now)
            record = make(final, manifest.Checksum(hashing.CURRENT, digest), content, now, size)
            checks.still_same(fs, temp, checked)
            os.replace(path, self._dir.path / final)
        with checks.removed_if_failed(fs, final, f"writing the manifest of {final}"):
            fs.write_atomically(Path(final).stem + ".json", record.to_json(), mode=FILE_MODE)
        return self._publish(record)

    def _publish(self, record: manifest.Manifest) -> manifest.Manifest:
        self._dir.index.put(record)
        for listener in self._dir.listeners:
            listener(record)
        return record

    def check_written(self, temp: str, *, tokens: int, written: int) -> None:
        """The cheap checks of :meth:`commit` (the file is here, holds tokens, has the size the server
        reported), made right after the save when its commit waits; raises ``errors.SnapshotError``
        and removes the file when one fails."""
        staged = self._staging.staged_in(temp)
        with self._staging.released_if_failed(temp), checks.removed_if_failed(staged, temp, f"checking {temp}"):
            checks.check_written(staged, temp, tokens=tokens, written=written, blocked=self._dir.index.blocked)
