"""What one turn of a hybrid model writes to disk, with the block store (``--store-dir``) and without it.

On a recurrent or hybrid model llama-server saves the slot twice per turn
(``save.rewind``): a scratch save that shows the sidecar the slot's token ids
(prompt and reply), then, once the slot is back at its prompt's boundary, the
snapshot. Without the block store both are whole files in the slot dir, on
its disk. With it the slot dir is a tmpfs: both saves land in RAM, and only
the snapshot's blocks the store lacks reach the store's disk. The bound the
tests hold it to comes from the slot's layout: a snapshot that extends the
previous one shares that one's KV in every whole 256-position range both
hold (``sidecar.blocks.layout``), at the model's K and V bytes per token
(``support.kvshape``); the rest (header, token ids, cell metadata, the KV of
the last, partial range and of the new tokens, the recurrent state) is what
differs. The sliding-window model of the bed (Gemma 3, ``--swa-full``),
which the sidecar saves once per turn, is held to the same bound: its
windowed layers save only the window's cells, so two saves share only the
whole ranges inside both windows (its restore from the store after a
kill -9 is ``test_store_dir``'s).
"""

from __future__ import annotations

import dataclasses
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.blocks import store as blockstore
from sidecar.core import protocols
from sidecar.snapshots import slotfile
from tests.support import kvshape, mounts, tinymodels
from tests.support.chatturns import WARM, Chat
from tests.support.llamabed import LlamaServer, MakeServer, make_prompt, slot_action
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifest_records

PROMPT_TOKENS = 900
KINDS = [*tinymodels.Arch, tinymodels.DENSE]


def write_bytes(pid: int) -> int:
    """Bytes the process sent to a block device so far (``/proc/PID/io``): a tmpfs's writes are not among them."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/io has no write_bytes line")


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root``, whoever wrote them (a temp file renamed meanwhile is skipped)."""
    total = 0
    for path in root.rglob("*"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


@dataclasses.dataclass(frozen=True)
class Tally:
    """What was written so far: the store's counters, llama-server's disk writes, the store dir's size."""

    blocks: float
    manifests: float
    deduplicated: float
    server_disk: int
    store_size: int

    @classmethod
    def read(cls, side: SidecarProcess, server: LlamaServer, store: Path) -> Tally:
        return cls(
            side.metric("llama_sidecar_store_written_bytes_total", kind="blocks"),
            side.metric("llama_sidecar_store_written_bytes_total", kind="manifests"),
            side.metric("llama_sidecar_store_deduplicated_bytes_total"),
            write_bytes(server.pid),
            tree_bytes(store),
        )

    def __sub__(self, other: Tally) -> Tally:
        return Tally(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


def newest(folder: Path) -> dict[str, Any]:
    """The manifest of the newest snapshot in ``folder`` (the slot dir, or the store's ``snapshots``)."""
    return max(manifest_records(folder), key=lambda r: int(r["generation"]))


def server_save(server: LlamaServer, slots: Path, name: str) -> bytes:
    """The slot as llama-server saves it now (a file of the test's, read and deleted at once)."""
    slot_action(server.url, 0, "save", name)
    data = (slots / name).read_bytes()
    (slots / name).unlink()
    return data


def one_turn(
    chat: Chat, side: SidecarProcess, server: LlamaServer, store: Path, n: int
) -> tuple[Tally, dict[str, Any], float]:
    """Send the chat's next turn and wait for its snapshot to be committed and counted.

    Returns what the turn wrote, the snapshot's manifest and the share of the previous prompt it reused.
    """
    before = Tally.read(side, server, store)
    reused, earlier = chat.turn(server.url)
    side.wait_saved(n)
    record = newest(store / "snapshots")

    def counted() -> Tally | None:
        # the counters move a moment after the files: wait until they cover what the store dir holds
        done = Tally.read(side, server, store) - before
        covered = done.store_size <= done.blocks + done.manifests
        return done if covered and done.blocks + done.deduplicated >= record["bytes"] else None

    done = side.wait_for(
        counted, what="the snapshot's ingest counted, and the store dir grown by no more than the counters say"
    )
    assert done is not None
    return done, record, reused / max(earlier, 1)


def rebuilt(store: Path, record: dict[str, Any], into: Path) -> bytes:
    blockstore.BlockStore(store, clock=protocols.SystemClock()).reassemble(str(record["recipe"]), into)
    return into.read_bytes()


def restored_exactly(
    server: LlamaServer, side: SidecarProcess, slots: Path, n: int, file: bytes, *, kill: bool = True
) -> None:
    """The slot holds ``file`` (the snapshot as the server saved it) after a kill -9 and the sidecar's restore.

    ``kill=False``: only that the store's copy is the slot as the server saves it (the sliding-window model's
    restore from the store after a kill -9 is ``test_store_dir``'s).
    """
    assert server_save(server, slots, "probe-before.bin") == file, "the store's copy differs from the slot it saved"
    if not kill:
        return
    server.restart()
    side.wait_restored(n)
    assert server_save(server, slots, "probe-after.bin") == file, "the restored slot differs from its snapshot"


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_writes_the_store_disk_only_what_differs_and_restores_exactly_after_kill9(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tiny_models: dict[tinymodels.Arch, Path],
    tmp_path: Path,
    kind: str,
    figure: Callable[[str], None],
) -> None:
    served = model if kind == tinymodels.DENSE else tiny_models[tinymodels.Arch(kind)]
    shape = kvshape.of(served)
    hybrid = kind != tinymodels.DENSE
    store = tmp_path / "store"
    mounts.assert_on_disk(tmp_path)
    with mounts.tmpfs(tmp_path / "slots", "256m") as slots:
        server = llama(slot_dir=slots, ctx_size=4096, **tinymodels.serving(kind, tiny_models))
        side = sidecar(server, slots, extra={"--store-dir": str(store)})
        chat = Chat(1, make_prompt(server.url, PROMPT_TOKENS, seed=21))

        # The first turn: the store holds nothing yet, so its disk gets one slot file, however many saves it took.
        first, record, _ = one_turn(chat, side, server, store, 1)
        size = int(record["bytes"])
        assert first.blocks + first.deduplicated == size
        assert first.blocks <= size
        if hybrid:  # two saves: the scratch save held the reply, the snapshot ends before it
            (rewind,) = side.log_events("slot_rewound_to_boundary")
            assert rewind["held_tokens"] > rewind["boundary_tokens"] == record["tokens"], rewind
        assert first.server_disk < size, "llama-server's saves went to the tmpfs, none to a disk"
        one = rebuilt(store, record, tmp_path / "one.bin")
        restored_exactly(server, side, slots, 1, one, kill=hybrid)

        # The next turn extends the snapshot: its disk gets only what differs from the one before.
        second, record2, warm = one_turn(chat, side, server, store, 2)
        assert warm >= WARM, "the next turn (after the kill -9 on a hybrid) reuses the snapshot"
        size2 = int(record2["bytes"])
        two = rebuilt(store, record2, tmp_path / "two.bin")
        held, held2 = (slotfile.unpack_ids(slotfile.read_tokens(tmp_path / f"{n}.bin").data) for n in ("one", "two"))
        assert held2[: len(held)] == held, "the second snapshot extends the first"
        shared = shape.shared(len(held), len(held2))
        assert shared > 0
        assert second.blocks + second.deduplicated == size2
        assert second.deduplicated >= shared, (second.deduplicated, shared)
        assert second.blocks <= size2 - shared, (second.blocks, size2, shared)
        if hybrid:
            assert len(side.log_events("slot_rewound_to_boundary")) == 2
        assert second.server_disk < size2
        restored_exactly(server, side, slots, 2, two, kill=hybrid)
        if hybrid:
            reused, earlier = chat.turn(server.url)
            assert reused >= WARM * earlier, (reused, earlier)

    figure(
        f"{kind}, --store-dir on disk, slot dir on a tmpfs: first turn's snapshot {size:,} B, "
        f"{first.blocks:,.0f} B of blocks + {first.manifests:,.0f} B of manifests to the store disk; "
        f"next turn's snapshot {size2:,} B ({len(held2)} tokens): {second.blocks:,.0f} B of blocks "
        f"({second.blocks / size2:.0%}), {second.deduplicated:,.0f} B found in the store (the KV of the whole "
        f"256-position ranges both saves hold of the {len(held)} tokens before: {shared:,} B); llama-server's disk "
        f"writes over the two turns: {first.server_disk + second.server_disk:,} B"
    )


def test_without_the_store_a_hybrid_turn_writes_the_slot_twice_into_the_slot_dir(
    llama: MakeServer,
    sidecar: MakeSidecar,
    tiny_models: dict[tinymodels.Arch, Path],
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    """Whole-file mode, the slot dir on a disk: the scratch save and the snapshot, each a whole slot file."""
    mounts.assert_on_disk(slot_dir)
    server = llama(slot_dir=slot_dir, ctx_size=4096, **tinymodels.serving(tinymodels.Arch.QWEN35, tiny_models))
    side = sidecar(server, slot_dir)
    chat = Chat(1, make_prompt(server.url, PROMPT_TOKENS, seed=21))
    written = []
    for turn in (1, 2):
        before = write_bytes(server.pid)
        chat.turn(server.url)
        side.wait_saved(turn)
        record = newest(slot_dir)
        written.append(write_bytes(server.pid) - before)
        rewinds = side.log_events("slot_rewound_to_boundary")
        assert len(rewinds) == turn
        assert rewinds[-1]["boundary_tokens"] == record["tokens"]
        size = int(record["bytes"])
        # the scratch save holds more tokens than the snapshot: two files of at least its size, not a third
        assert 2 * size <= written[-1] < 3 * size, (written[-1], size)
    figure(
        f"qwen35 without --store-dir, slot dir on disk: llama-server wrote {written[0]:,} and {written[1]:,} B "
        f"over two turns (snapshots of {size:,} B at the second: the scratch save and the snapshot)"
    )
