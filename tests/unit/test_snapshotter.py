"""snapshotter.Snapshotter against the in-memory server: each way a save ends, as a result and a cause."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import config, errors, events, metrics, outcomes, protocols
from sidecar.save import policy, records, snapshotter, storefault
from sidecar.slots import actions
from sidecar.snapshots import manifest, store
from tests.support import clocks
from tests.unit import memllama

R, C = outcomes.SaveResult, outcomes.SaveCause
SAVE = policy.Save(0, events.SlotContent(4, 500), 500, policy.SaveReason.IDLE)


def make(
    tmp_path: Path,
    *,
    min_free_bytes: int = 0,
    server_dir: Path | None = None,
    clock: clocks.FakeClock | None = None,
    ended: list[tuple[snapshotter.Written, records.SaveRecord]] | None = None,
) -> tuple[memllama.MemLlama, snapshotter.Snapshotter, CollectorRegistry]:
    """``ended``: where the saves whose commit waited are told, once committed."""
    server = memllama.MemLlama(server_dir or tmp_path)
    server.set_slot(0, task=4, tokens=500)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(tmp_path, clock=clocks.reading(lambda: float(next(stamps))))
    registry = CollectorRegistry()
    saver = snapshotter.Snapshotter(
        slot_actions=actions.SlotActions(client=server, snapshots=snapshots),
        snapshots=snapshots,
        stats=metrics.Metrics(registry, version="t"),
        settings=config.SnapshotSettings(slot_dir=tmp_path, min_free_bytes=min_free_bytes),
        clock=clock or clocks.FakeClock(),
        committed_later=lambda written, record: (ended if ended is not None else []).append((written, record)),
    )
    return server, saver, registry


def committed(tmp_path: Path, slot: int) -> list[manifest.Manifest]:
    """The slot's snapshots as a fresh scan of the directory finds them, newest first."""
    found = store.SnapshotStore(tmp_path, clock=clocks.reading(lambda: 0.0))
    found.loader.scan(clean=False)
    return found.snapshots(slot)


async def save(saver: snapshotter.Snapshotter) -> records.SaveRecord:
    record = await saver.save(SAVE, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX)
    assert isinstance(record, records.SaveRecord)
    return record


def counted(registry: CollectorRegistry, result: outcomes.SaveResult) -> float:
    return registry.get_sample_value("llama_sidecar_snapshots_total", {"slot": "0", "result": result}) or 0.0


async def test_ok(tmp_path: Path) -> None:
    _, saver, registry = make(tmp_path)
    record = await save(saver)
    assert (record.result, record.cause, record.tokens) == (R.OK, None, 500)
    assert record.detail.startswith("slot0-")
    assert counted(registry, R.OK) == 1


def empty(server: memllama.MemLlama) -> None:
    server.set_slot(0, tokens=0)


def not_supported(server: memllama.MemLlama) -> None:
    server.fail["save"] = errors.UpstreamNotSupported("/slots: HTTP 501", endpoint="/slots", status=501)


def unavailable(server: memllama.MemLlama) -> None:
    server.fail["save"] = errors.UpstreamUnavailable("/slots: no answer within 300 s", endpoint="/slots")


@pytest.mark.parametrize(
    ("setup", "result", "cause"),
    [
        (empty, R.SKIPPED, C.EMPTY),
        (not_supported, R.FAILED, C.NOT_SUPPORTED),
        (unavailable, R.FAILED, C.SERVER),
    ],
)
async def test_each_way_a_save_ends(
    tmp_path: Path, setup: Callable[[memllama.MemLlama], None], result: outcomes.SaveResult, cause: outcomes.SaveCause
) -> None:
    server, saver, registry = make(tmp_path)
    setup(server)
    record = await save(saver)
    assert (record.result, record.cause) == (result, cause)
    assert counted(registry, result) == 1
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing left behind


@pytest.mark.parametrize("others_busy", [False, True], ids=["committed-at-once", "commit-waits"])
async def test_a_file_that_does_not_match_the_servers_size_fails_its_check_at_once(
    tmp_path: Path, others_busy: bool
) -> None:
    """Also when its commit would wait for another slot's generation: the size needs no read."""
    server, saver, _ = make(tmp_path)
    real_save = server.save

    async def short_write(slot: int, filename: str) -> protocols.ActionResult:
        result = await real_save(slot, filename)
        path = server.dir / filename
        path.write_bytes(path.read_bytes()[: result.bytes // 2])
        return result

    server.save = short_write  # type: ignore[method-assign,assignment]
    record = await saver.save(SAVE, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX, others_busy=others_busy)
    assert isinstance(record, records.SaveRecord)
    assert (record.result, record.cause, saver.pending) == (R.FAILED, C.CHECK, collections.deque())
    assert [p.name for p in tmp_path.iterdir()] == []


async def test_a_server_writing_elsewhere_is_not_linked(tmp_path: Path) -> None:
    elsewhere = tmp_path / "server"
    elsewhere.mkdir()
    mine = tmp_path / "sidecar"
    mine.mkdir()
    _, saver, _ = make(mine, server_dir=elsewhere)
    record = await save(saver)
    assert (record.result, record.cause) == (R.FAILED, C.NOT_LINKED)


async def test_disk_below_the_floor_skips_without_asking_the_server(tmp_path: Path) -> None:
    server, saver, registry = make(tmp_path, min_free_bytes=1 << 62)
    record = await save(saver)
    assert (record.result, record.cause) == (R.SKIPPED, C.LOW_DISK)
    assert "save" not in server.names()
    assert counted(registry, R.SKIPPED) == 1


def test_every_cause_maps_to_one_result() -> None:
    assert set(outcomes.SaveCause) > outcomes.SKIP_CAUSES
    assert metrics.SNAPSHOT_RESULTS == ("ok", "failed", "skipped")


@pytest.mark.parametrize(
    ("reason", "others_busy", "waits"),
    [
        (policy.SaveReason.IDLE, True, True),
        (policy.SaveReason.PERIODIC, True, True),
        (policy.SaveReason.IDLE, False, False),
        (policy.SaveReason.SWAP, True, False),
        (policy.SaveReason.MANUAL, True, False),
        (policy.SaveReason.FINAL, True, False),
    ],
)
async def test_a_background_save_leaves_its_commit_for_later_while_other_slots_generate(
    tmp_path: Path, hash_pauses: list[float], reason: policy.SaveReason, others_busy: bool, waits: bool
) -> None:
    _, saver, registry = make(tmp_path)
    action = dataclasses.replace(SAVE, reason=reason)
    outcome = await saver.save(action, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX, others_busy=others_busy)
    pending = registry.get_sample_value("llama_sidecar_snapshot_commits_pending")
    if waits:
        assert isinstance(outcome, snapshotter.Written)
        assert list(saver.pending) == [outcome]
        assert [p.name for p in tmp_path.iterdir()] == [outcome.temp]  # no manifest: nobody restores it
        assert (hash_pauses, counted(registry, R.OK), pending) == ([], 0, 1)
    else:
        assert isinstance(outcome, records.SaveRecord)
        assert (outcome.result, hash_pauses, counted(registry, R.OK), pending) == (R.OK, [0.0], 1, 0)


async def wait_commit(saver: snapshotter.Snapshotter, action: policy.Save = SAVE) -> snapshotter.Written:
    """A background save made while another slot generates: its commit waits."""
    written = await saver.save(action, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX, others_busy=True)
    assert isinstance(written, snapshotter.Written)
    return written


async def test_commits_keep_the_order_of_the_saves_and_date_each_snapshot_by_its_save(tmp_path: Path) -> None:
    """A save committed at once commits the waiting ones first: the older content never ranks newer."""
    clock = clocks.FakeClock()
    ended: list[tuple[snapshotter.Written, records.SaveRecord]] = []
    server, saver, registry = make(tmp_path, clock=clock, ended=ended)
    older = await wait_commit(saver)
    clock.now += 30.0
    server.set_slot(0, task=5, tokens=600)
    newer = await saver.save(
        policy.Save(0, events.SlotContent(5, 600), 600, policy.SaveReason.MANUAL),
        identity=memllama.IDENTITY,
        slot_n_ctx=memllama.N_CTX,
    )
    assert isinstance(newer, records.SaveRecord)
    assert [(w, r.result) for w, r in ended] == [(older, R.OK)]
    newest_first = committed(tmp_path, 0)
    assert [(m.task, m.tokens) for m in newest_first] == [(5, 600), (4, 500)]
    assert [m.created for m in newest_first] == [1_764_000_130.0, 1_764_000_100.0]
    assert newest_first[0].generation > newest_first[1].generation
    assert (counted(registry, R.OK), saver.pending) == (2, collections.deque())


async def test_a_commit_waits_for_quiet_or_for_commit_wait_then_only_the_overdue_ones(tmp_path: Path) -> None:
    clock = clocks.FakeClock()
    server, saver, _ = make(tmp_path, clock=clock)
    assert saver.commit_due(quiet=True) is None  # nothing waits
    first = await wait_commit(saver)
    clock.now += snapshotter.COMMIT_WAIT / 2
    server.set_slot(0, task=5, tokens=600)
    second = await wait_commit(saver, policy.Save(0, events.SlotContent(5, 600), 600, policy.SaveReason.IDLE))
    assert saver.commit_due(quiet=True) == second.written_at  # no slot processing: all of them
    assert saver.commit_due(quiet=False) is None  # slots generate: none has waited long enough
    clock.now += snapshotter.COMMIT_WAIT / 2
    due = saver.commit_due(quiet=False)
    assert due is not None
    await saver.commit_pending(written_before=due)
    assert list(saver.pending) == [second]
    assert [m.tokens for m in committed(tmp_path, 0)] == [first.result.tokens]


async def test_a_waiting_commit_that_fails_is_reported_to_the_caller(tmp_path: Path) -> None:
    ended: list[tuple[snapshotter.Written, records.SaveRecord]] = []
    _, saver, registry = make(tmp_path, ended=ended)
    written = await wait_commit(saver)
    with (tmp_path / written.temp).open("ab") as f:
        f.write(b"x")  # the file changed since the server wrote it
    await saver.commit_pending()
    assert [(w, r.result, r.cause) for w, r in ended] == [(written, R.FAILED, C.CHECK)]
    assert (counted(registry, R.FAILED), registry.get_sample_value("llama_sidecar_snapshot_commits_pending")) == (1, 0)
    assert [p.name for p in tmp_path.iterdir()] == []


async def test_a_full_disk_whose_space_never_grows_past_its_baseline_is_tried_again_after_a_doubling_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free space read after the refused commit is the baseline; a disk that was full only for a moment
    is back before that read, so the free space never grows past it. Saves used to stay skipped until
    retention freed 8 MiB; now one is tried again after storefault.backoff."""
    clock = clocks.FakeClock()
    server, saver, registry = make(tmp_path, clock=clock)
    refusals = 0

    def refuse(*_args: object, **_kwargs: object) -> manifest.Manifest:
        nonlocal refusals
        refusals += 1
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise errors.SnapshotError("committing failed", reason=outcomes.SnapshotProblem.IO) from exc

    monkeypatch.setattr(saver._snapshots.writer, "commit", refuse)

    def saves_called() -> int:
        return server.names().count("save")

    assert (await save(saver)).cause is C.STORE_UNWRITABLE
    assert (refusals, saves_called()) == (1, 1)
    clock.advance(storefault.RETRY_FIRST - 1)
    assert (await save(saver)).result is R.SKIPPED
    assert saves_called() == 1, "skipped without asking llama-server to save"
    clock.advance(1)
    await save(saver)
    assert (refusals, saves_called()) == (2, 2), "tried again once the wait passed"
    clock.advance(storefault.RETRY_FIRST)
    assert (await save(saver)).result is R.SKIPPED
    assert saves_called() == 2, "the wait doubled after a failed retry"
    clock.advance(storefault.RETRY_FIRST)
    monkeypatch.undo()
    assert (await save(saver)).result is R.OK
    assert registry.get_sample_value("llama_sidecar_snapshot_write_errors_total", {"reason": "no_space"}) == 2
