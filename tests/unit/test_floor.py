"""The free-space floor's pure decisions: what a save writes where (floor), and what makes room (make_room)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.save import policy
from sidecar.snapshots import floor, retention, spill
from tests.unit.test_policy import snap

GB, MB, GIB = 10**9, 10**6, 1 << 30


# ---- what a save writes where -----------------------------------------------------------


@given(whole=st.integers(0, 1 << 40), free=st.integers(0, 1 << 40), min_free=st.integers(0, 1 << 40))
def test_whole_files_decide_as_before(whole: int, free: int, min_free: int) -> None:
    """No --store-dir: the slot dir's filesystem against the whole file, the rule it always had."""
    got = floor.whole_files(whole_bytes=whole, free_bytes=free)
    assert got.disk is floor.Disk.SLOT_DIR
    assert (got.short(min_free) > 0) == (free - whole < min_free)


def test_a_block_store_counts_the_new_tail_not_the_whole_file() -> None:
    """A 6 GB slot whose newest snapshot holds all but its last 50 MB, on a store disk with 1.5 GiB free."""
    tokens, held = 60_000, 59_500  # 100 KB a token
    new = floor.tail_bytes(tokens=tokens, held_tokens=held, whole_bytes=6 * GB, fixed=0)
    assert 50 * MB <= new <= 50 * MB + floor.BLOCK_TOKENS * 100_000  # each layer's partial block written again
    got = floor.block_store(
        whole_bytes=6 * GB, new_bytes=new, store_free=GIB + GIB // 2, staging_free=8 * GB, shares_disk=False
    )
    assert got.disk is floor.Disk.STORE
    assert not got.staged
    assert got.short(GIB) == 0
    assert got.bytes < 100 * MB
    assert floor.whole_files(whole_bytes=6 * GB, free_bytes=GIB + GIB // 2).short(GIB) > 0  # as before


def test_nothing_held_or_no_fit_is_the_whole_file() -> None:
    assert floor.tail_bytes(tokens=1000, held_tokens=0, whole_bytes=7777, fixed=0) == 7777
    assert floor.tail_bytes(tokens=1000, held_tokens=2000, whole_bytes=7777, fixed=0) == 7777  # another conversation
    assert floor.tail_bytes(tokens=1000, held_tokens=1000, whole_bytes=7777, fixed=0) == 7777  # changed, not grown
    assert floor.tail_bytes(tokens=1000, held_tokens=900, whole_bytes=7777, fixed=None) == 7777  # nothing fitted
    assert floor.tail_bytes(tokens=1000, held_tokens=900, whole_bytes=10_000, fixed=0) == 3560  # 100 + 256 tokens


def test_the_part_that_does_not_grow_is_written_again() -> None:
    """Gemma 3's files as measured: 2,043 tokens in 14,179,756 bytes, 2,142 in 14,485,468; a fit from two
    snapshots far enough apart, and a grown save counts the fixed part (what the real save wrote)."""
    per_token, fixed = 3088, 7_870_000
    sizes = [(2043, fixed + per_token * 2043), (600, fixed + per_token * 600), (1900, fixed + per_token * 1900)]
    assert floor.fixed_bytes(sizes) == fixed  # from the newest and the farthest (600)
    whole = fixed + per_token * 2142
    new = floor.tail_bytes(tokens=2142, held_tokens=2043, whole_bytes=whole, fixed=fixed)
    assert fixed + per_token * (99 + floor.BLOCK_TOKENS) - 2 <= new <= fixed + per_token * (99 + floor.BLOCK_TOKENS)
    assert floor.fixed_bytes(sizes[:1]) is None
    assert floor.fixed_bytes([(2043, 100), (2000, 90)]) is None  # too close to tell
    assert floor.fixed_bytes([(1000, 10_000), (2000, 20_000)]) == 0  # attention only: all of it grows
    assert floor.fixed_bytes([(1000, 10_000), (2000, 9_000)]) == 10_000  # shrank: all of it counted again


def test_the_staged_file_counts_on_the_store_disk_when_the_slot_dir_lacks_room_or_is_that_disk() -> None:
    whole, new = 6 * GB, 50 * MB
    roomy = floor.block_store(whole_bytes=whole, new_bytes=new, store_free=0, staging_free=8 * GB, shares_disk=False)
    tight = floor.block_store(whole_bytes=whole, new_bytes=new, store_free=0, staging_free=GB, shares_disk=False)
    same = floor.block_store(whole_bytes=whole, new_bytes=new, store_free=0, staging_free=8 * GB, shares_disk=True)
    assert (roomy.staged, tight.staged, same.staged) == (False, True, True)
    assert tight.bytes == same.bytes == roomy.bytes + whole
    assert spill.fits(8 * GB, whole)  # the same rule the save's staging follows
    assert not spill.fits(GB, whole)


def test_before_any_snapshot_nothing_is_estimated() -> None:
    got = floor.block_store(whole_bytes=0, new_bytes=0, store_free=5, staging_free=None, shares_disk=True)
    assert (got.bytes, got.short(5), got.short(6)) == (0, 0, 1)


# ---- making room -----------------------------------------------------------------------


def kept(name: str, used: float, size: int = 100, blocks: tuple[tuple[str, int], ...] = ()) -> retention.Kept:
    return retention.Kept(file=name, prefix=(), bytes=size, generation=int(used), last_used=used, blocks=blocks)


def test_the_least_recently_used_go_first_and_just_enough() -> None:
    library = [kept("c", 30.0), kept("a", 10.0), kept("b", 20.0), kept("d", 40.0)]
    # 150 bytes to write, 60 free, floor 50: 140 short -> a (100), b (200): enough.
    got = retention.make_room(library, in_use=(), need=150, free=60, floor=50)
    assert [k.file for k in got] == ["a", "b"]


def test_nothing_goes_when_the_save_fits_or_when_all_would_not_do() -> None:
    library = [kept("a", 10.0), kept("b", 20.0), kept("c", 30.0)]
    assert retention.make_room(library, in_use=(), need=100, free=200, floor=100) == []
    assert retention.make_room(library, in_use=("c",), need=300, free=100, floor=100) == []  # a+b free 200 < 300
    assert [k.file for k in retention.make_room(library, in_use=("a",), need=300, free=150, floor=50)] == ["b", "c"]


def test_shared_blocks_free_nothing_while_a_kept_snapshot_names_them() -> None:
    common = (("p1", 1000), ("p2", 1000))
    old = kept("old", 10.0, blocks=(*common, ("o", 10)))
    newer = kept("newer", 20.0, blocks=(*common, ("n", 10)))
    other = kept("other", 30.0, blocks=(("x", 500),))
    # 15 short: deleting "old" frees only its own block (10), "newer" then frees the shared prefix too.
    got = retention.make_room([old, newer, other], in_use=(), need=15, free=0, floor=0)
    assert [k.file for k in got] == ["old", "newer"]
    assert retention.make_room([old, newer, other], in_use=("newer",), need=15, free=0, floor=0)[-1].file == "other"


def test_space_never_takes_a_slots_newest_or_one_in_use() -> None:
    s0 = [snap(0, t, size=1000) for t in (10.0, 30.0, 50.0)]
    s1 = [snap(1, t, size=1000) for t in (20.0, 40.0)]
    every = s0 + s1
    got = policy.select_for_space(every, need=10_000, free=0, floor=0)
    assert got == []  # the three not protected free 3,000 bytes only
    got = policy.select_for_space(every, need=1500, free=0, floor=0, in_use=(s0[0].file,))
    assert got == [s1[0], s0[1]]
    assert policy.freed_bytes(every, got) == 2000


def test_a_whole_file_counts_the_fixed_part_once_a_fit_exists() -> None:
    per_token, fixed = 3088, 7_870_000
    sizes = [(600, fixed + per_token * 600), (1400, fixed + per_token * 1400)]
    assert floor.whole_file(sizes, 500) == fixed + per_token * 500  # proportional would say ~8.1 MB, not 9.4
    assert floor.whole_file(sizes[:1], 300) == (fixed + per_token * 600) // 2  # no fit: the newest's bytes a token
    assert floor.whole_file([], 300) == 0
