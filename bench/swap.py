"""Swap speed: one conversation swapped into a slot from a whole file against from the block store.

A library swap (a conversation coming back to a slot) restores a snapshot
into a slot. From a whole file that is the snapshot's check (size and
checksum, made once per file and remembered while it is unchanged) and the
server's restore call; from the block store (``--store-dir``) it is the
recipe's check, the rebuild of the exact file into the slot dir (block
reads, the whole-file checksum, the writes), the restore call, and the
staged file given back off the swap's path. Both ways run here side by
side on one llama-server (``-np 1``) holding a conversation of about 2,000
tokens (1,000 with ``--quick``) of the 8B-class-KV model
(``tests.support.widekv``, 128 KiB per token), through the sidecar's own
code (``SnapshotStore`` with and without a block store, in this process),
alternating, each swap after the slot was erased.

Both ways read the file the server restores from the same staging
filesystem (``--staging``, default ``/dev/shm``): from a tmpfs of small
pages llama-server reads about 2.5x slower than from a disk's page cache or
a tmpfs mounted with ``huge=within_size``, and allocating its pages is most
of a rebuild's cost; the header says which it was. The block store itself
is on the disk of the bench's scratch dir (its blocks in the page cache).

Per swap: the check, the rebuild (block store only), the restore call (and
the server's ``restore_ms``), and the staged file's removal or its keeping
as the spare (off the path). On a tmpfs of small pages each rebuild writes
over the pages of the last one (``sidecar.snapshots.staging``), as the
sidecar does; the header says which.
Then the rebuild's parts, each timed alone over the same blocks: reading
them, hashing each with sha256 (their names: not done by a rebuild, whose
whole-file checksum proves every byte), the whole-file xxh3-128, and
writing the file into a new file of the staging filesystem; a rebuild makes
no fsync (the file is a transient copy: a crash loses nothing).

Goal: a swap from the block store at most 1.2x the swap from a whole file
(medians; the whole file's check remembered, as on every swap but its
first). MET or MISSED, exit status 1 on a miss.

Run alone with ``python -m bench.swap [--quick] [--staging DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from bench import REPO_ROOT, rig, swap_proxy
from bench.beds import llamabed, widekv
from sidecar.blocks import blockdir, recipedir
from sidecar.core import mounts, protocols
from sidecar.snapshots import manifest, store

GOAL = 1.2
"""Swap from the block store over the swap from a whole file (medians)."""
STAGING = Path("/dev/shm")
WHOLE, BLOCKS, FRESH = "whole file", "block store", "block store, a new file each"
"""``FRESH``: beside ``BLOCKS`` where the sidecar keeps a spare, each rebuild into a new file as before it did."""


@dataclasses.dataclass(frozen=True, slots=True)
class Swap:
    way: str
    check_s: float
    rebuild_s: float
    """0 for a whole file."""
    restore_s: float
    """The restore call as the sidecar waits for it."""
    server_ms: float
    give_back_s: float
    """Removing the staged rebuild (off the swap's path, not counted in ``seconds``)."""

    @property
    def seconds(self) -> float:
        """What the swap waits for: check, rebuild, restore call."""
        return self.check_s + self.rebuild_s + self.restore_s


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """The rebuild's parts, each timed alone over the same blocks."""

    read_s: float
    sha256_s: float
    xxh3_s: float
    write_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    tokens: int
    bytes: int
    blocks: int
    staging: str
    swaps: list[Swap]
    parts: list[Parts]
    first_check_s: float
    """The whole file's first check (hashed): the first swap of a file since start-up pays it."""
    spare: bool
    """Whether each rebuild wrote over the pages of the last one given back (a tmpfs of small pages)."""
    quick: bool
    proxy: list[swap_proxy.Way] = dataclasses.field(default_factory=list)
    """Through the proxy, each swap saving the slot first: whole files, then the block store."""

    @property
    def proxy_ratio(self) -> float:
        whole, blocks = self.proxy
        return rig.median(blocks.seconds) / rig.median(whole.seconds)

    @property
    def proxy_rounds(self) -> list[float]:
        whole, blocks = self.proxy
        return [b / w for w, b in zip(whole.seconds, blocks.seconds, strict=False)]

    def of(self, way: str) -> list[Swap]:
        return [s for s in self.swaps if s.way == way]

    @property
    def ratio(self) -> float:
        return rig.median([s.seconds for s in self.of(BLOCKS)]) / rig.median([s.seconds for s in self.of(WHOLE)])

    @property
    def rounds(self) -> list[float]:
        """Each round's ratio (a block-store swap over the whole-file swap beside it)."""
        return [b.seconds / w.seconds for w, b in zip(self.of(WHOLE), self.of(BLOCKS), strict=False)]


def _timed(work: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    out = work()
    return time.perf_counter() - started, out


def _commit(snapshots: store.SnapshotStore, url: str, fingerprint: manifest.Fingerprint) -> manifest.Manifest:
    temp = snapshots.writer.temp_name(0)
    saved = llamabed.slot_action(url, 0, "save", temp)
    return snapshots.writer.commit(
        temp, slot=0, tokens=saved["n_saved"], written=saved["n_written"], task=None, fingerprint=fingerprint
    )


def _restore(url: str, name: str) -> tuple[float, float]:
    llamabed.slot_action(url, 0, "erase")
    seconds, answer = _timed(lambda: llamabed.slot_action(url, 0, "restore", name))
    assert isinstance(answer, dict)
    return seconds, float(answer["timings"]["restore_ms"])


def _swap_whole(snapshots: store.SnapshotStore, record: manifest.Manifest, url: str) -> Swap:
    # The check of a file unchanged since it passed is remembered (filechecks.FileChecks): only its stamp is read.
    check_s, _ = _timed(lambda: os.lstat(snapshots.dir / record.file))
    restore_s, server_ms = _restore(url, record.file)
    return Swap(WHOLE, check_s, 0.0, restore_s, server_ms, 0.0)


def _swap_blocks(snapshots: store.SnapshotStore, record: manifest.Manifest, url: str, *, spare: bool) -> Swap:
    keeps, snapshots.staged.keeps_spare = snapshots.staged.keeps_spare, spare
    try:
        check_s, _ = _timed(lambda: snapshots.curator.check(record))
        rebuild_s, name = _timed(lambda: snapshots.staged.stage(record))
        assert isinstance(name, str)
        restore_s, server_ms = _restore(url, name)
        give_back_s, _ = _timed(lambda: snapshots.staged.unstage(name, record))
    finally:
        snapshots.staged.keeps_spare = keeps
    return Swap(BLOCKS if spare == keeps else FRESH, check_s, rebuild_s, restore_s, server_ms, give_back_s)


def _parts(store_dir: Path, recipe_name: str, staging: Path) -> Parts:
    made = recipedir.RecipeDir(store_dir / "recipes").read(recipe_name)
    blocks = blockdir.BlockDir(store_dir / "blocks")
    buf = mmap.mmap(-1, max(b.size for b in made.blocks()))
    whole = bytearray(made.size)
    try:
        with memoryview(buf) as view, memoryview(whole) as into:

            def read() -> None:
                for block in made.blocks():
                    fd = os.open(blocks.of(block.digest), os.O_RDONLY)
                    try:
                        os.readv(fd, [view[: block.size]])
                    finally:
                        os.close(fd)

            def sha256() -> None:
                at = 0
                for block in made.blocks():
                    hashlib.sha256(into[at : at + block.size]).digest()
                    at += block.size

            def write() -> None:
                path = staging / ".bench-swap-write.bin"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    done = 0
                    while done < len(into):
                        done += os.write(fd, into[done : done + (1 << 20)])
                finally:
                    os.close(fd)
                    path.unlink()

            read_s, _ = _timed(read)
            at = 0
            for block in made.blocks():  # the file's bytes in order, for the hashes and the write
                with open(blocks.of(block.digest), "rb") as fh:
                    into[at : at + block.size] = fh.read()
                at += block.size
            sha256_s, _ = _timed(sha256)
            xxh3_s, _ = _timed(lambda: xxhash.xxh3_128(into).digest())
            write_s, _ = _timed(write)
    finally:
        buf.close()
    return Parts(read_s, sha256_s, xxh3_s, write_s)


def _staging_said(staging: Path) -> str:
    kind = "a tmpfs of small pages (no huge=)" if mounts.tmpfs_of_small_pages(staging) else "not a tmpfs of small pages"
    return f"{staging} ({kind})"


def run(bed: rig.Rig, *, tokens: int, reps: int, staging_root: Path, quick: bool, say: rig.Say) -> Result:
    model = widekv.model(tokenizer_from=bed.model)
    staging = staging_root / f"llama-kv-bench-swap-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    store_dir = bed.slot_dir("swap-store")
    try:
        server = bed.server(slot_dir=staging, n_slots=1, ctx_size=tokens + 1024, model=model, swa_full=False)
        say(f"swap: prefilling {tokens:,} tokens of 8B-class KV")
        prompt = llamabed.make_prompt(server.url, tokens, seed=4242)
        llamabed.complete(server.url, prompt, n_predict=1, id_slot=0)
        fingerprint = manifest.Fingerprint("bench", str(model), None, None, tokens + 1024, 1)
        clock = protocols.SystemClock()
        whole = store.SnapshotStore(staging, clock=clock)
        blocks = store.SnapshotStore(staging, clock=clock, store_dir=store_dir)
        whole_record = _commit(whole, server.url, fingerprint)
        blocks_record = _commit(blocks, server.url, fingerprint)
        assert blocks.blocks is not None
        assert blocks_record.recipe is not None
        first_check_s, _ = _timed(lambda: whole.curator.check(whole_record))
        count = len(blocks.blocks.recipe(blocks_record.recipe).blocks())
        spare = blocks.staged.keeps_spare
        ways: dict[str, Callable[[], Swap]] = {
            WHOLE: lambda: _swap_whole(whole, whole_record, server.url),
            BLOCKS: lambda: _swap_blocks(blocks, blocks_record, server.url, spare=spare),
        }
        if spare:
            ways[FRESH] = lambda: _swap_blocks(blocks, blocks_record, server.url, spare=False)
        for way in ways.values():  # once unmeasured each: the first of each touches fresh memory
            way()
        swaps: list[Swap] = []
        parts: list[Parts] = []
        for rep in range(reps):
            say(f"swap: round {rep + 1} of {reps}")
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            pair = {way: ways[way]() for way in order}
            swaps += [pair[way] for way in ways]
            parts.append(_parts(store_dir, blocks_record.recipe, staging))
        return Result(
            tokens=whole_record.tokens,
            bytes=whole_record.bytes,
            blocks=count,
            staging=_staging_said(staging),
            swaps=swaps,
            parts=parts,
            first_check_s=first_check_s,
            spare=spare,
            quick=quick,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def report(r: Result) -> str:
    def ms(values: list[float]) -> str:
        return f"{rig.median(values) * 1000:.1f}"

    rows = []
    for way in (WHOLE, BLOCKS, FRESH):
        got = r.of(way)
        if not got:
            continue
        rows.append(
            [
                way,
                ms([s.seconds for s in got]),
                ms([s.check_s for s in got]),
                ms([s.rebuild_s for s in got]),
                ms([s.restore_s for s in got]),
                f"{rig.median([s.server_ms for s in got]):.1f}",
                ms([s.give_back_s for s in got]),
            ]
        )
    swaps = rig.table(
        ["way", "swap ms", "check ms", "rebuild ms", "restore call ms", "server restore_ms", "give back ms (off path)"],
        rows,
    )
    parts = rig.table(
        ["rebuild part (alone)", "ms", "GB/s"],
        [
            [name, ms(values), f"{r.bytes / rig.median(values) / 1e9:.2f}"]
            for name, values in (
                ("block reads (page cache)", [p.read_s for p in r.parts]),
                ("sha256 of every block (not made by a rebuild)", [p.sha256_s for p in r.parts]),
                ("whole-file xxh3-128", [p.xxh3_s for p in r.parts]),
                ("write into a new staging file", [p.write_s for p in r.parts]),
            )
        ]
        + [["fsync", "0", "none: a staged rebuild is not synced"]],
    )
    head = (
        f"{r.tokens:,} tokens, {r.bytes / 1e6:.0f} MB in {r.blocks} blocks; staging {r.staging}; "
        f"{len(r.of(WHOLE))} swaps each way, alternating, medians; the whole file's first check "
        f"(hashed) {r.first_check_s * 1000:.1f} ms, remembered after; each rebuild "
        f"{'writes over the pages of the last one given back' if r.spare else 'writes a new file'}\n\n"
    )
    rounds = ", ".join(f"{v:.2f}" for v in r.rounds)
    tail = f"\n\nblock store / whole file: {r.ratio:.2f}x (per round {rounds})"
    if r.of(FRESH):
        fresh = rig.median([s.seconds for s in r.of(FRESH)]) / rig.median([s.seconds for s in r.of(WHOLE)])
        tail += f"; a new file each rebuild (as before the spare): {fresh:.2f}x"
    if r.proxy:
        tail += "\n\nthrough the proxy, each swap saving the slot's own content first (see bench.swap_proxy):\n\n"
        tail += rig.table(
            ["way", "swaps", "p50 ms", "each ms", "cache_n of the turns"],
            [
                [w.name, len(w.seconds), ms(w.seconds), "/".join(f"{v * 1000:.0f}" for v in w.seconds), str(w.cached)]
                for w in r.proxy
            ],
        )
    return head + swaps + "\n\n" + parts + tail


def verdicts(r: Result) -> list[str]:
    met = rig.decide(r.ratio, GOAL, rounds=r.rounds, quick=r.quick)
    out = []
    if r.proxy:
        whole, blocks = r.proxy
        fair = min(whole.cached + blocks.cached, default=0) > 0
        saved = rig.decide(r.proxy_ratio, GOAL, rounds=r.proxy_rounds, quick=r.quick) if fair else False
        out.append(
            f"{rig.word(saved)}: swap through the proxy, saving the slot first: from the block store <= {GOAL:.1f}x "
            f"from whole files: {r.proxy_ratio:.2f}x (block store {rig.median(blocks.seconds) * 1000:.0f} ms, "
            f"whole files {rig.median(whole.seconds) * 1000:.0f} ms; every turn reused its conversation: {fair})"
        )
    return [
        *out,
        f"{rig.word(met)}: swap: from the block store <= {GOAL:.1f}x from a whole file: {r.ratio:.2f}x "
        f"(block store {rig.median([s.seconds for s in r.of(BLOCKS)]) * 1000:.1f} ms, whole file "
        f"{rig.median([s.seconds for s in r.of(WHOLE)]) * 1000:.1f} ms; {r.bytes / 1e6:.0f} MB, staging {r.staging})",
    ]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, staging: Path = STAGING) -> tuple[Result, str]:
    tokens = 1000 if quick else 2000
    result = run(bed, tokens=tokens, reps=4 if quick else 8, staging_root=staging, quick=quick, say=say)
    proxy = swap_proxy.run(bed, tokens=tokens, turns=5 if quick else 9, staging_root=staging, say=say)
    result = dataclasses.replace(result, proxy=proxy)
    return result, report(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 tokens and 4 rounds (2,000 and 8 without)")
    parser.add_argument("--staging", type=Path, default=STAGING, help="where the slot dir goes (default /dev/shm)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-swap-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        result, body = measure(
            bed, quick=ns.quick, say=lambda t: print(t, file=sys.stderr, flush=True), staging=ns.staging
        )
        print(f"## Swap speed\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    lines = verdicts(result)
    print("\n" + "\n".join(lines))
    return 1 if any(line.startswith("MISSED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
