"""The block store on real files: exact round trips, dedup counts, refused blocks, collection."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

import pytest

from sidecar.blocks import blockdir, collect, locking, parts, recipe, store
from sidecar.core import errors, outcomes
from tests.support import clocks, slotfiles

TOKENS = 16


def make_store(tmp_path: Path) -> store.BlockStore:
    return store.BlockStore(tmp_path / "store", clock=clocks.reading(lambda: 1000.0), tokens=TOKENS)


def put(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def block_files(s: store.BlockStore) -> dict[str, Path]:
    return {d: p for d, p, _ in blockdir.BlockDir(s.root / "blocks").entries() if d}


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


SHAPES = [
    slotfiles.Shape(),
    slotfiles.Shape(v_trans=True, v_row=32, el=2),
    slotfiles.Shape(ext=True, streams=2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["flash", "transposed", "ext-streams"])
def test_a_slot_file_comes_back_byte_identical(tmp_path: Path, shape: slotfiles.Shape) -> None:
    s = make_store(tmp_path)
    data = slotfiles.slot_file(list(range(77)), shape, sections=2)
    got = s.ingest("conv", put(tmp_path, "in.bin", data))
    out = tmp_path / "staging" / "out.bin"
    out.parent.mkdir()

    made = s.reassemble("conv", out)

    assert out.read_bytes() == data
    assert made.bytes == len(data) == got.file_bytes
    assert got.layout is parts.Layout.KV
    assert leftovers(out.parent) == []


@pytest.mark.parametrize(
    "data",
    [b"", b"x", os.urandom(300_000), slotfiles.slot_file(list(range(30)), slotfiles.Shape(), tail=os.urandom(99_000))],
    ids=["empty", "one-byte", "random", "hybrid"],
)
def test_any_file_comes_back_byte_identical(tmp_path: Path, data: bytes) -> None:
    s = make_store(tmp_path)
    s.ingest("f", put(tmp_path, "in.bin", data))
    s.reassemble("f", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_the_second_copy_writes_no_block_and_the_counts_say_so(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    data = slotfiles.slot_file(list(range(64)), slotfiles.Shape())
    first = s.ingest("a", put(tmp_path, "a.bin", data))
    second = s.ingest("b", put(tmp_path, "b.bin", data))

    assert first.block_bytes_written > 0
    assert first.blocks_written == len(block_files(s))
    assert second.blocks_written == 0
    assert second.block_bytes_written == 0
    assert second.bytes_deduplicated == len(data)
    assert second.dedup_fraction == 1.0
    assert second.recipe_bytes_written == (s.root / "recipes" / "b.json").stat().st_size
    usage = s.usage()
    assert usage.recipes == 2
    assert usage.represented_bytes == 2 * len(data)
    assert usage.unique_bytes == first.block_bytes_written


def test_a_shared_prefix_is_stored_once(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    shape = slotfiles.Shape()
    common = list(range(2000, 2064))
    s.ingest("a", put(tmp_path, "a.bin", slotfiles.slot_file([*common, 1, 2], shape)))
    got = s.ingest(
        "b", put(tmp_path, "b.bin", slotfiles.slot_file([*common, 5, 6, 7], dataclasses.replace(shape, seq=1)))
    )

    keys = next(r for r in got.regions if r.region is parts.Region.KEYS)
    assert keys.written == shape.layers * 3 * shape.k_row  # only each layer's 3-cell tail is new
    assert keys.bytes - keys.written >= shape.layers * 64 * shape.k_row  # the 64 shared cells (and headers)


def test_a_block_already_held_is_never_written_again(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    data = slotfiles.slot_file(list(range(40)), slotfiles.Shape())
    s.ingest("a", put(tmp_path, "a.bin", data))
    before = {d: p.stat().st_ino for d, p in block_files(s).items()}
    s.ingest("b", put(tmp_path, "b.bin", data))
    assert {d: p.stat().st_ino for d, p in block_files(s).items()} == before


def test_blocks_are_named_by_their_sha256_under_a_fanout(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    s.ingest("a", put(tmp_path, "a.bin", slotfiles.slot_file(list(range(40)), slotfiles.Shape())))
    for digest, path in block_files(s).items():
        assert path.parent.name == digest[:2]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def ingest_two(tmp_path: Path) -> tuple[store.BlockStore, recipe.Recipe, bytes]:
    s = make_store(tmp_path)
    a = slotfiles.slot_file(list(range(50)), slotfiles.Shape(v_trans=True, v_row=32))
    b = slotfiles.slot_file(list(range(900, 950)), slotfiles.Shape())
    s.ingest("a", put(tmp_path, "a.bin", a))
    s.ingest("b", put(tmp_path, "b.bin", b))
    made = recipe.Recipe.from_json((s.root / "recipes" / "a.json").read_text())
    return s, made, b


def victim(s: store.BlockStore, made: recipe.Recipe) -> tuple[str, Path]:
    """A block of ``made`` that no other recipe names, and its file."""
    others = recipe.Recipe.from_json((s.root / "recipes" / "b.json").read_text()).digests()
    digest = next(b.digest for b in made.blocks() if b.digest not in others and b.size > 100)
    return digest, block_files(s)[digest]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.unlink(), outcomes.BlockProblem.MISSING),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), outcomes.BlockProblem.TRUNCATED),
        (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), outcomes.BlockProblem.CORRUPT),
        (lambda p: (p.unlink(), p.symlink_to("/dev/zero")), outcomes.BlockProblem.NOT_REGULAR),
    ],
    ids=["missing", "truncated", "corrupt", "symlink"],
)
def test_a_bad_block_refuses_its_recipe_by_name_and_leaves_no_output(tmp_path: Path, damage, reason) -> None:  # type: ignore[no-untyped-def]
    s, made, b = ingest_two(tmp_path)
    digest, path = victim(s, made)
    damage(path)
    staging = tmp_path / "staging"
    staging.mkdir()

    with pytest.raises(errors.BlockStoreError) as caught:
        s.reassemble("a", staging / "a.bin")

    assert caught.value.reason == reason
    assert caught.value.block == digest
    assert digest in str(caught.value)
    assert isinstance(caught.value, errors.SnapshotError)
    assert list(staging.iterdir()) == []  # no partial file, no temp file
    s.reassemble("b", staging / "b.bin")  # every other recipe still comes back
    assert (staging / "b.bin").read_bytes() == b


def test_a_failed_reassembly_leaves_an_existing_destination_untouched(tmp_path: Path) -> None:
    s, made, _ = ingest_two(tmp_path)
    victim(s, made)[1].unlink()
    dest = put(tmp_path, "dest.bin", b"what was there")
    with pytest.raises(errors.BlockStoreError):
        s.reassemble("a", dest)
    assert dest.read_bytes() == b"what was there"


def test_a_damaged_or_absent_recipe_is_refused(tmp_path: Path) -> None:
    s, _, _ = ingest_two(tmp_path)
    with pytest.raises(errors.BlockStoreError) as absent:
        s.reassemble("nope", tmp_path / "x.bin")
    assert absent.value.reason == outcomes.BlockProblem.MISSING
    path = s.root / "recipes" / "a.json"
    path.write_text(path.read_text().replace('"size":', '"size":1'))
    with pytest.raises(errors.BlockStoreError) as damaged:
        s.reassemble("a", tmp_path / "x.bin")
    assert damaged.value.reason == outcomes.BlockProblem.RECIPE
    assert not (tmp_path / "x.bin").exists()


def test_a_bad_name_is_refused_before_any_block_is_written(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    for name in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="not a recipe name"):
            s.ingest(name, put(tmp_path, "in.bin", b"data"))
    assert block_files(s) == {}


def test_collection_deletes_only_what_no_committed_recipe_names(tmp_path: Path) -> None:
    s, made, b = ingest_two(tmp_path)
    kept_b = recipe.Recipe.from_json((s.root / "recipes" / "b.json").read_text()).digests()
    assert s.collect().blocks_deleted == 0

    assert s.drop("a")
    done = s.collect()

    assert done.outcome is collect.Outcome.DONE
    assert done.blocks_deleted == len(made.digests() - kept_b) > 0
    assert set(block_files(s)) == kept_b
    s.reassemble("b", tmp_path / "b.out")
    assert (tmp_path / "b.out").read_bytes() == b


def test_collection_does_not_wait_for_an_ingest_in_progress_unless_told(tmp_path: Path) -> None:
    s, _, _ = ingest_two(tmp_path)
    s.drop("a")
    with locking.held(s.root, exclusive=False):  # an ingest or a reassembly holds the store
        busy = s.collect(wait=False)
    assert busy.outcome is collect.Outcome.BUSY
    assert busy.blocks_deleted == 0
    assert s.collect(wait=False).blocks_deleted > 0


def test_a_damaged_recipe_stops_collection_from_deleting_blocks(tmp_path: Path) -> None:
    s, _, _ = ingest_two(tmp_path)
    before = set(block_files(s))
    (s.root / "recipes" / "a.json").write_text("{not json")
    s.drop("b")
    done = s.collect()
    assert done.outcome is collect.Outcome.DAMAGED
    assert done.unreadable == ("a",)
    assert set(block_files(s)) == before


def test_a_crash_mid_ingest_leaves_no_recipe_and_collection_cleans_up(tmp_path: Path) -> None:
    """As a ``kill -9`` leaves it: some blocks of the new file written, one half-written, no recipe."""
    s, _, b = ingest_two(tmp_path)
    committed = {name: (s.root / "recipes" / f"{name}.json").read_text() for name in s.names()}
    blocks = blockdir.BlockDir(s.root / "blocks")
    for i in range(5):
        blocks.put(f"{i:02x}" * 32, os.urandom(100))  # whole blocks of an ingest that never committed
    half = s.root / "blocks" / "ab" / ".tmp-abababababababab-0001"
    half.parent.mkdir(exist_ok=True)
    half.write_bytes(b"half a block")
    (s.root / "recipes" / ".tmp-0123456789abcdef.json").write_text('{"format": 1, "na')

    done = s.collect()

    assert done.outcome is collect.Outcome.DONE
    assert done.blocks_deleted == 5
    assert done.temps_removed == 2
    assert not half.exists()
    assert leftovers(s.root / "recipes") == []
    assert s.names() == sorted(committed)
    for name in committed:
        s.reassemble(name, tmp_path / f"{name}.out")
    assert (tmp_path / "b.out").read_bytes() == b


def test_a_full_disk_mid_ingest_raises_the_disks_error_commits_nothing_and_collection_frees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on the third new block: the caller gets that OSError (before: a BufferError from closing the
    mapping a slice still pinned), no recipe names the file, and a collection deletes its two blocks."""
    s, _, _ = ingest_two(tmp_path)
    before = set(block_files(s))
    real_put = blockdir.BlockDir.put
    calls = []

    def put_until_full(self: blockdir.BlockDir, digest: str, data: memoryview | bytes | bytearray) -> bool:
        calls.append(digest)
        if len(calls) > 2 and not self.holds(digest, len(data)):
            raise OSError(28, "No space left on device")
        return real_put(self, digest, data)

    monkeypatch.setattr(blockdir.BlockDir, "put", put_until_full)
    other = put(tmp_path, "other.bin", slotfiles.slot_file(list(range(500, 600)), slotfiles.Shape()))
    with pytest.raises(OSError, match="No space left") as raised:
        s.ingest("other", other)
    assert raised.value.errno == 28
    assert "other" not in s.names()
    monkeypatch.undo()
    assert s.collect().outcome is collect.Outcome.DONE
    assert set(block_files(s)) == before
    for name in s.names():  # the committed files still rebuild
        s.reassemble(name, tmp_path / f"{name}.again")


def _listing(s: store.BlockStore) -> tuple[int, int]:
    found = [size for d, _, size in blockdir.BlockDir(s.root / "blocks").entries() if d]
    return len(found), sum(found)


def _stamps(s: store.BlockStore) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (s.root / "blocks").iterdir()}


def test_the_usage_counts_each_folder_again_only_once_it_changed_and_always_agrees_with_a_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, _, _ = ingest_two(tmp_path)
    later = [0]
    tallies = blockdir.Tallies(now_ns=lambda: time.time_ns() + later[0])
    monkeypatch.setattr(s, "_tallies", tallies)
    listed: list[str] = []
    real = blockdir._listed

    def counted(folder: str) -> blockdir.Tally:
        listed.append(os.path.basename(folder))
        return real(folder)

    monkeypatch.setattr(blockdir, "_listed", counted)
    folders = sorted(p.name for p in (s.root / "blocks").iterdir())
    usage = s.usage()
    assert (usage.blocks, usage.unique_bytes) == _listing(s)
    assert sorted(listed) == folders
    listed.clear()
    s.usage()
    assert sorted(listed) == folders  # every folder changed within the last 2 s: its mtime may not tell yet
    later[0] = blockdir.RACY_NS + 1
    s.usage()
    listed.clear()
    usage = s.usage()
    assert listed == []  # nothing changed: no block file looked at
    assert (usage.blocks, usage.unique_bytes) == _listing(s)

    before = _stamps(s)
    assert s.drop("a")
    assert s.collect().blocks_deleted > 0  # a's own blocks
    assert s.ingest("c", put(tmp_path, "c.bin", os.urandom(3000))).blocks_written > 0
    changed = {name for name, stamp in _stamps(s).items() if before.get(name) != stamp}
    usage = s.usage()
    assert (usage.blocks, usage.unique_bytes) == _listing(s)
    assert changed
    assert sorted(listed) == sorted(changed)  # only the folders that changed
