"""Staging on the store's disk when the slot dir lacks room: a link in the slot dir, the file under the store."""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.core import outcomes, protocols
from sidecar.snapshots import spill, store
from tests.support import told


def test_a_file_fits_with_a_sixteenth_and_a_mebibyte_to_spare() -> None:
    assert spill.fits(100 << 20, 0)
    assert spill.fits((17 << 20) + spill.HEADROOM, 16 << 20)
    assert not spill.fits((17 << 20) + spill.HEADROOM - 1, 16 << 20)


def test_a_save_without_room_is_written_through_a_link_and_committed_from_the_store_disk(tmp_path: Path) -> None:
    slot_dir, store_dir = tmp_path / "slots", tmp_path / "store"
    slot_dir.mkdir()
    said = told.Told()
    snaps = store.SnapshotStore(slot_dir, clock=protocols.SystemClock(), events=said, store_dir=store_dir)
    temp = snaps.writer.temp_name(0)
    free = os.statvfs(slot_dir).f_bavail * os.statvfs(slot_dir).f_frsize
    assert snaps.staged.place_save(temp, 1000) is None  # room: the slot dir
    assert snaps.staged.place_save(temp, free) is outcomes.StagingFallback.NO_ROOM
    link = slot_dir / temp
    assert link.is_symlink()
    assert os.readlink(link) == str(store_dir / spill.FOLDER / temp)
    assert said.on_disk == [(temp, outcomes.StagingFallback.NO_ROOM, free)]
    with open(link, "wb") as fh:  # as llama-server writes it: through the name it was given
        fh.write(b"x" * 4096)
    assert snaps.staged.staged_bytes() == 0, "RAM holds nothing: the bytes are on the store's disk"
    snaps.staged.remove(temp)  # a save that failed, or was abandoned
    assert not os.path.lexists(link)
    assert list((store_dir / spill.FOLDER).iterdir()) == []
