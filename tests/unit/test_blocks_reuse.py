"""A rebuild over a reused file's pages: byte-identical, refused whole on a bad block, never written through a link."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.blocks import recipe
from sidecar.core import errors, outcomes
from tests.unit import test_blocks_store as blocks_tests


def _staging(tmp_path: Path) -> Path:
    folder = tmp_path / "staging"
    folder.mkdir()
    return folder


def _garbage(path: Path, size: int) -> int:
    path.write_bytes(random.Random(size).randbytes(size))
    return os.stat(path).st_ino


@pytest.mark.parametrize("spare_size", [1, 10_000, 300_000], ids=["smaller", "near", "larger"])
def test_a_rebuild_over_a_reused_file_is_byte_identical_whatever_its_size(tmp_path: Path, spare_size: int) -> None:
    s, _, b = blocks_tests.ingest_two(tmp_path)
    folder = _staging(tmp_path)
    spare = folder / ".tmp-spare"
    inode = _garbage(spare, spare_size)

    s.reassemble("b", folder / "b.bin", reuse=spare)

    assert (folder / "b.bin").read_bytes() == b
    assert os.stat(folder / "b.bin").st_ino == inode  # its pages, not new ones
    assert sorted(p.name for p in folder.iterdir()) == ["b.bin"]


def test_no_file_to_reuse_makes_a_new_one(tmp_path: Path) -> None:
    s, _, b = blocks_tests.ingest_two(tmp_path)
    folder = _staging(tmp_path)
    s.reassemble("b", folder / "b.bin", reuse=folder / ".tmp-spare")
    assert (folder / "b.bin").read_bytes() == b


def _middle_block(made: recipe.Recipe, tmp_path: Path) -> tuple[str, Path]:
    others = recipe.Recipe.from_json((tmp_path / "store" / "recipes" / "b.json").read_text()).digests()
    own = [blk.digest for blk in made.blocks() if blk.digest not in others]
    digest = own[len(own) // 2]
    return digest, tmp_path / "store" / "blocks" / digest[:2] / digest


@pytest.mark.parametrize("reused", [True, False], ids=["over-a-reused-file", "into-a-new-file"])
def test_a_corrupt_block_mid_stream_refuses_the_file_and_leaves_nothing_visible(tmp_path: Path, reused: bool) -> None:
    s, made, b = blocks_tests.ingest_two(tmp_path)
    digest, path = _middle_block(made, tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    folder = _staging(tmp_path)
    spare = folder / ".tmp-spare"
    if reused:
        _garbage(spare, 50_000)

    with pytest.raises(errors.BlockStoreError) as refused:
        s.reassemble("a", folder / "a.bin", reuse=spare if reused else None)

    assert refused.value.reason == outcomes.BlockProblem.CORRUPT
    assert refused.value.block == digest
    assert list(folder.iterdir()) == []  # no partial file under any name, the reused one included
    s.reassemble("b", folder / "b.bin")
    assert (folder / "b.bin").read_bytes() == b


def test_a_link_a_fifo_or_a_file_linked_elsewhere_at_the_reuse_name_is_never_written_through(tmp_path: Path) -> None:
    s, _, b = blocks_tests.ingest_two(tmp_path)
    folder = _staging(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not ours")
    spare = folder / ".tmp-spare"
    plants: list[Callable[[], None]] = [
        lambda: spare.symlink_to(outside),
        lambda: os.link(outside, spare),
        lambda: os.mkfifo(spare),
    ]
    for plant in plants:
        plant()
        s.reassemble("b", folder / "b.bin", reuse=spare)
        assert (folder / "b.bin").read_bytes() == b
        assert outside.read_bytes() == b"not ours"
        assert sorted(p.name for p in folder.iterdir()) == ["b.bin"]
