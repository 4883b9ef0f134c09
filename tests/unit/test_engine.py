"""engine.Engine fed by a real poller over the in-memory server: what it sends, when, and what it counts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry

from sidecar.core import config, errors, events, hashing, metrics, outcomes
from sidecar.engine import engine, probe, saves, slotservice
from sidecar.observe import poller
from sidecar.save import policy, snapshotter
from sidecar.snapshots import manifest, store
from tests.support import clocks
from tests.unit import memllama


@dataclasses.dataclass
class Bed:
    server: memllama.MemLlama
    snapshots: store.SnapshotStore
    registry: CollectorRegistry
    clock: clocks.FakeClock
    watcher: poller.Poller
    engine: engine.Engine

    async def poll(self, *, after: float = 0.0) -> events.Observation:
        """Move the clock on by ``after`` seconds, poll once and hand the observation to the engine."""
        self.clock.now += after
        obs, evts = await self.watcher.step()
        await self.engine.handle(obs, evts)
        return obs

    async def cycle(self, *, after: float = 0.0) -> events.Observation:
        """A poll, then whatever it made due."""
        obs = await self.poll(after=after)
        await self.engine.work()
        return obs

    def value(self, name: str, **labels: str) -> float:
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def saves(self) -> list[tuple[int, str]]:
        """Save calls, not counting the slot-dir probe."""
        return [a for a in self.actions("save") if not a[1].startswith(store.PROBE_PREFIX)]

    def actions(self, kind: str) -> list[tuple[int, str]]:
        return [args for name, args in self.server.calls if name == kind]  # type: ignore[misc]


def make_bed(slot_dir: Path, *, read_fresh: slotservice.ReadSlots | None = None, **snapshot_settings: float) -> Bed:
    server = memllama.MemLlama(slot_dir)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(slot_dir, clock=clocks.reading(lambda: float(next(stamps))))
    registry = CollectorRegistry()
    clock = clocks.FakeClock()
    settings = config.Settings(
        upstream=config.UpstreamSettings(),
        poll=config.PollSettings(),
        snapshots=config.SnapshotSettings(
            slot_dir=slot_dir,
            min_free_bytes=0,
            **{"idle_seconds": 2.0, "min_tokens": 100, **snapshot_settings},  # type: ignore[arg-type]
        ),
        server=config.ServerSettings(),
    )
    eng = engine.Engine(
        client=server,
        snapshots=snapshots,
        stats=metrics.Metrics(registry, version="t"),
        settings=settings,
        clock=clock,
        read_fresh=read_fresh,
    )
    return Bed(server, snapshots, registry, clock, poller.Poller(server, settings.poll, clock=clock), eng)


@pytest.fixture
def bed(tmp_path: Path) -> Bed:
    return make_bed(tmp_path)


async def test_an_idle_changed_slot_is_saved_once(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle()
    assert bed.saves() == []  # not idle long enough yet
    await bed.cycle(after=3.0)
    await bed.cycle(after=3.0)
    assert [slot for slot, _ in bed.saves()] == [0]
    assert [(m.slot, m.task, m.tokens) for m in bed.snapshots.snapshots()] == [(0, 1, 500)]
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="ok") == 1
    last = bed.engine.status().last_snapshot
    assert last is not None
    assert (last.result, last.cause) == (outcomes.SaveResult.OK, None)


async def test_no_save_is_sent_to_a_slot_that_started_processing_after_the_poll(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    await bed.poll(after=3.0)  # due now, as far as the last poll knows
    bed.server.set_slot(0, processing=True)  # a request takes the slot before the save is sent
    await bed.engine.work()
    assert bed.saves() == []
    last = bed.engine.status().last_snapshot
    assert last is not None
    assert (last.result, last.cause) == (outcomes.SaveResult.SKIPPED, outcomes.SaveCause.SLOT_BUSY)
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="skipped") == 1
    bed.server.run_turn(0, task=2, tokens=800)  # its turn ends (the server's counters move)
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)
    assert [(m.task, m.tokens) for m in bed.snapshots.snapshots(0)] == [(2, 800)]


async def test_polling_goes_on_while_the_server_holds_a_save(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    bed.server.hooks["save"] = memllama.forever  # the server defers the save (a busy slot it shares a loop with)
    runner = asyncio.create_task(bed.engine.run(), name="actions")
    try:
        async with asyncio.timeout(5):
            await bed.poll(after=3.0)
            while not bed.saves():
                await asyncio.sleep(0)
        assert bed.engine.status().acting
        for n in range(5):  # each poll goes through at once, and the engine sees each one
            async with asyncio.timeout(1):
                obs = await bed.poll(after=1.0)
            assert bed.engine.status().observation is obs, n
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    assert len(bed.saves()) == 1


async def test_a_save_cut_short_leaves_no_file_even_when_the_server_writes_it_later(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    bed.server.fail["save"] = errors.UpstreamUnavailable("/slots: no answer within 300 s", endpoint="/slots")
    await bed.cycle(after=3.0)
    ((_, temp),) = bed.saves()
    last = bed.engine.status().last_snapshot
    assert last is not None
    assert last.cause is outcomes.SaveCause.SERVER
    (bed.snapshots.dir / temp).write_bytes(b"x" * 5044)  # the deferred save runs after the call gave up
    with structlog.testing.capture_logs() as logs:
        await bed.engine.final_snapshots()
    assert not (bed.snapshots.dir / temp).exists()
    assert [e["file"] for e in logs if e["event"] == "abandoned_file_removed"] == [temp]


async def test_a_probe_cut_short_leaves_no_file(bed: Bed) -> None:
    bed.server.fail["save"] = errors.UpstreamUnavailable("/slots: no answer within 300 s", endpoint="/slots")
    await bed.cycle()  # every slot unused: the engine probes the slot dir link with slot 0
    ((_, probe_name),) = bed.actions("save")
    assert bed.engine.status().link_ok is None
    (bed.snapshots.dir / probe_name).write_bytes(b"x" * 44)
    del bed.server.fail["save"]
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)  # the next action sweeps first
    assert not (bed.snapshots.dir / probe_name).exists()
    assert bed.engine.status().link_ok is True


async def test_a_probe_the_server_holds_gives_up_and_saves_go_on(bed: Bed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "PROBE_SECONDS", 0.05)
    forever = asyncio.Event()

    async def hold(slot: int, filename: str) -> None:
        if filename.startswith(store.PROBE_PREFIX):
            await forever.wait()  # llama-server holds a save of a slot a request took until the request ends

    bed.server.hooks["save"] = hold
    async with asyncio.timeout(5):
        await bed.cycle()  # every slot unused: the engine probes the slot dir link with slot 0
    ((_, probe_name),) = bed.actions("save")
    assert bed.engine.status().link_ok is None
    bed.server.run_turn(1, task=1, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    assert [slot for slot, _ in bed.saves()] == [1], "the slot action road is free again"
    assert bed.engine.status().link_ok is True
    (bed.snapshots.dir / probe_name).write_bytes(b"x" * 44)  # the held save, written once the request ended
    bed.server.run_turn(1, task=2, tokens=600)
    await bed.cycle()
    await bed.cycle(after=3.0)  # the next action sweeps first
    assert not (bed.snapshots.dir / probe_name).exists()


async def test_the_probe_proves_the_link_and_leaves_nothing(bed: Bed) -> None:
    await bed.cycle()
    assert bed.engine.status().link_ok is True
    assert [p.name for p in bed.snapshots.dir.iterdir()] == []


async def test_a_probe_file_not_seen_means_another_directory(tmp_path: Path) -> None:
    other = tmp_path / "server-side"
    other.mkdir()
    mine = tmp_path / "sidecar-side"
    mine.mkdir()
    bed = make_bed(mine)
    bed.server.dir = other
    await bed.cycle()
    assert bed.engine.status().link_ok is False
    assert "--slot-dir must be the directory" in bed.engine.status().link_problem


async def test_final_snapshot_leaves_a_sleeping_server_asleep(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    bed.server.sleeping = True  # it fell asleep after the last poll
    before = len(bed.server.calls)
    await bed.engine.final_snapshots()
    assert [name for name, _ in bed.server.calls[before:]] == ["props"]


async def test_final_snapshot_reads_the_slots_first(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    bed.server.set_slot(0, processing=True)  # since the last poll: slot 0 runs a request ...
    bed.server.run_turn(1, task=2, tokens=700)  # ... and slot 1 ran one
    await bed.engine.final_snapshots()
    assert [slot for slot, _ in bed.saves()] == [1]
    assert [(m.slot, m.task, m.tokens) for m in bed.snapshots.snapshots()] == [(1, 2, 700)]


async def test_a_restart_restores_each_slot_into_the_new_process(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    bed.server.health_state = events.Health.LOADING  # killed and restarted: loading the model
    await bed.cycle(after=1.0)
    bed.server.health_state = events.Health.OK
    bed.server.start_time = 1_764_000_500.0
    bed.server.slot_views = [memllama.slot(0), memllama.slot(1)]
    bed.server.prompt_tokens = bed.server.cached_tokens = bed.server.decodes = 0.0
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_server_restarts_total") == 1
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 1
    assert bed.value("llama_sidecar_restores_total", slot="1", result="no_snapshot") == 1
    assert not bed.engine.slots.restore_owed()


async def test_an_admin_restore_is_judged_only_by_a_task_after_it(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=5, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    assert len(bed.snapshots.snapshots(0)) == 1
    bed.server.set_slot(0, tokens=0)  # cleared (an erase, or --cache-idle-slots): task 5 stays
    await bed.cycle(after=1.0)
    records = await bed.engine.restore_now()
    assert [(r.slot, r.result) for r in records] == [(0, "ok"), (1, "no_snapshot")]
    await bed.cycle(after=1.0)  # the slot still shows task 5: that task ran before the restore
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="effective") == 0
    bed.server.run_turn(0, task=6, tokens=520, cached=500)  # the next turn reuses the restored tokens
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="effective") == 1
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="ineffective") == 0


async def test_an_effective_restore_counts_the_prefill_seconds_it_saved(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=5, tokens=2000)
    bed.server.prompt_seconds = 4.0  # the server prefilled 2,000 tokens in 4 s: 500 tokens/s
    await bed.cycle()
    await bed.cycle(after=3.0)
    bed.server.set_slot(0, tokens=0)
    await bed.cycle(after=1.0)
    await bed.engine.restore_now()
    bed.server.run_turn(0, task=6, tokens=2010, cached=2000)
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="effective") == 1
    assert bed.value("llama_sidecar_prefill_saved_tokens_total", by="restore") == 2000
    rate = 2010 / 4.0  # the server's lifetime rate as read with the judging task: 2,010 tokens prefilled in 4 s
    assert bed.value("llama_sidecar_prefill_saved_seconds_total", by="restore") == pytest.approx(2000 / rate)
    assert bed.value("llama_sidecar_prefill_saved_seconds_total", by="swap") == 0
    saved = bed.engine.status().saved
    assert saved.seconds == pytest.approx(2000 / rate)
    assert (saved.tokens, saved.rate) == (2000, rate)


async def test_an_ineffective_restore_saves_no_time(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=5, tokens=2000)
    bed.server.prompt_seconds = 4.0
    await bed.cycle()
    await bed.cycle(after=3.0)
    bed.server.set_slot(0, tokens=0)
    await bed.cycle(after=1.0)
    await bed.engine.restore_now()
    bed.server.run_turn(0, task=6, tokens=2010, cached=10)
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="ineffective") == 1
    assert bed.value("llama_sidecar_prefill_saved_seconds_total", by="restore") == 0
    assert bed.engine.status().saved.seconds == 0


async def test_a_restore_whose_next_task_re_prefills_is_ineffective(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=5, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    bed.server.set_slot(0, tokens=0)
    await bed.cycle(after=1.0)
    await bed.engine.restore_now()
    bed.server.run_turn(0, task=6, tokens=520, cached=0)
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="ineffective") == 1


async def test_every_result_word_is_a_label_from_the_enums(bed: Bed) -> None:
    await bed.cycle()
    for result in outcomes.SaveResult:
        assert bed.value("llama_sidecar_snapshots_total", slot="1", result=result.value) == 0
    for outcome in outcomes.RestoreOutcome:
        assert bed.registry.get_sample_value("llama_sidecar_restores_total", {"slot": "1", "result": outcome}) == 0
    assert metrics.RESTORE_RESULTS[-3:] == ("raced", "ineffective", "unverified")


async def test_files_are_checked_while_the_server_loads_not_once_it_is_up(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    check = bed.snapshots.curator.check
    checked: list[events.Health] = []

    def recorded_verify(record: manifest.Manifest) -> None:
        checked.append(bed.server.health_state)
        check(record)

    monkeypatch.setattr(bed.snapshots.curator, "check", recorded_verify)
    bed.server.health_state = events.Health.DOWN  # killed
    await bed.cycle(after=1.0)
    bed.server.health_state = events.Health.LOADING
    await bed.cycle(after=1.0)
    assert checked == [events.Health.DOWN]  # checked as soon as it went away, once
    bed.server.health_state = events.Health.OK
    bed.server.start_time = 1_764_000_500.0
    bed.server.slot_views = [memllama.slot(0), memllama.slot(1)]
    await bed.cycle(after=1.0)
    assert checked == [events.Health.DOWN]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 1


async def test_a_due_save_waits_while_another_slot_generates(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    bed.server.set_slot(1, task=2, tokens=50, processing=True)  # a long generation on slot 1
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            await bed.cycle(after=3.0)
    assert bed.saves() == []
    assert [e["slot"] for e in logs if e["event"] == "snapshot_held"] == [0]  # said once
    slot_reads = bed.server.names().count("slots")
    await bed.engine.work()
    assert bed.server.names().count("slots") == slot_reads  # holding costs no /slots read
    bed.server.run_turn(1, task=2, tokens=900)  # slot 1 is done
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)
    assert sorted(slot for slot, _ in bed.saves()) == [0, 1]


async def test_a_held_save_is_taken_once_the_snapshot_interval_runs_out(tmp_path: Path) -> None:
    bed = make_bed(tmp_path, interval=20.0)
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    bed.server.set_slot(1, task=2, tokens=50, processing=True)
    await bed.cycle(after=1.0)
    for _ in range(5):
        await bed.cycle(after=3.0)
    assert bed.saves() == []
    await bed.cycle(after=10.0)  # 26 s since slot 0 changed: past --snapshot-interval
    assert [slot for slot, _ in bed.saves()] == [0]


async def test_save_hold_seconds_caps_the_hold_and_zero_turns_it_off(tmp_path: Path) -> None:
    for hold, saved_after in ((8.0, [False, True]), (0.0, [True, True])):
        (tmp_path / str(hold)).mkdir()
        bed = make_bed(tmp_path / str(hold), hold_seconds=hold)
        await bed.cycle()
        bed.server.run_turn(0, task=1, tokens=500)
        bed.server.set_slot(1, task=2, tokens=50, processing=True)  # a long generation on slot 1
        await bed.cycle(after=1.0)
        await bed.cycle(after=3.0)  # due (idle 2 s), 4 s after the change
        first = [slot for slot, _ in bed.saves()] == [0]
        await bed.cycle(after=5.0)  # 9 s after the change: past a hold of 8 s
        assert [first, [slot for slot, _ in bed.saves()] == [0]] == saved_after, hold


SAVE_CALL = 0.06
"""Seconds each save of the weighing tests takes the server: 0.1 ms per token of a 600-token slot."""


async def weighed_bed(tmp_path: Path, *, max_unsaved_seconds: float = 10.0) -> Bed:
    """Slot 0 saved (600 tokens, its save call measured) at 1,000 prompt tokens per second; slot 1 generating."""
    bed = make_bed(tmp_path, hold_seconds=8.0, max_unsaved_seconds=max_unsaved_seconds)
    bed.server.save_ms = SAVE_CALL * 1000
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=600)
    bed.server.prompt_seconds = 0.6
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)  # idle, no other slot processing: saved at once
    assert [slot for slot, _ in bed.saves()] == [0]
    bed.server.set_slot(1, task=2, tokens=50, processing=True)  # a long generation on slot 1
    return bed


async def test_a_save_past_its_hold_waits_while_its_tail_re_prefills_faster_than_it_stalls(tmp_path: Path) -> None:
    bed = await weighed_bed(tmp_path)
    bed.server.run_turn(0, task=3, tokens=610, cached=600)  # 10 tokens: 0.01 s of re-prefill
    bed.server.prompt_seconds = 0.61
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)  # due (idle 2 s): held, another slot is processing
    await bed.cycle(after=5.0)  # 9 s after the change: past the hold of 8 s, weighed
    await bed.cycle(after=5.0)
    assert [slot for slot, _ in bed.saves()] == [0]  # a save would stall slot 1 for ~0.06 s: not made
    assert bed.value("llama_sidecar_snapshots_held_total", reason="hold") == 1
    assert bed.value("llama_sidecar_snapshots_held_total", reason="cheap_tail") == 1
    assert bed.value("llama_sidecar_slot_unsaved_reprefill_seconds", slot="0") == pytest.approx(0.01)
    stall = bed.value("llama_sidecar_slot_save_expected_stall_seconds", slot="0")
    assert stall == pytest.approx(SAVE_CALL * 610 / 600)
    bed.server.run_turn(0, task=4, tokens=1000, cached=610)  # 400 tokens: 0.4 s of re-prefill
    bed.server.prompt_seconds = 1.0
    for _ in range(5):  # /slots is read every 5 s while slot 1 generates (poller.BUSY_REFRESH)
        await bed.cycle(after=2.0)
    assert [slot for slot, _ in bed.saves()] == [0, 0]  # saved while slot 1 generates
    bed.server.set_slot(1, processing=False)
    await bed.cycle(after=1.0)
    assert next((m.task, m.tokens) for m in bed.snapshots.snapshots(0)) == (4, 1000)
    assert bed.value("llama_sidecar_slot_unsaved_reprefill_seconds", slot="0") == 0


async def test_a_cheap_tail_past_max_unsaved_seconds_is_saved_past_its_hold(tmp_path: Path) -> None:
    bed = await weighed_bed(tmp_path, max_unsaved_seconds=0.005)
    bed.server.run_turn(0, task=3, tokens=610, cached=600)  # 0.01 s of re-prefill: over the bound
    bed.server.prompt_seconds = 0.61
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)
    assert [slot for slot, _ in bed.saves()] == [0]  # held
    await bed.cycle(after=5.0)
    assert [slot for slot, _ in bed.saves()] == [0, 0]
    assert bed.value("llama_sidecar_snapshots_held_total", reason="cheap_tail") == 0


async def test_a_save_held_when_the_slots_are_read_before_it(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.poll()
    await bed.poll(after=3.0)
    bed.server.set_slot(1, task=2, tokens=50, processing=True)  # starts after the poll
    await bed.engine.work()
    assert bed.saves() == []
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="skipped") == 0  # held, not skipped


async def test_a_restore_round_that_cannot_read_the_slots_is_tried_again(bed: Bed) -> None:
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle()
    await bed.cycle(after=3.0)
    bed.server.health_state = events.Health.LOADING
    await bed.cycle(after=1.0)
    bed.server.health_state = events.Health.OK
    bed.server.start_time = 1_764_000_500.0
    bed.server.slot_views = [memllama.slot(0), memllama.slot(1)]
    await bed.poll(after=1.0)
    bed.server.fail["slots"] = errors.UpstreamUnavailable("/slots: no answer within 5 s", endpoint="/slots")
    await bed.engine.work()
    assert bed.engine.slots.restore_owed()
    del bed.server.fail["slots"]
    await bed.cycle(after=1.0)
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 1


async def test_a_turn_the_poll_did_not_see_is_saved_once_while_another_slot_generates(tmp_path: Path) -> None:
    """While slot 1 generates the poller carries its /slots listing over (it reads it again only
    every few seconds); the save reads slot 0 afresh and finds a newer turn. Once that is saved, the
    carried-over listing, older than the save's read, must not make the older turn look unsaved."""
    bed = make_bed(tmp_path, hold_seconds=0.0)
    await bed.cycle()
    bed.server.set_slot(1, task=9, tokens=50, processing=True)  # generates throughout
    bed.server.run_turn(0, task=1, tokens=500)
    await bed.cycle(after=1.0)  # the busy count changed: /slots read, slot 0 holds turn 1
    bed.server.run_turn(0, task=2, tokens=520)  # between two polls; the busy count stays 1
    for _ in range(4):
        await bed.cycle(after=1.0)  # turn 1 is due at 2 s idle; the save finds turn 2
    assert bed.server.names().count("slots") < 2 + 4 + 4  # the poller carried its listing over
    assert [slot for slot, _ in bed.saves()] == [0]
    bed.server.run_turn(1, task=9, tokens=50)  # slot 1 is done: the commit that waited is made
    await bed.cycle(after=1.0)
    assert [(m.task, m.tokens) for m in bed.snapshots.snapshots(0)] == [(2, 520)]
    assert [slot for slot, _ in bed.saves()] == [0]


def pending(bed: Bed) -> float:
    return bed.value("llama_sidecar_snapshot_commits_pending")


async def saved_while_slot_1_generates(tmp_path: Path) -> Bed:
    """Slot 0 saved (no hold: --save-hold-seconds 0) while slot 1 generates: its commit waits."""
    bed = make_bed(tmp_path, hold_seconds=0.0)
    await bed.cycle()
    bed.server.run_turn(0, task=1, tokens=500)
    bed.server.set_slot(1, task=2, tokens=50, processing=True)
    await bed.cycle(after=1.0)
    await bed.cycle(after=3.0)  # due: saved now, its commit waits while slot 1 generates
    return bed


async def test_a_save_while_another_slot_generates_is_committed_once_none_is_processing(
    tmp_path: Path, hash_pauses: list[float]
) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    assert ([slot for slot, _ in bed.saves()], bed.snapshots.snapshots(), pending(bed)) == ([0], [], 1)
    await bed.cycle(after=1.0)
    assert (bed.snapshots.snapshots(), hash_pauses) == ([], [])
    bed.server.run_turn(1, task=2, tokens=900)  # slot 1 is done
    await bed.cycle(after=1.0)
    (record,) = bed.snapshots.snapshots(0)
    assert (record.tokens, hash_pauses, pending(bed)) == (500, [0.0], 0)  # unpaced: nothing generates
    assert record.created == bed.clock.wall() - 2.0  # dated by the save, not by the commit
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="ok") == 1
    await bed.cycle(after=3.0)
    assert [slot for slot, _ in bed.saves()] == [0, 1]  # slot 1's own save; slot 0 is not saved again


async def test_a_commit_that_waited_commit_wait_is_made_paced(tmp_path: Path, hash_pauses: list[float]) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    await bed.cycle(after=snapshotter.COMMIT_WAIT - 1.0)
    assert bed.snapshots.snapshots() == []
    await bed.cycle(after=1.0)
    assert [m.tokens for m in bed.snapshots.snapshots(0)] == [500]
    assert hash_pauses == [hashing.PACE]


async def test_a_restart_commits_the_waiting_saves_and_restores_them(tmp_path: Path) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    assert (bed.snapshots.snapshots(), pending(bed)) == ([], 1)
    bed.server.start_time = 1_764_000_500.0  # killed mid-generation and back, between two polls
    bed.server.slot_views = [memllama.slot(0), memllama.slot(1)]
    await bed.cycle(after=1.0)
    assert [m.tokens for m in bed.snapshots.snapshots(0)] == [500]
    assert bed.actions("restore") == [(0, bed.snapshots.snapshots(0)[0].file)]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 1


async def test_the_waiting_saves_are_committed_while_the_server_is_down(tmp_path: Path) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    bed.server.health_state = events.Health.LOADING
    await bed.cycle(after=1.0)
    assert ([m.tokens for m in bed.snapshots.snapshots(0)], pending(bed)) == ([500], 0)


async def test_a_waiting_commit_that_fails_makes_the_slot_due_again(tmp_path: Path) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    ((_, temp),) = bed.saves()
    with (tmp_path / temp).open("ab") as f:
        f.write(b"x")  # changed since the server wrote it: the commit's size check fails
    bed.server.run_turn(1, task=2, tokens=60)  # below --min-tokens: slot 1 itself is never saved
    await bed.cycle(after=1.0)
    assert bed.snapshots.snapshots() == []
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="failed") == 1
    await bed.cycle(after=saves.RETRY_AFTER)
    assert [slot for slot, _ in bed.saves()] == [0, 0]
    assert [m.tokens for m in bed.snapshots.snapshots(0)] == [500]


async def test_a_swap_of_a_slot_whose_commit_waits_commits_it_and_saves_again_if_that_failed(tmp_path: Path) -> None:
    """The library gives the slot away once its content is saved: a commit that waits is made first."""
    bed = await saved_while_slot_1_generates(tmp_path)
    ((_, temp),) = bed.saves()
    with (tmp_path / temp).open("ab") as f:
        f.write(b"x")  # the waiting commit will fail its size check
    swap = policy.Save(0, events.SlotContent(1, 500), 500, policy.SaveReason.SWAP)
    assert await bed.engine.slots.save(swap)
    assert [slot for slot, _ in bed.saves()] == [0, 0]  # saved again, not taken as saved already
    assert [m.tokens for m in bed.snapshots.snapshots(0)] == [500]
    assert bed.value("llama_sidecar_snapshots_total", slot="0", result="failed") == 1


async def test_shutdown_commits_the_waiting_saves(tmp_path: Path) -> None:
    bed = await saved_while_slot_1_generates(tmp_path)
    assert bed.snapshots.snapshots() == []
    await bed.engine.final_snapshots()
    assert [m.tokens for m in bed.snapshots.snapshots(0)] == [500]
    assert [slot for slot, _ in bed.saves()] == [0]  # slot 1 is busy: not saved


async def test_steady_traffic_on_two_slots_saves_within_the_default_hold_and_exports_the_unsaved_change(
    bed: Bed,
) -> None:
    """Slot 1 always generating, slot 0 taking a turn every 5 s: no moment comes when no other slot processes."""
    hold = config.SnapshotSettings(slot_dir=bed.snapshots.dir).hold_seconds
    await bed.cycle()
    unsaved = "llama_sidecar_slot_unsaved_since_timestamp_seconds"
    assert bed.value(unsaved, slot="0") == 0
    bed.server.set_slot(1, task=100, tokens=50, processing=True)
    first_change = None
    for tick in range(200):
        if tick % 5 == 0:
            bed.server.run_turn(0, task=tick + 1, tokens=500 + tick)
            bed.server.decodes += 1
        await bed.cycle(after=1.0)
        if first_change is None:
            first_change = bed.clock.wall()
            assert bed.value(unsaved, slot="0") == first_change
        if bed.saves():
            break
    assert first_change is not None
    assert bed.saves(), f"nothing saved in {bed.clock.wall() - first_change:.0f} s of steady traffic"
    assert bed.clock.wall() - first_change <= hold + 5.0
    assert bed.value(unsaved, slot="0") == 0  # the save covers every change so far


async def test_a_fresh_read_listing_slots_props_did_not_announce_is_refused(tmp_path: Path) -> None:
    many = tuple(events.SlotView(id=i, n_ctx=4096, processing=False, task=None, tokens=0) for i in range(20_000))

    async def lying() -> tuple[events.SlotView, ...]:  # the request path's reader knows nothing of /props
        return many

    bed = make_bed(tmp_path, read_fresh=lying)
    await bed.cycle()  # the identity is known: total_slots as /props says
    total = bed.server.identity.total_slots
    with pytest.raises(errors.UpstreamProtocolError, match=f"below the {total} slots /props announced"):
        await bed.engine.slots.fresh_slots()
    assert bed.value("llama_sidecar_slot_unsaved_since_timestamp_seconds", slot="1") == 0
    assert bed.registry.get_sample_value("llama_sidecar_slot_unsaved_since_timestamp_seconds", {"slot": "2"}) is None
