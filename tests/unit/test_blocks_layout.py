"""The cut of a slot file into blocks (sidecar.blocks.layout): pure code, on slot files made in memory."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.blocks import chunking, kvcache, layout, parts
from tests.support import slotfiles

SHAPES = {
    "flash attention": slotfiles.Shape(),
    "V transposed": slotfiles.Shape(v_trans=True, v_row=32, el=2),
    "M-RoPE cell extension": slotfiles.Shape(ext=True),
    "two streams": slotfiles.Shape(streams=2),
}


def plan(data: bytes, tokens: int = 16) -> parts.Plan:
    return layout.plan(memoryview(data), chunking.cuts, tokens=tokens)


def blocks(data: bytes, cut: parts.Plan) -> list[tuple[parts.Region, str]]:
    """(region, sha256) of each block, gathered as the ingest gathers them."""
    out: list[tuple[parts.Region, str]] = []
    for part in cut.parts:
        if isinstance(part, parts.Run):
            pos = part.offset
            for c in part.cuts:
                out.append((part.region, hashlib.sha256(data[pos : pos + c]).hexdigest()))
                pos += c
            continue
        width, col = sum(part.cuts), 0
        for c in part.cuts:
            rows = b"".join(
                data[part.offset + r * width + col : part.offset + r * width + col + c] for r in range(part.rows)
            )
            out.append((part.region, hashlib.sha256(rows).hexdigest()))
            col += c
    return out


def tiles(data: bytes, cut: parts.Plan) -> bool:
    pos = 0
    for part in cut.parts:
        if part.offset != pos or any(c <= 0 for c in part.cuts):
            return False
        pos += part.length
    return pos == len(data)


def kv_blocks(data: bytes, cut: parts.Plan) -> list[str]:
    return [d for r, d in blocks(data, cut) if r in (parts.Region.KEYS, parts.Region.VALUES)]


def test_every_shape_is_read_as_kv_and_its_parts_tile_the_file() -> None:
    for name, shape in SHAPES.items():
        data = slotfiles.slot_file(list(range(100)), shape)
        cut = plan(data)
        assert cut.layout is parts.Layout.KV, name
        assert tiles(data, cut), name
        regions = {p.region for p in cut.parts}
        assert {parts.Region.HEADER, parts.Region.TOKENS, parts.Region.CELLS} <= regions, name
        assert parts.Region.GLUE not in regions, name


def test_a_transposed_v_layer_is_a_grid_of_its_rows() -> None:
    shape = slotfiles.Shape(v_trans=True, v_row=32, el=2)
    cut = plan(slotfiles.slot_file(list(range(40)), shape))
    grids = [p for p in cut.parts if isinstance(p, parts.Grid)]
    assert len(grids) == shape.layers
    assert all(g.rows == 16 and g.cuts == (32, 32, 16) for g in grids)  # 40 cells of 2 bytes, 16 per block


def test_shared_prefix_gives_the_same_kv_blocks_across_slots_and_shapes() -> None:
    common = list(range(1000, 1064))  # four full blocks of 16 tokens
    for name, shape in SHAPES.items():
        a = slotfiles.slot_file([*common, 1, 2, 3], shape)
        b = slotfiles.slot_file([*common, 7, 8, 9, 10, 11], dataclasses.replace(shape, seq=1))
        in_a = set(kv_blocks(a, plan(a)))
        in_b = kv_blocks(b, plan(b))
        shared = [d for d in in_b if d in in_a]
        # every layer's K and V: the 4 full blocks of the prefix match, the tails differ; a transposed
        # V layer's 12-byte header (type, element size, rows) is a block of its own, the same in both
        headers = shape.layers if shape.v_trans else 0
        assert len(shared) == 4 * 2 * shape.layers + headers, name


def test_successive_saves_differ_only_in_the_last_block_of_each_layer() -> None:
    tokens = list(range(500, 600))
    first = slotfiles.slot_file(tokens[:70], slotfiles.Shape())
    second = slotfiles.slot_file(tokens, slotfiles.Shape())
    old = set(kv_blocks(first, plan(first)))
    new = kv_blocks(second, plan(second))
    assert len(new) == 2 * 3 * 7  # 100 cells: 6 full blocks and a tail, per layer, K and V
    assert sum(d not in old for d in new) == 2 * 3 * 3  # blocks 4 (was partial), 5, 6 (tail) are new


def test_a_sliding_window_cache_is_cut_by_position_so_successive_windows_line_up() -> None:
    """A sliding-window cache saves the cells of its window only: each save starts at another position."""
    tokens = list(range(3000, 3120))
    first = slotfiles.slot_file(tokens[:100], slotfiles.Shape(), window=40)  # window: positions 60..99
    second = slotfiles.slot_file(tokens[:110], slotfiles.Shape(), window=40)  # 70..109
    old = set(kv_blocks(first, plan(first)))
    new = kv_blocks(second, plan(second))
    full, window = new[: 2 * 3 * 7], new[2 * 3 * 7 :]
    assert len(window) == 2 * 3 * 3  # positions 70-79, 80-95, 96-109 of each layer, K and V
    assert sum(d in old for d in full) == 2 * 3 * 6  # the full cache: all but the tail block
    # positions 80-95 are a block of both windows, though one starts at cell 20 of its window and one at cell 10
    assert sum(d in old for d in window) == 2 * 3


def test_groups_cut_where_a_position_enters_another_aligned_range() -> None:
    assert kvcache.groups(range(30, 70), 16) == (2, 16, 16, 6)
    assert kvcache.groups(range(0, 32), 16) == (16, 16)
    assert kvcache.groups([], 16) == ()
    jumping = [i * 37 % 1000 for i in range(64)]  # positions all over: cells counted instead
    assert kvcache.groups(jumping, 16) == (16, 16, 16, 16)


def test_two_kv_caches_in_a_row_are_both_read() -> None:
    """Sliding-window models write the base cache, then the SWA one."""
    data = slotfiles.slot_file(list(range(50)), slotfiles.Shape(), sections=2)
    cut = plan(data)
    assert cut.layout is parts.Layout.KV
    assert sum(p.region is parts.Region.KEYS for p in cut.parts) == 2 * 3


def test_state_after_the_kv_cache_is_chunked_by_content() -> None:
    """A hybrid model's recurrent state follows its attention KV: the parser stops, FastCDC goes on."""
    tail = struct.pack("<I", 1) + bytes(range(256)) * 1000
    data = slotfiles.slot_file(list(range(50)), slotfiles.Shape(), tail=tail)
    cut = plan(data)
    assert cut.layout is parts.Layout.MIXED
    assert tiles(data, cut)
    assert cut.parts[-1].region is parts.Region.OPAQUE


def test_another_version_or_magic_is_chunked_whole() -> None:
    data = bytearray(slotfiles.slot_file(list(range(50)), slotfiles.Shape()))
    for at, value in ((4, 5), (0, 0x12345678)):
        changed = bytearray(data)
        struct.pack_into("<I", changed, at, value)
        cut = plan(bytes(changed))
        assert cut.layout is parts.Layout.OPAQUE
        assert {p.region for p in cut.parts} == {parts.Region.OPAQUE}
        assert tiles(bytes(changed), cut)


def test_a_truncated_slot_file_still_tiles() -> None:
    data = slotfiles.slot_file(list(range(60)), slotfiles.Shape(v_trans=True, v_row=32))
    for end in (0, 5, 12, 200, len(data) // 2, len(data) - 1):
        cut = plan(data[:end])
        assert tiles(data[:end], cut), end
        assert cut.layout is not parts.Layout.KV or end == len(data), end


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_are_tiled(data: bytes) -> None:
    assert tiles(data, plan(data))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=80),
    trans=st.booleans(),
    ext=st.booleans(),
    flip=st.integers(min_value=0, max_value=10**6),
)
def test_slot_files_with_a_damaged_byte_still_tile(n: int, trans: bool, ext: bool, flip: int) -> None:
    data = bytearray(slotfiles.slot_file(list(range(n)), slotfiles.Shape(v_trans=trans, ext=ext)))
    data[flip % len(data)] ^= 0xFF
    assert tiles(bytes(data), plan(bytes(data)))


def test_chunking_cuts_sum_to_the_buffer_and_follow_content() -> None:
    body = hashlib.sha256(b"x").digest() * 20000
    a = chunking.cuts(memoryview(body))
    b = chunking.cuts(memoryview(b"inserted" + body))
    assert sum(a) == len(body)
    assert sum(b) == len(body) + 8
    assert chunking.cuts(memoryview(b"")) == []
