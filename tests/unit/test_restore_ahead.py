"""Rebuilding ahead (sidecar.restore.ahead): how many files fit, and the restorer taking them, never a stale one."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import hashing, metrics
from sidecar.restore import ahead, plan, restorer
from sidecar.slots import actions
from sidecar.snapshots import manifest, store
from tests.support import clocks
from tests.unit import memllama

FP = manifest.Fingerprint.of(memllama.IDENTITY, n_ctx=memllama.N_CTX)
MB = 1 << 20


def test_every_file_fits_when_the_largest_still_fits_beyond_them() -> None:
    assert ahead.chosen([100, 300], ahead.Room(staging=700, memory=None)) == 2
    assert ahead.chosen([100, 300], ahead.Room(staging=699, memory=None)) == 1
    assert ahead.chosen([100, 300], ahead.Room(staging=10_000, memory=699)) == 1  # RAM is the tighter bound
    assert ahead.chosen([300, 100], ahead.Room(staging=599, memory=None)) == 0  # in restore order: no skipping ahead
    assert ahead.chosen([], ahead.Room(staging=0, memory=0)) == 0


@dataclasses.dataclass
class Bed:
    server: memllama.MemLlama
    snapshots: store.SnapshotStore
    registry: CollectorRegistry
    restorer: restorer.Restorer
    restored: dict[int, bytes] = dataclasses.field(default_factory=dict)
    """What each restore call found under the name it was given."""

    def saved(self, slot: int, tokens: int, *, task: int = 1) -> manifest.Manifest:
        temp = self.snapshots.writer.temp_name(slot)
        data = bytes([slot]) * memllama.HEADER + bytes([task % 256]) * (tokens * memllama.BYTES_PER_TOKEN)
        (self.snapshots.staging / temp).write_bytes(data)  # what llama-server's save does
        return self.snapshots.writer.commit(
            temp, slot=slot, tokens=tokens, written=len(data), task=task, fingerprint=FP
        )

    def staged(self) -> list[str]:
        return sorted(p.name for p in self.snapshots.staging.iterdir())

    def value(self, outcome: str) -> float:
        return self.registry.get_sample_value("llama_sidecar_restore_ahead_total", {"outcome": outcome}) or 0.0

    def calls(self) -> list[str]:
        return [str(args[1]) for name, args in self.server.calls if name == "restore" and isinstance(args, tuple)]

    async def round(self) -> list[tuple[int, str]]:
        await self.restorer.restore_all(memllama.IDENTITY, healthy_at=None, counters=None)
        return [(r.slot, r.result.value) for r in self.restorer.verifier.last]

    async def settled(self) -> None:
        """Wait until the staged files given back after the restores are deleted."""
        for _ in range(500):
            if not self.staged():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"staged files left: {self.staged()}")


@pytest.fixture
def bed(tmp_path: Path) -> Bed:
    slot_dir, store_dir = tmp_path / "slots", tmp_path / "store"
    slot_dir.mkdir()
    server = memllama.MemLlama(slot_dir)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(slot_dir, clock=clocks.reading(lambda: float(next(stamps))), store_dir=store_dir)
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    stats.init_slots(range(2))
    worker = restorer.Restorer(
        slot_actions=actions.SlotActions(client=server, snapshots=snapshots),
        snapshots=snapshots,
        stats=stats,
        clock=clocks.FakeClock(),
        identity=lambda: memllama.IDENTITY,
    )
    made = Bed(server, snapshots, registry, worker)

    async def keep(slot: int, filename: str) -> None:
        made.restored[slot] = (slot_dir / filename).read_bytes()

    server.hooks["restore"] = keep
    return made


async def test_the_round_restores_the_files_rebuilt_while_the_server_loaded(bed: Bed) -> None:
    first, second = bed.saved(0, 500), bed.saved(1, 300, task=2)
    await bed.restorer.checks.precheck(rebuild=True)  # while the server loads
    built = bed.staged()
    assert len(built) == 2
    assert bed.restorer.ahead
    assert await bed.round() == [(0, "ok"), (1, "ok")]
    assert sorted(bed.calls()) == built  # the very files rebuilt ahead, none rebuilt in the round
    assert "verify" not in bed.server.names()
    assert bed.value("used") == 2
    assert bed.value("unused") == 0
    assert bed.restored[0] == bytes([0]) * memllama.HEADER + bytes([1]) * (500 * memllama.BYTES_PER_TOKEN)
    assert len(bed.restored[1]) == second.bytes
    assert len(bed.restored[0]) == first.bytes
    await bed.settled()
    assert bed.snapshots.disk.usage().staged_bytes == 0


async def test_a_snapshot_committed_after_the_rebuild_wins_and_the_stale_file_is_deleted(bed: Bed) -> None:
    bed.saved(0, 500)
    await bed.restorer.checks.precheck(rebuild=True)
    stale = bed.staged()
    newer = bed.saved(0, 700, task=5)  # a save committed after the rebuild, before the round
    at_restore: list[list[str]] = []
    keep = bed.server.hooks["restore"]

    async def seen(slot: int, filename: str) -> None:
        at_restore.append(bed.staged())
        await keep(slot, filename)

    bed.server.hooks["restore"] = seen
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]
    assert bed.calls() != stale
    assert at_restore == [bed.calls()]  # the stale file was given back before the newer one was rebuilt
    assert bed.restored[0] == bytes([0]) * memllama.HEADER + bytes([5]) * (700 * memllama.BYTES_PER_TOKEN)
    assert len(bed.restored[0]) == newer.bytes
    assert bed.value("used") == 0
    assert bed.value("unused") == 1
    await bed.settled()
    assert not bed.restorer.ahead


async def test_a_file_changed_after_its_rebuild_is_not_handed_to_the_server(bed: Bed) -> None:
    bed.saved(0, 500)
    await bed.restorer.checks.precheck(rebuild=True)
    (name,) = bed.staged()
    path = bed.snapshots.staging / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.unlink(path)
    path.write_bytes(bytes(data))  # a new file under its name: not the one whose checksum passed
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]
    assert bed.calls() != [name]
    assert bed.restored[0][-1] == 1  # the exact bytes, rebuilt in the round
    assert bed.value("used") == 0
    assert bed.value("unused") == 1
    await bed.settled()


async def test_files_no_round_took_are_deleted(bed: Bed) -> None:
    bed.saved(0, 500)
    await bed.restorer.checks.precheck(rebuild=True)
    assert bed.staged()
    await bed.restorer.drop_ahead()
    assert bed.staged() == []
    assert not bed.restorer.ahead
    assert bed.value("unused") == 1


async def test_nothing_is_rebuilt_ahead_without_room_for_the_largest_beyond(bed: Bed, tmp_path: Path) -> None:
    bed.saved(0, 500)
    bed.saved(1, 300)
    bed.restorer = restorer.Restorer(
        slot_actions=actions.SlotActions(client=bed.server, snapshots=bed.snapshots),
        snapshots=bed.snapshots,
        stats=bed.restorer._stats,
        clock=clocks.FakeClock(),
        identity=lambda: memllama.IDENTITY,
        rebuilt_ahead=ahead.Ahead(
            bed.snapshots,
            bed.restorer._stats,
            room=lambda _: ahead.Room(staging=2 * (memllama.HEADER + 500 * memllama.BYTES_PER_TOKEN), memory=None),
        ),
    )
    await bed.restorer.checks.precheck(rebuild=True)
    assert len(bed.staged()) == 1  # slot 0's fits with room for the largest beyond; slot 1's does not
    assert bed.value("skipped") == 1
    assert await bed.round() == [(0, "ok"), (1, "ok")]
    assert bed.value("used") == 1
    await bed.settled()


def test_a_snapshot_is_the_same_only_with_the_same_name_generation_and_checksum(bed: Bed) -> None:
    one = bed.saved(0, 5)
    assert ahead.same_snapshot(one, dataclasses.replace(one, created=2.0))
    assert not ahead.same_snapshot(one, dataclasses.replace(one, generation=one.generation + 1))
    other = manifest.Checksum(hashing.Algorithm.XXH3_128, "1" * 32)
    assert not ahead.same_snapshot(one, dataclasses.replace(one, checksum=other))


async def _rebuilt(bed: Bed) -> str:
    for _ in range(500):
        if bed.staged():
            (name,) = bed.staged()
            return name
        await asyncio.sleep(0.01)
    raise AssertionError("nothing rebuilt ahead")


async def test_a_swap_takes_the_file_rebuilt_while_its_slot_was_saved_and_one_is_rebuilt_at_a_time(bed: Bed) -> None:
    record, other = bed.saved(0, 500), bed.saved(1, 300, task=2)
    assert bed.restorer.rebuild_ahead(record)
    assert not bed.restorer.rebuild_ahead(other)  # one swap's rebuild at a time
    name = await _rebuilt(bed)  # meanwhile the slot's own content is saved
    result, _ = await bed.restorer.swap_in(0, record, counters=None)
    bed.restorer.rebuilt_ahead_done(record)
    assert result.result.value == "ok"
    assert bed.calls() == [name]  # the very file rebuilt ahead, not rebuilt again
    assert bed.restored[0] == bytes([0]) * memllama.HEADER + bytes([1]) * (500 * memllama.BYTES_PER_TOKEN)
    assert bed.value("used") == 1
    await bed.settled()
    assert bed.value("unused") == 0


async def test_a_swaps_file_no_restore_took_is_given_back(bed: Bed) -> None:
    record = bed.saved(0, 500)
    assert bed.restorer.rebuild_ahead(record)
    bed.restorer.rebuilt_ahead_done(record)  # the save failed: no swap
    for _ in range(500):  # given back once its rebuild is done
        if bed.value("unused") == 1:
            break
        await asyncio.sleep(0.01)
    await bed.settled()
    assert bed.value("unused") == 1
    assert bed.restorer.rebuild_ahead(record)  # and the next swap may rebuild ahead again
    bed.restorer.rebuilt_ahead_done(record)
    await bed.settled()


async def test_another_restore_gives_back_a_swaps_file_first_so_one_rebuild_is_staged_at_a_time(bed: Bed) -> None:
    record, other = bed.saved(0, 500), bed.saved(1, 300, task=2)
    seen: list[list[str]] = []

    async def look(slot: int, filename: str) -> None:
        seen.append(bed.staged())

    bed.server.hooks["restore"] = look
    assert bed.restorer.rebuild_ahead(record)
    await _rebuilt(bed)
    result, _ = await bed.restorer.swap_in(1, other, counters=None)  # another slot's swap, first under the lock
    assert result.result.value == "ok"
    assert [len(files) for files in seen] == [1]  # only its own rebuild: the other swap's was given back
    result, _ = await bed.restorer.swap_in(0, record, counters=None)  # that swap rebuilds its own then
    bed.restorer.rebuilt_ahead_done(record)
    assert result.result.value == "ok"
    assert bed.value("unused") == 1
    await bed.settled()


class _Wants:
    """A restore round's order with one request held at the gate, wanting ``file``."""

    def __init__(self, bed: Bed, file: str) -> None:
        self._bed, self._file = bed, file
        self._done: set[str] = set()

    async def next_step(self, pending: tuple[int, ...]) -> plan.Step:
        return plan.plan(pending, (self._file,), self._bed.snapshots.snapshots(), done=self._done)[0]

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        self._done.add(record.file)


async def test_a_file_rebuilt_ahead_that_a_held_request_displaces_gives_its_pages_to_the_wanted_rebuild(
    bed: Bed,
) -> None:
    wanted = bed.saved(0, 500)  # a conversation saved from slot 0, then another one there
    bed.saved(0, 600, task=2)
    bed.saved(1, 300, task=3)
    bed.snapshots.staged.keeps_spare = True  # as on a tmpfs of small pages
    await bed.restorer.checks.precheck(rebuild=True)  # each slot's newest, while the server loads
    built = {name: (bed.snapshots.staging / name).stat().st_ino for name in bed.staged()}
    assert len(built) == 2
    inodes: dict[int, int] = {}
    keep = bed.server.hooks["restore"]

    async def seen(slot: int, filename: str) -> None:
        inodes[slot] = (bed.snapshots.staging / filename).stat().st_ino
        await keep(slot, filename)

    bed.server.hooks["restore"] = seen
    await bed.restorer.restore_all(memllama.IDENTITY, healthy_at=None, counters=None, order=_Wants(bed, wanted.file))
    first = bed.restorer.verifier.last[0]
    assert (first.slot, first.result.value, first.file) == (0, "ok", wanted.file)
    assert len(bed.restored[0]) == wanted.bytes
    assert bed.restored[0][-1] == 1  # the wanted snapshot's exact bytes
    assert inodes[0] in built.values()  # rebuilt over the pages of the file rebuilt ahead for slot 0
    assert bed.calls()[1] in built  # slot 1 took its own, rebuilt ahead
    assert (bed.value("used"), bed.value("unused")) == (1, 1)
