"""Whole-file snapshots of the slot dir moved into the block store, at start-up. Blocking I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/upgrade.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar.core import errors, hashing, safeio
from sidecar.snapshots import backing, manifest, slotdir

QUARANTINE_SUFFIX = ".quarantined"


@dataclasses.dataclass(frozen=True, slots=True)
class Converted:
    files: int = 0
    bytes: int = 0
    findings: tuple[str, ...] = ()


def convert(slot_dir: slotdir.SlotDir, home: slotdir.SlotDir, blocks: backing.Blocks) -> Converted:
    """Move every committed whole-file snapshot of ``slot_dir`` into ``blocks``, its manifest into ``home``."""
    findings: list[str] = []
    files = size = 0
    try:
        names = set(slot_dir.names())
    except OSError as exc:
        return Converted(findings=(f"the slot dir could not be listed for snapshots to convert: {exc}",))
    for name in sorted(names):
        stem = Path(name).stem
        if not name.endswith(".json") or not manifest.NAME_RE.match(stem + ".bin") or stem + ".bin" not in names:
            continue
        try:
            done = _one(slot_dir, home, blocks, name)
        except (OSError, ValueError, errors.SnapshotError) as exc:
            findings.append(f"{stem}.bin not converted into the block store ({exc}); left in the slot dir")
            continue
        if done is None:
            findings.append(f"{stem}.bin fails its manifest's size or checksum: set aside as {stem}.bin.quarantined")
        elif done:
            files, size = files + 1, size + done
    return Converted(files, size, tuple(findings))


def _one(slot_dir: slotdir.SlotDir, home: slotdir.SlotDir, blocks: backing.Blocks, json_name: str) -> int | None:
    """Bytes converted (0: converted before, only removed now); None: the file failed its check."""
    record = manifest.Manifest.from_json(safeio.read_bounded(slot_dir.path / json_name, manifest.MAX_BYTES).decode())
    stem = Path(record.file).stem
    path = slot_dir.path / record.file
    if not home.exists(json_name):
        st = safeio.lstat_regular(path)
        digest = hashing.file_digest(path, record.checksum.algorithm)
        if st.st_size != record.bytes or digest != record.checksum.digest:
            for name in (json_name, record.file):
                slot_dir.set_aside(name, QUARANTINE_SUFFIX)
            return None
        blocks.ingest(stem, path)
        made = blocks.recipe(stem)
        moved = dataclasses.replace(
            record, checksum=manifest.Checksum(made.algorithm, made.checksum), recipe=stem, bytes=made.size
        )
        try:
            text = moved.to_json()
            home.write_atomically(json_name, text, mode=0o640)
        except BaseException:
            blocks.drop(stem)
            raise
        blocks.wrote_manifest(len(text))
        converted = record.bytes
    else:
        converted = 0
    slot_dir.unlink(json_name)  # the manifest first: a .bin without one is removed as an interrupted save
    slot_dir.unlink(record.file)
    return converted
