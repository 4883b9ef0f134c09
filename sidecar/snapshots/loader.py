"""The index rebuilt from the manifests on disk: start-up scans, rescans, one file re-read. Blocking I/O."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sidecar.core import errors, outcomes, safeio
from sidecar.snapshots import backing, manifest, slotdir
from sidecar.snapshots.curator import Curator
from sidecar.snapshots.directory import PROBE_PREFIX, QUARANTINE_SUFFIX, TEMP_PREFIX, Directory

READ_ATTEMPTS = 3
"""Reads of a manifest before an I/O error is reported (and left for the next scan)."""
RETRY_PAUSE = 0.05
"""Seconds before the second read; doubled before the third."""


class _BadContent(Exception):
    def __init__(self, reason: outcomes.SnapshotProblem, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class Loader:
    """Keeps the index true to the manifests on disk; bad ones go to ``curator``'s quarantine."""

    def __init__(self, directory: Directory, curator: Curator) -> None:
        self._dir = directory
        self._curator = curator

    def scan(self, *, clean: bool) -> list[str]:
        """Rebuild the index from the manifests on disk; returns log-worthy findings.

        With ``clean``, also delete leftovers of interrupted saves: temp files,
        probe files and ``.bin`` files without a manifest. Only do that at
        start-up, when no save of ours can be in flight. A directory that
        cannot be listed leaves the index as it was; a missing one empties it.
        """
        findings: list[str] = []
        fs = self._dir.fs
        try:
            names = set(fs.names())  # not only regular files: a hostile one is refused by name
        except FileNotFoundError as exc:
            fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            names = set()
        except OSError as exc:
            fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            return findings
        before = self._dir.index.copy()
        found: dict[str, manifest.Manifest] = {}
        for name in sorted(names):
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
                if clean and fs.unlink(name):
                    findings.append(f"removed {name}: left over from an interrupted save")
                continue
            bin_name = Path(name).stem + ".bin"
            if not name.endswith(".json") or not manifest.NAME_RE.match(bin_name):
                continue  # not a manifest: quarantined, or a file of ours (.llama-kv-sidecar.*) or someone else's
            try:
                loaded = self._load(name)
            except OSError:
                loaded = before.get(bin_name)  # unreadable for now: keep what was known, retry next scan
            if loaded is not None:
                found[loaded.file] = loaded
        if clean:
            for name in sorted(names):
                stem_json = Path(name).stem + ".json"
                orphan = manifest.NAME_RE.match(name) and name not in found and stem_json not in names
                if orphan and fs.unlink(name):
                    findings.append(f"removed {name}: its save was interrupted before the manifest was written")
        if clean and self._dir.blocks is not None:
            findings += self._clean_blocks({Path(f).stem for f in found})
        self._dir.index.replace(found)
        return findings

    def _clean_blocks(self, stems: set[str]) -> list[str]:
        """Leftovers of a block store: recipes of ingests that died before their manifest, staged files."""
        assert self._dir.blocks is not None
        findings = []
        try:
            for name in self._dir.blocks.orphans(stems):
                if self._dir.blocks.drop(name):
                    findings.append(f"dropped recipe {name}: its commit was interrupted before the manifest")
            staged = self._dir.staging.names()
        except OSError as exc:
            self._dir.fs.failed(outcomes.SlotDirOperation.SCAN, exc)
            return findings
        for name in staged:
            if name.startswith((TEMP_PREFIX, PROBE_PREFIX)) and self._dir.staging.unlink(name):
                findings.append(f"removed {name} from the slot dir: left over from an interrupted save or restore")
        if self._dir.spill is not None:
            findings += self._dir.spill.clean()
        self._dir.blocks.collect()
        return findings

    def refresh(self, name: str) -> None:
        """Re-read one file after a filesystem event."""
        if name.endswith(QUARANTINE_SUFFIX) or name.startswith((TEMP_PREFIX, PROBE_PREFIX)):
            return
        stem = Path(name).stem
        bin_name, json_name = stem + ".bin", stem + ".json"
        if not manifest.NAME_RE.match(bin_name):
            return
        try:
            present = os.path.lexists(self._dir.path / json_name) and (
                self._dir.blocks is not None or os.path.lexists(self._dir.path / bin_name)
            )
            loaded = self._load(json_name) if present else None
        except OSError:
            return  # reported by _load or below; the index keeps what it knew
        if loaded is None:
            self._dir.index.pop(bin_name)
        else:
            self._dir.index.put(loaded)

    def _load(self, json_name: str) -> manifest.Manifest | None:
        """Read and check one manifest; None if it is gone, bad (then quarantined) or of a newer format.

        Raises OSError when every read failed with an I/O error (already reported).
        """
        bin_name = Path(json_name).stem + ".bin"
        for attempt in range(READ_ATTEMPTS):
            try:
                return self._read(json_name, bin_name)
            except FileNotFoundError:
                return None  # deleted or renamed since the listing
            except manifest.NewerFormatError as exc:
                if json_name not in self._dir.newer_said:
                    self._dir.newer_said.add(json_name)
                    self._dir.events.newer_format(json_name, exc.found)
                return None
            except _BadContent as bad:
                self._curator.quarantine(bin_name, bad.reason, detail=bad.detail)
                return None
            except OSError as exc:
                if attempt + 1 == READ_ATTEMPTS:
                    self._dir.events.io_error(outcomes.SlotDirOperation.READ, json_name, slotdir.describe(exc))
                    raise
                time.sleep(RETRY_PAUSE * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, json_name: str, bin_name: str) -> manifest.Manifest:
        try:
            raw = safeio.read_bounded(self._dir.path / json_name, manifest.MAX_BYTES)
        except safeio.Refused as exc:
            raise _BadContent(outcomes.SnapshotProblem(exc.reason), f"manifest refused unread: {exc}") from exc
        try:
            loaded = manifest.Manifest.from_json(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, str(exc)) from exc
        if bin_name != loaded.file:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, "manifest names another file")
        if self._dir.blocks is not None:
            return self._read_recipe(loaded)
        try:
            size = safeio.lstat_regular(self._dir.path / loaded.file).st_size
        except safeio.Refused as exc:
            raise _BadContent(outcomes.SnapshotProblem.NOT_REGULAR, f"snapshot refused: {exc}") from exc
        except FileNotFoundError:
            if not os.path.lexists(self._dir.path / json_name):
                raise  # both gone: deleted meanwhile, not damage
            raise _BadContent(outcomes.SnapshotProblem.SIZE, "snapshot file is missing") from None
        if size != loaded.bytes:
            raise _BadContent(outcomes.SnapshotProblem.SIZE, f"{size} bytes on disk, manifest says {loaded.bytes}")
        return loaded

    def _read_recipe(self, loaded: manifest.Manifest) -> manifest.Manifest:
        """``loaded`` if its recipe is in the block store with its size; bad content if not, OSError if unreadable."""
        assert self._dir.blocks is not None
        if loaded.recipe is None:
            raise _BadContent(outcomes.SnapshotProblem.MANIFEST, "a manifest of the block store names no recipe")
        try:
            size = self._dir.blocks.recipe(loaded.recipe).size
        except errors.BlockStoreError as exc:
            reason = backing.snapshot_problem(exc)
            if reason not in outcomes.BAD_CONTENT:
                raise OSError(str(exc)) from exc
            raise _BadContent(reason, str(exc)) from exc
        if size != loaded.bytes:
            raise _BadContent(
                outcomes.SnapshotProblem.SIZE, f"its recipe holds {size} bytes, manifest says {loaded.bytes}"
            )
        return loaded
