"""The slot file head parser and the prefix hash chain, on files laid out as llama-server writes them."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.snapshots import slotfile

KV_TAIL = b"\x07" * 64
"""Stands for the KV data after the token words; the parser must not read into it."""


def _packed(ids: list[int], *, version: int = slotfile.PACKED_VERSION, media: int = 0) -> bytes:
    return struct.pack("<iII", -1, version, len(ids)) + slotfile.pack_ids(ids) + struct.pack("<I", media)


def _file(tmp_path: Path, words: bytes, *, magic: int = slotfile.MAGIC, version: int = slotfile.VERSION) -> Path:
    assert len(words) % 4 == 0
    path = tmp_path / "slot.bin"
    path.write_bytes(struct.pack("<III", magic, version, len(words) // 4) + words + KV_TAIL)
    return path


def test_packed_token_state_is_read(tmp_path: Path) -> None:
    ids = [2, 105, 2364, 107, 9, 0, 262143]
    got = slotfile.read_tokens(_file(tmp_path, _packed(ids)))
    assert got.count == len(ids)
    assert got.data == slotfile.pack_ids(ids)


def test_plain_token_list_of_older_servers_is_read(tmp_path: Path) -> None:
    ids = [2, 651, 6037, 576]
    got = slotfile.read_tokens(_file(tmp_path, slotfile.pack_ids(ids)))
    assert got.data == slotfile.pack_ids(ids)


def test_empty_slot_file_holds_no_tokens(tmp_path: Path) -> None:
    assert slotfile.read_tokens(_file(tmp_path, b"")).count == 0


@pytest.mark.parametrize(
    ("words", "kw", "reason"),
    [
        (_packed([1, 2]), {"magic": 0x46554747}, "magic"),
        (_packed([1, 2]), {"version": 3}, "version"),
        (_packed([1, 2], version=2), {}, "version"),
        (struct.pack("<iII", -1, 1, 50) + slotfile.pack_ids([1, 2]), {}, "truncated"),
        (struct.pack("<iI", -1, 1), {}, "truncated"),
    ],
)
def test_unreadable_files_fail_closed(tmp_path: Path, words: bytes, kw: dict[str, int], reason: str) -> None:
    with pytest.raises(slotfile.SlotFileError) as caught:
        slotfile.read_tokens(_file(tmp_path, words, **kw))
    assert caught.value.reason == reason


def test_word_count_beyond_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    path.write_bytes(struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, 1 << 30))
    with pytest.raises(slotfile.SlotFileError) as caught:
        slotfile.read_tokens(path)
    assert caught.value.reason == "truncated"


def test_short_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    path.write_bytes(b"ggsq")
    with pytest.raises(slotfile.SlotFileError) as caught:
        slotfile.read_tokens(path)
    assert caught.value.reason == "short"


def test_partial_last_block_is_not_hashed() -> None:
    assert len(slotfile.prefix_hashes(slotfile.pack_ids(list(range(10))), block=4)) == 2
    assert slotfile.prefix_hashes(slotfile.pack_ids([1, 2, 3]), block=4) == ()


ids_strategy = st.lists(st.integers(min_value=0, max_value=262143), max_size=40)


@given(common=ids_strategy, a=ids_strategy, b=ids_strategy)
def test_shared_hashes_are_exactly_the_shared_prefix_blocks(common: list[int], a: list[int], b: list[int]) -> None:
    left, right = common + a, common + b
    prefix = 0
    while prefix < min(len(left), len(right)) and left[prefix] == right[prefix]:
        prefix += 1
    block = 4
    shared = slotfile.shared_blocks(
        slotfile.prefix_hashes(slotfile.pack_ids(left), block=block),
        slotfile.prefix_hashes(slotfile.pack_ids(right), block=block),
    )
    assert shared == min(prefix // block, len(left) // block, len(right) // block)
