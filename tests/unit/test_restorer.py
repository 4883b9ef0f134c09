"""restorer.Restorer against the in-memory server: the window around the restore call, and its checks."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import structlog.testing
from prometheus_client import CollectorRegistry

from sidecar.core import events, metrics, outcomes, protocols
from sidecar.restore import restorer
from sidecar.slots import actions
from sidecar.snapshots import manifest, store
from tests.support import clocks
from tests.unit import memllama

FP = manifest.Fingerprint.of(memllama.IDENTITY, n_ctx=memllama.N_CTX)


@dataclasses.dataclass
class Bed:
    server: memllama.MemLlama
    snapshots: store.SnapshotStore
    registry: CollectorRegistry
    restorer: restorer.Restorer

    def saved(self, slot: int, tokens: int, *, task: int = 1, created: float | None = None) -> manifest.Manifest:
        """A committed snapshot of ``slot``, as an earlier save left it (dated ``created``; None: the clock's)."""
        temp = self.snapshots.writer.temp_name(slot)
        data = bytes([slot]) * memllama.HEADER + bytes([task % 256]) * (tokens * memllama.BYTES_PER_TOKEN)
        (self.snapshots.dir / temp).write_bytes(data)
        return self.snapshots.writer.commit(
            temp, slot=slot, tokens=tokens, written=len(data), task=task, fingerprint=FP, created=created
        )

    def value(self, name: str, **labels: str) -> float:
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    async def round(self) -> list[tuple[int, outcomes.RestoreOutcome]]:
        await self.restorer.restore_all(memllama.IDENTITY, healthy_at=None, counters=None)
        return [(r.slot, r.result) for r in self.restorer.verifier.last]


@pytest.fixture
def bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bed:
    server = memllama.MemLlama(tmp_path)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(tmp_path, clock=clocks.reading(lambda: float(next(stamps))))
    check = snapshots.curator.check

    def recorded_verify(record: manifest.Manifest) -> None:
        server.calls.append(("verify", record.file))
        check(record)

    monkeypatch.setattr(snapshots.curator, "check", recorded_verify)
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    stats.init_slots(range(2))
    slot_actions = actions.SlotActions(client=server, snapshots=snapshots)
    worker = restorer.Restorer(
        slot_actions=slot_actions,
        snapshots=snapshots,
        stats=stats,
        clock=clocks.FakeClock(),
        identity=lambda: memllama.IDENTITY,
    )
    return Bed(server, snapshots, registry, worker)


async def test_a_request_that_runs_on_the_slot_during_the_restore_call_is_counted_raced(bed: Bed) -> None:
    bed.saved(0, 500)

    async def request_runs_first(slot: int, filename: str) -> None:
        bed.server.run_turn(slot, task=9, tokens=40)  # the server deferred the restore behind it

    bed.server.hooks["restore"] = request_runs_first
    assert await bed.round() == [(0, "raced"), (1, "no_snapshot")]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="raced") == 1
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 0
    assert bed.value("llama_sidecar_restored_tokens_total", slot="0") == 0
    assert bed.restorer.verifier.unverified == {}


async def test_files_checked_ahead_are_not_hashed_between_the_slot_read_and_the_restore(bed: Bed) -> None:
    newest = bed.saved(0, 500)
    bed.saved(1, 300)
    await bed.restorer.checks.precheck()  # while the server loads
    assert sorted(str(f) for name, f in bed.server.calls if name == "verify") == sorted(
        m.file for m in bed.snapshots.snapshots()
    )
    bed.server.calls.clear()
    assert await bed.round() == [(0, "ok"), (1, "ok")]
    names = bed.server.names()
    assert "verify" not in names
    assert names[: names.index("restore")].count("slots") == 1  # nothing ran between the round's read and the call
    for i, name in enumerate(names):
        if name == "restore":
            assert names[i - 1] == "slots"  # read right before
            assert names[i + 1] == "slots"  # and right after
    assert bed.restorer.verifier.unverified[0].tokens == newest.tokens


async def test_the_precheck_checks_the_newest_snapshot_by_generation_whatever_the_wall_clock_said(bed: Bed) -> None:
    """A clock stepped back dates the newer snapshot earlier: the precheck checks it, the one the round restores."""
    older = bed.saved(0, 400, task=1)
    newer = bed.saved(0, 500, task=2, created=older.created - 3600.0)
    assert bed.snapshots.snapshots(0) == [newer, older]
    await bed.restorer.checks.precheck()
    assert [f for name, f in bed.server.calls if name == "verify"] == [newer.file]


async def test_a_file_changed_after_its_check_is_checked_again_and_the_older_one_restored(bed: Bed) -> None:
    older = bed.saved(0, 400, task=1)
    newest = bed.saved(0, 500, task=2)
    await bed.restorer.checks.precheck()
    path = bed.snapshots.dir / newest.file
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]
    assert [args for name, args in bed.server.calls if name == "restore"] == [(0, older.file)]
    assert (bed.snapshots.dir / (newest.file + store.QUARANTINE_SUFFIX)).exists()


async def test_a_slot_whose_only_snapshot_is_corrupt_is_left_for_a_normal_prefill(bed: Bed) -> None:
    only = bed.saved(0, 500)
    (bed.snapshots.dir / only.file).write_bytes(b"\0" * only.bytes)
    assert await bed.round() == [(0, "failed"), (1, "no_snapshot")]
    assert "restore" not in bed.server.names()


async def test_a_slot_taken_while_its_file_is_hashed_is_left_to_the_request(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed.saved(0, 500)  # not checked ahead (the sidecar started with the server already up)
    check = bed.snapshots.curator.check

    def slow_verify(record: manifest.Manifest) -> None:
        check(record)
        bed.server.set_slot(0, task=3, tokens=60, processing=True)  # a request arrives meanwhile

    monkeypatch.setattr(bed.snapshots.curator, "check", slow_verify)
    assert await bed.round() == [(0, "slot_busy"), (1, "no_snapshot")]
    assert "restore" not in bed.server.names()


async def test_a_slot_is_read_again_once_the_round_has_hashed_or_restored(bed: Bed) -> None:
    bed.saved(0, 500)
    bed.saved(1, 300)  # neither checked ahead: the round hashes both
    assert await bed.round() == [(0, "ok"), (1, "ok")]
    names = bed.server.names()
    for i, name in enumerate(names):
        if name == "restore":
            assert names[i - 1] == "slots"  # read after the file was hashed, right before the call
    assert names.count("slots") == 6  # the listing; slot 1 before its check; after each check; after each call


async def test_each_restore_round_hashes_its_files_anew(bed: Bed) -> None:
    bed.saved(0, 500)
    await bed.restorer.checks.precheck()
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]
    bed.server.set_slot(0, tokens=0)
    bed.server.calls.clear()
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]  # no precheck before this one
    assert bed.server.names().count("verify") == 1


async def test_a_swap_judged_effective_is_listed_and_its_saved_prefill_counted_as_a_swap(bed: Bed) -> None:
    record = bed.saved(1, 1000, task=3)
    bed.server.prompt_tokens, bed.server.prompt_seconds = 4000.0, 8.0  # the server prefills 500 tokens/s
    counters = await bed.server.counters()
    result, after = await bed.restorer.swap_in(0, record, counters=counters)
    assert result.result is outcomes.RestoreOutcome.OK
    assert after is not None
    assert [(d.by, d.slot, d.tokens, d.verdict) for d in bed.restorer.verifier.recent] == [
        (outcomes.SavedBy.SWAP, 0, 1000, None)
    ]
    bed.server.run_turn(0, task=(after.task or 0) + 1, tokens=1010, cached=1000)
    obs = events.Observation(
        at=bed.restorer.verifier.unverified[0].at + 1.0,
        health=events.Health.OK,
        slots=tuple(bed.server.slot_views),
        counters=await bed.server.counters(),
        counters_fresh=True,
    )
    bed.restorer.verifier.observe(obs, memllama.IDENTITY)
    bed.restorer.verifier.judge(obs)
    rate = 4010 / 8.0
    assert bed.value("llama_sidecar_prefill_saved_seconds_total", by="swap") == pytest.approx(1000 / rate)
    assert bed.value("llama_sidecar_prefill_saved_tokens_total", by="swap") == 1000
    assert bed.value("llama_sidecar_prefill_saved_seconds_total", by="restore") == 0
    (done,) = bed.restorer.verifier.recent
    assert (done.verdict, done.reused_tokens) == (outcomes.Verification.EFFECTIVE, 1000)
    assert done.saved_seconds == pytest.approx(1000 / rate)


@pytest.mark.parametrize(
    "foreign",
    [
        {"weights": "xxh3-128:" + "4" * 32},
        {"adapters": (events.Adapter(id=0, path="/lora/other.gguf", scale=1.0),)},
        {"build_info": "b9999-0000000"},
        {"total_slots": 4},
    ],
    ids=["weights", "adapters", "build", "slots"],
)
async def test_a_swap_of_a_snapshot_that_does_not_fit_the_server_is_refused_before_the_server_sees_it(
    bed: Bed, foreign: dict[str, object]
) -> None:
    """The library's and the shared store's road into a slot: the restore round's check, not the key prefix."""
    fits = dataclasses.replace(memllama.IDENTITY, weights="xxh3-128:" + "3" * 32, adapters=())
    bed.restorer = restorer.Restorer(
        slot_actions=actions.SlotActions(client=bed.server, snapshots=bed.snapshots),
        snapshots=bed.snapshots,
        stats=bed.restorer._stats,
        clock=clocks.FakeClock(),
        identity=lambda: fits,
    )
    fingerprint = manifest.Fingerprint.of(dataclasses.replace(fits, **foreign), n_ctx=memllama.N_CTX)  # type: ignore[arg-type]
    temp = bed.snapshots.writer.temp_name(1)
    data = bytes(memllama.HEADER) + bytes(300 * memllama.BYTES_PER_TOKEN)
    (bed.snapshots.dir / temp).write_bytes(data)
    other = bed.snapshots.writer.commit(temp, slot=1, tokens=300, written=len(data), task=1, fingerprint=fingerprint)
    with structlog.testing.capture_logs() as logs:
        record, after = await bed.restorer.swap_in(0, other, counters=None)
    assert (record.result, after) == (outcomes.RestoreOutcome.INCOMPATIBLE, None)
    assert "restore" not in bed.server.names()
    assert bed.value("llama_sidecar_restores_total", slot="0", result="incompatible") == 1
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 0
    (refusal,) = [e for e in logs if e["event"] == "snapshot_incompatible"]
    assert refusal["differences"].split(":")[0] == next(iter(foreign))
    assert refusal["effect"]
    assert refusal["hint"]

    own = bed.saved(0, 200)
    record, after = await bed.restorer.swap_in(0, own, counters=None)  # one that fits goes in
    assert record.result is outcomes.RestoreOutcome.OK


SLIDING = dataclasses.replace(memllama.IDENTITY, memory=events.Memory.SWA)
"""A sliding-window model (Gemma 3), as the poller read its GGUF header."""


def _sliding_bed(bed: Bed) -> None:
    """The restorer of ``bed`` serving a sliding-window model."""
    bed.restorer = restorer.Restorer(
        slot_actions=actions.SlotActions(client=bed.server, snapshots=bed.snapshots),
        snapshots=bed.snapshots,
        stats=bed.restorer._stats,
        clock=clocks.FakeClock(),
        identity=lambda: SLIDING,
    )


def _after_a_task(bed: Bed, slot: int, *, cached: float) -> events.Observation:
    bed.server.run_turn(slot, task=50, tokens=20)
    views = tuple(memllama.slot(i, task=50 if i == slot else None, tokens=520 if i == slot else 0) for i in range(2))
    return events.Observation(
        at=1e9,
        health=events.Health.OK,
        slots=views,
        counters=events.Counters(start_time=None, prompt_tokens=0.0, cached_tokens=cached),
        counters_fresh=True,
    )


async def _sliding_round(bed: Bed) -> None:
    _sliding_bed(bed)
    bed.saved(0, 500)
    await bed.restorer.restore_all(
        SLIDING, healthy_at=None, counters=events.Counters(start_time=None, prompt_tokens=0.0, cached_tokens=0.0)
    )
    assert [(r.slot, r.result) for r in bed.restorer.verifier.last] == [(0, "unverified"), (1, "no_snapshot")]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 0
    assert bed.value("llama_sidecar_restores_total", slot="0", result="unverified") == 0  # not yet: undecided


def _counted(bed: Bed, slot: str) -> float:
    return sum(bed.value("llama_sidecar_restores_total", slot=slot, result=r.value) for r in outcomes.RestoreOutcome)


@pytest.mark.parametrize(("reused", "verdict"), [(500.0, "ok"), (0.0, "ineffective")])
async def test_a_restore_on_a_sliding_window_model_is_counted_only_once_its_next_request_decides(
    bed: Bed, reused: float, verdict: str
) -> None:
    """/props does not say whether --swa-full is on: the first request after the restore decides."""
    await _sliding_round(bed)
    bed.restorer.verifier.judge(_after_a_task(bed, 0, cached=reused))
    assert bed.value("llama_sidecar_restores_total", slot="0", result=verdict) == 1
    assert _counted(bed, "0") == 1
    assert bed.restorer.verifier.last[0].result == verdict
    assert ("extends all of its tokens" in bed.restorer.verifier.last[0].detail) is (verdict == "ineffective")


@pytest.mark.parametrize(("reused", "verdict"), [(500, "ok"), (3, "ineffective")])
async def test_a_sliding_window_restore_is_decided_by_the_proxied_answer_too(
    bed: Bed, reused: int, verdict: str
) -> None:
    """The per-request verdict (the answer's own cache_n through the proxy) decides it as a poll would."""
    await _sliding_round(bed)
    bed.restorer.verifier.answered(0, reused)
    assert bed.value("llama_sidecar_restores_total", slot="0", result=verdict) == 1
    assert _counted(bed, "0") == 1
    assert bed.restorer.verifier.last[0].result == verdict


async def test_a_sliding_window_restore_lost_before_any_request_is_counted_unverified(bed: Bed) -> None:
    await _sliding_round(bed)
    bed.restorer.verifier.forget_pending()  # the server restarted before a request came
    assert bed.value("llama_sidecar_restores_total", slot="0", result="unverified") == 1
    assert _counted(bed, "0") == 1
    assert bed.restorer.verifier.last[0].result == "unverified"
    assert bed.restorer.verifier.unverified == {}


async def test_a_restore_on_a_full_attention_model_is_counted_ok_at_once(bed: Bed) -> None:
    bed.saved(0, 500)
    assert await bed.round() == [(0, "ok"), (1, "no_snapshot")]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 1
    bed.restorer.verifier.forget_pending()
    assert _counted(bed, "0") == 1  # counted once, never again by its verdict


async def test_a_restore_the_server_answers_with_fewer_tokens_is_failed_not_ok(bed: Bed) -> None:
    bed.saved(0, 500)
    restore = bed.server.restore

    async def short(slot_id: int, filename: str) -> protocols.ActionResult:
        got = await restore(slot_id, filename)
        return dataclasses.replace(got, tokens=got.tokens - 100)

    bed.server.restore = short  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        assert await bed.round() == [(0, "failed"), (1, "no_snapshot")]
    assert bed.value("llama_sidecar_restores_total", slot="0", result="ok") == 0
    assert bed.value("llama_sidecar_restores_total", slot="0", result="failed") == 1
    (said,) = [e for e in logs if e["event"] == "restore_incomplete"]
    assert (said["restored_tokens"], said["snapshot_tokens"]) == (400, 500)
    assert said["hint"]
