"""mounts.small_pages: which mount holds a path, and whether its tmpfs keeps files in small pages."""

from __future__ import annotations

from pathlib import Path

from sidecar.core import mounts

INFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:7 - tmpfs tmpfs rw,size=24683784k
41 22 0:40 / /srv/slots rw,relatime shared:20 - tmpfs tmpfs rw,size=6291456k,huge=within_size
42 22 0:41 / /srv/my\\040slots rw,relatime shared:21 - tmpfs tmpfs rw,size=1g
"""


def test_a_tmpfs_without_huge_pages_is_small_pages_and_a_disk_or_a_huge_tmpfs_is_not() -> None:
    assert mounts.small_pages(INFO, Path("/dev/shm/slots"))
    assert not mounts.small_pages(INFO, Path("/srv/slots"))
    assert not mounts.small_pages(INFO, Path("/srv/slots/a/b"))
    assert not mounts.small_pages(INFO, Path("/var/lib/slots"))  # the root's ext4


def test_the_longest_mount_point_wins_and_escaped_names_are_read() -> None:
    assert mounts.small_pages(INFO, Path("/srv/my slots/x"))
    assert not mounts.small_pages(INFO, Path("/srv/my"))
    hidden = INFO + "50 22 0:50 / /dev/shm rw - tmpfs tmpfs rw,huge=always\n"  # mounted over the first
    assert not mounts.small_pages(hidden, Path("/dev/shm/slots"))


def test_huge_pages_forced_on_every_tmpfs_count_as_huge() -> None:
    assert not mounts.small_pages(INFO, Path("/dev/shm/slots"), "always within_size advise never deny [force]\n")
    assert mounts.small_pages(INFO, Path("/dev/shm/slots"), "always within_size advise [never] deny force\n")
