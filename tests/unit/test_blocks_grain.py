"""The finer grain of a range a save fills in part (sidecar.blocks.kvcache.grains, ingest's choice)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.blocks import blockdir, kvcache, parts, store
from tests.support import clocks, slotfiles

TOKENS, FINE = 64, 8
SHAPES = [slotfiles.Shape(), slotfiles.Shape(v_trans=True, v_row=32, el=2)]


def bounds(cuts: tuple[int, ...]) -> set[int]:
    out, at = set(), 0
    for n in cuts:
        at += n
        out.add(at)
    return out


@given(st.integers(0, 40), st.integers(0, 400), st.sampled_from([(64, 8), (64, 16), (256, 16), (16, 16), (64, 24)]))
def test_grains_tile_the_cells_and_split_only_what_a_range_does_not_fill(
    start: int, n: int, sizes: tuple[int, int]
) -> None:
    tokens, fine = sizes
    positions = list(range(start, start + n))
    cuts, alternatives = kvcache.grains(positions, tokens, fine)
    assert sum(cuts) == n
    assert all(c > 0 for c in cuts)
    coarse = kvcache.groups(positions, tokens)
    if fine >= tokens or tokens % fine:
        assert (cuts, alternatives) == (coarse, ())
        return
    assert bounds(coarse) <= bounds(cuts) <= bounds(kvcache.groups(positions, fine))  # a refinement, aligned
    assert not alternatives or len(alternatives) == len(cuts)
    for cut, split in zip(cuts, alternatives or ((),) * len(cuts), strict=True):
        assert cut <= fine or cut == tokens  # a range not filled is cut at the finer grain
        if split:
            assert cut == tokens
            assert sum(split) == cut
            assert all(0 < s <= fine for s in split)


def test_grains_of_a_growing_conversation() -> None:
    cuts, alternatives = kvcache.grains(range(150), 64, 8)
    assert cuts == (64, 64, 8, 8, 6)  # two full ranges, then the range filled in part at the finer grain
    assert alternatives == ((8,) * 8, (8,) * 8, (), (), ())


def _save(s: store.BlockStore, folder: Path, name: str, tokens: list[int], shape: slotfiles.Shape) -> int:
    """Ingest a slot file of ``tokens``; the K and V bytes it wrote."""
    path = folder / f"{name}.bin"
    data = slotfiles.slot_file(tokens, shape)
    path.write_bytes(data)
    got = s.ingest(name, path)
    out = folder / f"{name}.out"
    s.reassemble(name, out)
    assert out.read_bytes() == data  # byte-identical, whichever grain each range took
    return sum(r.written for r in got.regions if r.region in (parts.Region.KEYS, parts.Region.VALUES))


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=2, max_size=6), st.sampled_from(SHAPES))
def test_a_conversation_growing_turn_by_turn_writes_its_new_cells_and_one_finer_piece_at_most(
    turns: list[int], shape: slotfiles.Shape
) -> None:
    """Save after save, a layer writes the new cells plus the previous save's last, partial piece: at most
    ``FINE`` cells more, where a whole ``TOKENS`` range used to be written again (fails with no finer grain)."""
    per_cell = shape.layers * (shape.k_row + shape.v_row)
    sequence = list(range(7000, 7000 + sum(turns)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        s = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=FINE)
        end = 0
        for i, turn in enumerate(turns):
            written = _save(s, folder, f"s{i}", sequence[: end + turn], shape)
            if i:
                assert written <= per_cell * (turn + FINE), (i, end, turn)
            end += turn


def test_the_next_save_of_a_long_turn_writes_no_more_than_the_coarse_grain_would() -> None:
    """A range the previous save filled less than a finer piece of is written as one block: never more."""
    shape = slotfiles.Shape()
    per_cell = shape.layers * (shape.k_row + shape.v_row)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        s = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=FINE)
        sequence = list(range(100, 400))
        assert _save(s, folder, "a", sequence[:131], shape) == per_cell * 131 + 16 + 12 * 2 * shape.layers  # + headers
        assert _save(s, folder, "b", sequence[:260], shape) == per_cell * (260 - 128)  # 128..131 again


def test_a_prompt_prefilled_at_once_is_full_blocks_and_its_tail_finer_pieces_shared_across_conversations() -> None:
    shape = slotfiles.Shape()
    per_cell = shape.layers * (shape.k_row + shape.v_row)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        s = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=FINE)
        prompt = list(range(5000, 5150))  # two full ranges and 22 cells of a third
        _save(s, folder, "a", [*prompt, 1, 2, 3], shape)
        # the other conversation shares the prompt: only its own 4 cells and the piece they end are new
        assert _save(s, folder, "b", [*prompt, 9, 9, 9, 9], shape) == per_cell * (150 - 144 + 4)
        made = s._recipes.read("a")
        keys = next(p for p in made.parts if p.region is parts.Region.KEYS)
        # the first range one block (headers first), the last full one in pieces, then the tail's pieces
        assert [b.size // shape.k_row for b in keys.blocks] == [64, *[8] * 8, 8, 8, 8, 1]
        assert keys.blocks[0].size == 16 + 12 + 64 * shape.k_row


def test_a_conversation_parting_from_a_shared_prompt_in_its_last_full_range_writes_from_the_piece_it_parts_in() -> None:
    """The last full range of a new file is stored in pieces: another conversation sharing the prompt up to
    a point inside it finds the pieces before that point (a whole block would differ)."""
    shape = slotfiles.Shape()
    per_cell = shape.layers * (shape.k_row + shape.v_row)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        s = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=FINE)
        prompt = list(range(6000, 6110))  # parts at 110: inside the range 64..127, full in both files
        _save(s, folder, "a", [*prompt, *range(20)], shape)
        assert _save(s, folder, "b", [*prompt, *range(50, 70)], shape) == per_cell * (130 - 104)


def test_a_store_written_with_whole_ranges_only_still_restores_and_its_full_ranges_are_found() -> None:
    """A store of the version before (every range one block, the tail too) rebuilds as it did, and the
    next save of the conversation writes only the range it ended in and what is new."""
    shape = slotfiles.Shape()
    per_cell = shape.layers * (shape.k_row + shape.v_row)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sequence = list(range(900, 1200))
        old = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=TOKENS)
        _save(old, folder, "before", sequence[:150], shape)
        new = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 2.0), tokens=TOKENS, fine=FINE)
        new.reassemble("before", folder / "again.bin")
        assert (folder / "again.bin").read_bytes() == slotfiles.slot_file(sequence[:150], shape)
        assert _save(new, folder, "after", sequence[:170], shape) == per_cell * (170 - 128)


def test_collection_after_saves_in_pieces_keeps_every_block_a_recipe_names_and_nothing_else() -> None:
    shape = slotfiles.Shape(v_trans=True, v_row=32, el=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        s = store.BlockStore(folder / "store", clock=clocks.reading(lambda: 1.0), tokens=TOKENS, fine=FINE)
        sequence = list(range(300, 600))
        for i, end in enumerate((70, 95, 140, 200)):
            _save(s, folder, f"s{i}", sequence[:end], shape)
        assert s.drop("s0")
        assert s.drop("s2")
        s.collect()
        named = set().union(*(s._recipes.read(n).digests() for n in s.names()))
        held = {d for d, _, _ in blockdir.BlockDir(s.root / "blocks").entries() if d}
        assert held == named
        for name, end in (("s1", 95), ("s3", 200)):
            s.reassemble(name, folder / "back.bin")
            assert (folder / "back.bin").read_bytes() == slotfiles.slot_file(sequence[:end], shape)
