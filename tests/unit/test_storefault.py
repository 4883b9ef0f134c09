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


def test_a_full_disk_is_tried_again_once_room_came_back_or_the_backoff_passed_and_a_read_only_one_at_each_probe() -> (
    None
):
    full = storefault.Episode(outcomes.StoreFault.NO_SPACE, free_bytes=1 << 20, detail="", at=100.0)
    assert not storefault.worth_probing(full, free_bytes=1 << 20, now=100.0)
    assert not storefault.worth_probing(full, free_bytes=(1 << 20) + storefault.ROOM - 1, now=100.0)
    assert storefault.worth_probing(full, free_bytes=(1 << 20) + storefault.ROOM, now=100.0)
    read_only = storefault.Episode(outcomes.StoreFault.READ_ONLY, free_bytes=1 << 30, detail="", at=100.0)
    assert storefault.worth_probing(read_only, free_bytes=0, now=100.0)  # the probe write decides


def test_a_full_disk_whose_space_came_back_before_its_baseline_was_read_is_tried_again_after_the_backoff() -> None:
    """A file that filled the disk for a moment and went away before the failed save's baseline was read: the
    free space never grows by ROOM over that baseline, and saves used to stay skipped until retention freed
    ROOM (in the soak, 80 s of conversations lost)."""
    full = storefault.Episode(outcomes.StoreFault.NO_SPACE, free_bytes=600 << 20, detail="", at=100.0)
    wait = storefault.backoff(0)
    assert wait == storefault.RETRY_FIRST
    assert not storefault.worth_probing(full, free_bytes=590 << 20, now=100.0 + wait - 0.1)
    assert storefault.worth_probing(full, free_bytes=590 << 20, now=100.0 + wait)


def test_each_failed_retry_doubles_the_wait_up_to_its_bound() -> None:
    waits = [storefault.backoff(n) for n in range(12)]
    assert waits[:3] == [storefault.RETRY_FIRST, 2 * storefault.RETRY_FIRST, 4 * storefault.RETRY_FIRST]
    assert waits == sorted(waits)
    assert max(waits) == storefault.RETRY_MOST
    again = storefault.Episode(outcomes.StoreFault.NO_SPACE, free_bytes=0, detail="", at=0.0, retries=2)
    assert not storefault.worth_probing(again, free_bytes=0, now=4 * storefault.RETRY_FIRST - 0.1)
    assert storefault.worth_probing(again, free_bytes=0, now=4 * storefault.RETRY_FIRST)
