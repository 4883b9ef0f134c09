"""A disk that refuses a save: which fault, and when a save is worth trying again (pure)."""

from __future__ import annotations

import errno

import pytest

from sidecar.core import errors, outcomes
from sidecar.save import storefault


def _wrapped(code: int) -> errors.SnapshotError:
    """As the commit raises it: a SnapshotError from the OSError of the write."""
    try:
        try:
            raise OSError(code, "refused")
        except OSError as exc:
            raise errors.SnapshotError("committing failed", reason=outcomes.SnapshotProblem.IO) from exc
    except errors.SnapshotError as outer:
        return outer


@pytest.mark.parametrize(
    ("code", "fault"),
    [
        (errno.ENOSPC, outcomes.StoreFault.NO_SPACE),
        (errno.EDQUOT, outcomes.StoreFault.NO_SPACE),
        (errno.EROFS, outcomes.StoreFault.READ_ONLY),
        (errno.EACCES, outcomes.StoreFault.DENIED),
        (errno.EIO, None),
    ],
)
def test_the_fault_is_read_from_the_write_error_behind_the_snapshot_error(
    code: int, fault: outcomes.StoreFault | None
) -> None:
    assert storefault.classify(_wrapped(code)) is fault


def test_a_snapshot_error_of_content_is_no_disk_fault() -> None:
    assert storefault.classify(errors.SnapshotError("bad size", reason=outcomes.SnapshotProblem.SIZE)) is None


def test_a_full_disk_is_tried_again_only_once_room_came_back_and_a_read_only_one_at_each_probe() -> None:
    full = storefault.Episode(outcomes.StoreFault.NO_SPACE, free_bytes=1 << 20, detail="")
    assert not storefault.worth_probing(full, free_bytes=1 << 20)
    assert not storefault.worth_probing(full, free_bytes=(1 << 20) + storefault.ROOM - 1)
    assert storefault.worth_probing(full, free_bytes=(1 << 20) + storefault.ROOM)
    read_only = storefault.Episode(outcomes.StoreFault.READ_ONLY, free_bytes=1 << 30, detail="")
    assert storefault.worth_probing(read_only, free_bytes=0)  # the probe write decides
