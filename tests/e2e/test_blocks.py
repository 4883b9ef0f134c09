"""The block store against slot files the real llama-server wrote: exact round trips and the dedup they give.

The figures (dedup of two conversations sharing a prefix, of successive
saves of one, reassembly speed beside the server's own restore of the same
file) are printed in the "measured" section; the tests assert the round
trips and that the dedup reaches what the shared tokens allow, never a speed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sidecar.blocks import layout, parts, store
from sidecar.core import protocols
from sidecar.snapshots import slotfile
from tests.support import tinymodels, widekv
from tests.support.llamabed import LlamaServer, MakeServer, complete, make_prompt, slot_action
from tests.support.report import SUMMARY


def common_prefix(a: Path, b: Path) -> tuple[int, int]:
    """(tokens the two files share at their start, tokens of ``b``)."""
    x = slotfile.unpack_ids(slotfile.read_tokens(a).data)
    y = slotfile.unpack_ids(slotfile.read_tokens(b).data)
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n, len(y)


def allowed(shared: int, total: int) -> float:
    """The share of a file's KV that whole blocks of its shared tokens can hold (the tail block is new)."""
    return (shared // layout.TOKENS) * layout.TOKENS / total


def same(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_two_conversations_sharing_a_prefix_and_successive_saves_dedup_on_an_8b_class_kv(
    llama: MakeServer, model: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    wide = widekv.model(tokenizer_from=model)
    lines: list[str] = []
    for flash in ("on", "off"):  # off: llama.cpp stores V transposed
        server = llama(
            slot_dir=slot_dir, n_slots=2, model=wide, ctx_size=4096, swa_full=False, extra_args=["-fa", flash]
        )
        lines += _pair_and_successive(server, slot_dir, tmp_path / f"store-fa-{flash}", flash)
        server.kill()
        for f in slot_dir.iterdir():
            f.unlink()
    pytestconfig.stash[SUMMARY].extend(lines)


def _pair_and_successive(server: LlamaServer, slot_dir: Path, root: Path, flash: str) -> list[str]:
    s = store.BlockStore(root, clock=protocols.SystemClock())
    prefix = make_prompt(server.url, 1500, seed=41)
    complete(server.url, prefix + " " + make_prompt(server.url, 250, seed=42), n_predict=8, id_slot=0)
    slot_action(server.url, 0, "save", "a1.bin")
    complete(server.url, prefix + " " + make_prompt(server.url, 250, seed=43), n_predict=8, id_slot=1)
    slot_action(server.url, 1, "save", "b1.bin")
    a2 = prefix + " " + make_prompt(server.url, 250, seed=42) + " " + make_prompt(server.url, 200, seed=44)
    complete(server.url, a2, n_predict=8, id_slot=0)
    slot_action(server.url, 0, "save", "a2.bin")

    first = s.ingest("a1", slot_dir / "a1.bin")
    pair = s.ingest("b1", slot_dir / "b1.bin")
    successive = s.ingest("a2", slot_dir / "a2.bin")

    assert first.layout is parts.Layout.KV
    shared_pair, n_b = common_prefix(slot_dir / "a1.bin", slot_dir / "b1.bin")
    shared_next, n_a2 = common_prefix(slot_dir / "a1.bin", slot_dir / "a2.bin")
    # the same tokens at the same positions give bit-identical KV on the CPU, whichever slot computed them
    assert pair.dedup_fraction >= 0.97 * allowed(shared_pair, n_b)
    assert successive.dedup_fraction >= 0.97 * allowed(shared_next, n_a2)

    staging = root.parent / f"staging-fa-{flash}"
    staging.mkdir()
    takes = []
    for _ in range(3):  # into a fresh name each time: replacing a 256 MB file costs its freeing too
        (staging / "a2.bin").unlink(missing_ok=True)
        started = time.perf_counter()
        s.reassemble("a2", staging / "a2.bin")
        takes.append(time.perf_counter() - started)
        assert same(staging / "a2.bin", slot_dir / "a2.bin")
    took = min(takes)
    for name in ("a1", "b1"):
        s.reassemble(name, staging / f"{name}.bin")
        assert same(staging / f"{name}.bin", slot_dir / f"{name}.bin")

    # the server restores the rebuilt file as it restores its own; each restore timed by the server
    (slot_dir / "rebuilt.bin").write_bytes((staging / "a2.bin").read_bytes())
    own = slot_action(server.url, 0, "restore", "a2.bin")
    rebuilt = slot_action(server.url, 1, "restore", "rebuilt.bin")
    assert rebuilt["n_restored"] == own["n_restored"] > 0
    usage = s.usage()
    size_mb = successive.file_bytes / 1e6
    restore_s = own["timings"]["restore_ms"] / 1000
    return [
        f"blocks (8B-class KV, flash attention {flash}): shared-prefix pair {pair.dedup_fraction:.1%} of "
        f"{pair.file_bytes / 1e6:.0f} MB found in the store ({shared_pair} of {n_b} tokens shared); "
        f"successive save {successive.dedup_fraction:.1%} of {size_mb:.0f} MB ({shared_next} of {n_a2} tokens "
        f"in the earlier save); store {usage.unique_bytes / 1e6:.0f} MB for {usage.represented_bytes / 1e6:.0f} MB "
        f"({usage.unique_bytes / usage.represented_bytes:.2f}x)",
        f"blocks (8B-class KV, flash attention {flash}): reassembly of {size_mb:.0f} MB in {took:.3f} s, best of 3 "
        f"({size_mb / took:.0f} MB/s; the first {takes[0]:.3f} s; page-cached blocks, a new file on the test's "
        f"filesystem); the server's restore of the same file "
        f"{restore_s:.3f} s; (reassembly + restore) / restore = {(took + restore_s) / restore_s:.2f}x",
    ]


@pytest.mark.parametrize("kind", [tinymodels.DENSE, *tinymodels.Arch])
def test_slot_files_of_sliding_window_and_hybrid_models_round_trip_exactly(
    llama: MakeServer,
    tiny_models: dict[tinymodels.Arch, Path],
    tmp_path: Path,
    kind: str,
    pytestconfig: pytest.Config,
) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    server = llama(slot_dir=slot_dir, ctx_size=4096, **tinymodels.serving(kind, tiny_models))
    prompt = make_prompt(server.url, 700, seed=51)
    complete(server.url, prompt, n_predict=8)
    saved = slot_action(server.url, 0, "save", "one.bin")
    complete(server.url, prompt + " " + make_prompt(server.url, 300, seed=52), n_predict=8)
    slot_action(server.url, 0, "save", "two.bin")
    s = store.BlockStore(tmp_path / "store", clock=protocols.SystemClock())

    one = s.ingest("one", slot_dir / "one.bin")
    two = s.ingest("two", slot_dir / "two.bin")
    for name in ("one", "two"):
        s.reassemble(name, tmp_path / f"{name}.out")
        assert same(tmp_path / f"{name}.out", slot_dir / f"{name}.bin")
    (slot_dir / "back.bin").write_bytes((tmp_path / "one.out").read_bytes())
    assert slot_action(server.url, 0, "restore", "back.bin")["n_restored"] == saved["n_saved"]

    # Gemma 3 writes two KV caches (global, then sliding-window); a hybrid its KV, then recurrent state
    assert one.layout is (parts.Layout.KV if kind == tinymodels.DENSE else parts.Layout.MIXED)
    pytestconfig.stash[SUMMARY].append(
        f"blocks ({kind}, {one.layout} layout): successive saves of {one.file_bytes / 1e6:.1f} and "
        f"{two.file_bytes / 1e6:.1f} MB, the second {two.dedup_fraction:.1%} found in the store"
    )
