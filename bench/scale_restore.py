"""A restore from the block store against the server's own restore of the same whole file, both from staging.

Part of the scale section (:mod:`bench.scale`), on its block-store way: once
the turns after the ``kill -9`` are answered and the sidecar is stopped, the
bench takes the largest snapshot the store holds and restores it into slot 0
of the same llama-server, ``reps`` times each way, alternating (each pair in
the other order than the one before):

* **rebuilt**: a restore of a snapshot whose file was not rebuilt ahead: the
  file rebuilt from its blocks into the slot dir (the staging tmpfs) under a
  fresh name and checked against its checksum, by the sidecar's own code
  (``Staging.stage``, as its restore path calls it), then the server's
  restore call of that name; the staged file is deleted once the clock has
  stopped, as the sidecar deletes it off the restore's path;
* **staged**: the server's restore call of the same whole file, already in
  the slot dir (the same filesystem, the same slot).

The goal: rebuilt over staged (medians) at most 1.2x. Where the time goes is
printed beside: the rebuild alone, and the server's call in each way (as the
bench timed it, and the server's own ``restore_ms``). The blocks are in the
page cache, as they are after a llama-server restart (not a host's).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from bench import rig
from bench.beds import llamabed
from sidecar.core import mounts, protocols
from sidecar.snapshots import manifest, store

GOAL = 1.2
"""A restore rebuilt from blocks over the server's restore of the same file staged whole."""
SLOT = 0
REBUILT, STAGED = "rebuilt from blocks + restore call", "restore call of the file staged whole"


@dataclasses.dataclass(frozen=True, slots=True)
class Restores:
    tokens: int
    bytes: int
    small_pages: bool
    """The slot dir is a tmpfs of 4 KiB pages (mounted without ``huge=``)."""
    rebuilt_s: list[float]
    """Rebuild into the slot dir + the server's restore call, as the bench timed them, per rep."""
    rebuild_s: list[float]
    """The rebuild alone (the first part of ``rebuilt_s``)."""
    rebuilt_server_s: list[float]
    """The server's own ``restore_ms`` of the rebuilt file, in seconds."""
    staged_s: list[float]
    """The server's restore call of the file staged whole, as the bench timed it."""
    staged_server_s: list[float]

    @property
    def ratio(self) -> float:
        return rig.median(self.rebuilt_s) / rig.median(self.staged_s)

    @property
    def pairs(self) -> list[float]:
        """Each rep's rebuilt over its staged."""
        return [a / b for a, b in zip(self.rebuilt_s, self.staged_s, strict=True)]

    @property
    def rebuilt_call_s(self) -> list[float]:
        """The server's restore call within ``rebuilt_s``."""
        return [a - b for a, b in zip(self.rebuilt_s, self.rebuild_s, strict=True)]


def run(url: str, slot_dir: Path, store_dir: Path, *, reps: int, say: rig.Say) -> Restores:
    """Time both ways on the server at ``url`` (its ``--slot-save-path`` ``slot_dir``), from ``store_dir``'s largest
    snapshot. Nothing else may use the store or the server's slot 0 meanwhile (the sidecar is stopped)."""
    snaps = store.SnapshotStore(slot_dir, clock=protocols.SystemClock(), store_dir=store_dir, read_only=True)
    snaps.loader.scan(clean=False)
    found = snaps.snapshots()
    if not found:
        raise rig.BenchError(f"the block store {store_dir} holds no snapshot to restore")
    record = max(found, key=lambda m: (m.bytes, m.generation))
    whole = snaps.staged.stage(record)
    rebuilt: list[tuple[float, float, float]] = []
    staged: list[tuple[float, float]] = []
    try:
        for rep in range(reps + 1):  # the first pair warms up, uncounted
            first = _rebuilt(url, snaps, record) if rep % 2 == 0 else None
            second = _restore(url, whole, record)
            if first is None:
                first = _rebuilt(url, snaps, record)
            if rep:
                rebuilt.append(first)
                staged.append(second)
    finally:
        snaps.staged.unstage(whole, record)
    found_restores = Restores(
        record.tokens,
        record.bytes,
        mounts.tmpfs_of_small_pages(slot_dir),
        [r[0] for r in rebuilt],
        [r[1] for r in rebuilt],
        [r[2] for r in rebuilt],
        [s[0] for s in staged],
        [s[1] for s in staged],
    )
    say(f"  restore from the block store: {found_restores.ratio:.2f}x the restore of the file staged whole")
    return found_restores


def _rebuilt(url: str, snaps: store.SnapshotStore, record: manifest.Manifest) -> tuple[float, float, float]:
    """(rebuild + call, rebuild, the server's restore_ms) in seconds."""
    started = time.perf_counter()
    name = snaps.staged.stage(record)
    try:
        built = time.perf_counter() - started
        call, server = _restore(url, name, record)
    finally:
        snaps.staged.unstage(name, record)
    return built + call, built, server


def _restore(url: str, name: str, record: manifest.Manifest) -> tuple[float, float]:
    """(the restore call as timed here, the server's restore_ms) in seconds."""
    started = time.perf_counter()
    done = llamabed.slot_action(url, SLOT, "restore", name)
    took = time.perf_counter() - started
    if int(done["n_restored"]) != record.tokens:
        raise rig.BenchError(f"restoring {record.file} put back {done['n_restored']} of its {record.tokens} tokens")
    return took, float(done["timings"]["restore_ms"]) / 1000


def table(r: Restores) -> str:
    rows = [
        (REBUILT, rig.median(r.rebuilt_s), rig.median(r.rebuild_s), rig.median(r.rebuilt_call_s),
         rig.median(r.rebuilt_server_s)),
        (STAGED, rig.median(r.staged_s), 0.0, rig.median(r.staged_s), rig.median(r.staged_server_s)),
    ]  # fmt: skip
    head = (
        f"the largest snapshot ({r.tokens:,} tokens, {r.bytes / 1e6:.0f} MB) restored into slot {SLOT} from the slot "
        f"dir ({'a tmpfs of 4 KiB pages' if r.small_pages else 'not a tmpfs of small pages'}), {len(r.rebuilt_s)} "
        "of each, alternating, medians\n\n"
    )
    return head + rig.table(["restore", "total s", "rebuild s", "call s", "server restore_ms s"], rows)


def judged(r: Restores) -> tuple[bool, str, str]:
    """(met, the goal, the figure) of the restore goal."""
    rebuild, call = rig.median(r.rebuild_s), rig.median(r.rebuilt_call_s)
    return (
        r.ratio <= GOAL,
        f"a restore from the block store (rebuild into staging + the server's restore) at most {GOAL}x the "
        "server's own restore of the same whole file from staging",
        f"{r.ratio:.2f}x ({rig.median(r.rebuilt_s) * 1000:.0f} against {rig.median(r.staged_s) * 1000:.0f} ms, "
        f"{r.bytes / 1e6:.0f} MB: the rebuild {rebuild * 1000:.0f} ms ({r.bytes / rebuild / 1e9:.2f} GB/s), "
        f"then the call {call * 1000:.0f} ms (restore_ms {rig.median(r.rebuilt_server_s) * 1000:.0f}) against "
        f"{rig.median(r.staged_s) * 1000:.0f} ms (restore_ms {rig.median(r.staged_server_s) * 1000:.0f}); per pair "
        + ", ".join(f"{p:.2f}" for p in r.pairs)
        + ")",
    )
