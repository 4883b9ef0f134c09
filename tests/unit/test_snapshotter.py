"""snapshotter.Snapshotter against the in-memory server: each way a save ends, as a result and a cause."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import memllama
import pytest
from prometheus_client import CollectorRegistry

from sidecar import actions, config, errors, hashing, metrics, outcomes, policy, protocols, snapshotter, store

R, C = outcomes.SaveResult, outcomes.SaveCause
SAVE = policy.Save(0, (4, 500), 500, policy.SaveReason.IDLE)


def make(
    tmp_path: Path, *, min_free_bytes: int = 0, server_dir: Path | None = None
) -> tuple[memllama.MemLlama, snapshotter.Snapshotter, CollectorRegistry]:
    server = memllama.MemLlama(server_dir or tmp_path)
    server.set_slot(0, task=4, tokens=500)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(tmp_path, clock=lambda: float(next(stamps)))
    registry = CollectorRegistry()
    saver = snapshotter.Snapshotter(
        slot_actions=actions.SlotActions(client=server, snapshots=snapshots),
        snapshots=snapshots,
        stats=metrics.Metrics(registry, version="t"),
        settings=config.SnapshotSettings(slot_dir=tmp_path, min_free_bytes=min_free_bytes),
        clock=memllama.ManualClock(),
    )
    return server, saver, registry


async def save(saver: snapshotter.Snapshotter) -> snapshotter.SaveRecord:
    return await saver.save(SAVE, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX)


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


async def test_a_file_that_does_not_match_the_servers_size_fails_its_check(tmp_path: Path) -> None:
    server, saver, _ = make(tmp_path)
    real_save = server.save

    async def short_write(slot: int, filename: str) -> protocols.ActionResult:
        result = await real_save(slot, filename)
        path = server.dir / filename
        path.write_bytes(path.read_bytes()[: result.bytes // 2])
        return result

    server.save = short_write  # type: ignore[method-assign,assignment]
    record = await save(saver)
    assert (record.result, record.cause) == (R.FAILED, C.CHECK)
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
    ("reason", "others_busy", "pause"),
    [
        (policy.SaveReason.IDLE, True, hashing.PACE),
        (policy.SaveReason.PERIODIC, True, hashing.PACE),
        (policy.SaveReason.IDLE, False, 0.0),
        (policy.SaveReason.SWAP, True, 0.0),
        (policy.SaveReason.MANUAL, True, 0.0),
        (policy.SaveReason.FINAL, True, 0.0),
    ],
)
async def test_a_background_save_paces_its_hash_while_other_slots_generate(
    tmp_path: Path, hash_pauses: list[float], reason: policy.SaveReason, others_busy: bool, pause: float
) -> None:
    _, saver, _ = make(tmp_path)
    action = dataclasses.replace(SAVE, reason=reason)
    record = await saver.save(action, identity=memllama.IDENTITY, slot_n_ctx=memllama.N_CTX, others_busy=others_busy)
    assert record.result == R.OK
    assert hash_pauses == [pause]
