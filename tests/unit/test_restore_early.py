"""A restore round's order and the requests it lets through early (restore.early, engine.gate), without any network."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import hashing, metrics
from sidecar.engine import gate
from sidecar.restore import early
from sidecar.snapshots import manifest

SHORT = 0.05
"""Seconds in which something that must not happen would have happened."""
FP = manifest.Fingerprint("b1", "/m.gguf", 1, 1, 4096, 4)


def _file(slot: int) -> str:
    return f"slot{slot}.bin"


SNAPS = tuple(
    manifest.Manifest(
        slot=n,
        file=_file(n),
        tokens=500,
        bytes=100,
        checksum=manifest.Checksum(hashing.Algorithm.SHA256, "0" * 64),
        generation=n + 1,
        created=float(n),
        task=1,
        fingerprint=FP,
    )
    for n in range(4)
)
"""Each slot's one snapshot: a request wanting slot N's content names ``slotN.bin``."""


async def _next(g: gate.Gate, pending: tuple[int, ...]) -> int:
    """The slot the round restores next (each slot's own snapshot)."""
    step = await g.next_step(pending, lambda: SNAPS)
    assert step.candidates[:1] == tuple(s for s in SNAPS if s.slot == step.slot)
    return step.slot


def _restored(g: gate.Gate, slot: int) -> None:
    g.restored(slot, _file(slot))


def _gate() -> tuple[gate.Gate, metrics.Metrics]:
    g = gate.Gate()
    g.close("a restore round is owed", serving=True)
    return g, metrics.Metrics(CollectorRegistry(), version="t")


def _wanting(slot: int | None) -> tuple[asyncio.Event, Callable[[], Awaitable[str | None]]]:
    """Work that names ``slot``'s snapshot once its event is set (the ids read)."""
    read = asyncio.Event()

    async def work() -> str | None:
        await read.wait()
        return None if slot is None else _file(slot)

    return read, work


async def _preparing(g: gate.Gate, n: int = 1) -> None:
    """Until ``n`` held requests have started their work meanwhile."""
    async with asyncio.timeout(5.0):
        while g.prepared < n:
            await asyncio.sleep(0)


async def _not_within(task: asyncio.Future[Any], seconds: float = SHORT) -> bool:
    """Whether ``task`` is still not done after ``seconds``."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return not done


async def _restored_for(g: gate.Gate, hold: gate.Hold, slot: int, pending: tuple[int, ...]) -> asyncio.Future[bool]:
    """Hold a request that names ``slot`` at once, have the round pick and restore it; the request's wait,
    not yet awaited (it goes on a few steps later)."""
    read, work = _wanting(slot)
    read.set()
    waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
    await _preparing(g)
    assert await _next(g, pending) == slot
    _restored(g, slot)
    return waiter


async def _let_through(g: gate.Gate, hold: gate.Hold, slot: int, pending: tuple[int, ...]) -> None:
    """Hold a request that names ``slot`` at once, have the round pick and restore it: the request goes on."""
    assert await (await _restored_for(g, hold, slot, pending))


async def test_the_round_restores_first_the_slot_a_held_request_names_once_its_ids_are_read() -> None:
    g, stats = _gate()
    read, work = _wanting(2)
    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        picking = asyncio.ensure_future(_next(g, (0, 1, 2, 3)))
        assert await _not_within(picking)  # a held request is still reading its ids: its want may come
        read.set()
        assert await picking == 2
        assert await _not_within(waiter)  # its slot is not restored yet
        _restored(g, 0)
        assert await _not_within(waiter)  # another slot's restore does not let it through
        _restored(g, 2)
        assert await waiter  # through before the round ends
        assert not g.is_open
        assert hold.early is not None
        assert hold.early.ready == {0, 2}
        assert g.lets(hold)


async def test_a_request_that_waited_through_the_load_is_waited_for_even_by_a_round_that_picks_at_once() -> None:
    g = gate.Gate()
    stats = metrics.Metrics(CollectorRegistry(), version="t")
    g.close("llama-server is loading")
    read, work = _wanting(1)
    read.set()
    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        async with asyncio.timeout(5.0):
            while g.waiting < 1:
                await asyncio.sleep(0)
        g.close("a restore round is owed", serving=True)
        assert await _next(g, (0, 1)) == 1  # picked before the request even woke up to read its ids
        _restored(g, 1)
        assert await waiter


async def test_the_round_does_not_wait_longer_than_want_seconds_for_ids_still_being_read() -> None:
    g, stats = _gate()
    _, work = _wanting(3)  # never read
    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        await asyncio.sleep(0)
        async with asyncio.timeout(early.WANT_SECONDS + 1.0):
            assert await _next(g, (0, 1)) == 0  # after WANT_SECONDS: in slot order
        waiter.cancel()


async def test_the_rest_of_the_round_waits_while_a_request_let_through_early_runs_and_none_waits() -> None:
    g, stats = _gate()
    with g.hold(stats) as hold:
        await _let_through(g, hold, 1, (0, 1))
        picking = asyncio.ensure_future(_next(g, (0,)))
        assert await _not_within(picking)  # a restore now would land beside the request's own task
        hold.leave_early()  # the request ended
        assert await picking == 0
    assert hold.early is None


async def test_the_round_picks_no_other_slot_between_a_requests_restore_and_the_request_going_on() -> None:
    g, stats = _gate()
    with g.hold(stats) as hold:
        waiter = await _restored_for(g, hold, 1, (0, 1))
        picking = asyncio.ensure_future(_next(g, (0,)))  # at once, as the restore round asks
        assert await _not_within(picking)  # slot 0's restore would land beside the request's first task
        assert await waiter
        assert hold.early is not None
        assert await _not_within(picking)  # the request runs now
        hold.leave_early()
        assert await picking == 0


async def test_a_request_whose_slot_was_restored_stops_holding_the_round_once_it_is_cancelled() -> None:
    g, stats = _gate()
    with g.hold(stats) as hold:
        waiter = await _restored_for(g, hold, 1, (0, 1))
        waiter.cancel()  # the client went away before its request went on
        async with asyncio.timeout(early.QUIET_SECONDS / 2):  # not held for the whole quiet time
            assert await _next(g, (0,)) == 0


async def test_a_request_waiting_at_the_gate_for_the_whole_round_keeps_the_round_going() -> None:
    g, stats = _gate()
    with g.hold(stats) as first, g.hold(stats) as second:
        await _let_through(g, first, 1, (0, 1))
        waits = asyncio.ensure_future(second.wait(5.0))  # names no slot: it waits for the whole round
        await asyncio.sleep(0)
        async with asyncio.timeout(SHORT):
            assert await _next(g, (0,)) == 0
        g.open(seen_at=float("inf"))
        assert await waits


async def test_the_rest_of_the_round_goes_on_quiet_seconds_after_the_first_early_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(early, "QUIET_SECONDS", 0.2)
    g, stats = _gate()
    with g.hold(stats) as hold:
        await _let_through(g, hold, 1, (0, 1))
        async with asyncio.timeout(1.0):
            assert await _next(g, (0,)) == 0  # the request still runs: the round goes on beside it


async def test_a_crash_during_the_round_stops_a_request_let_through_early() -> None:
    g, stats = _gate()
    with g.hold(stats) as hold:
        await _let_through(g, hold, 0, (0,))
        assert g.lets(hold)
        g.suspect("the proxy could not connect to llama-server")
        assert not g.lets(hold)  # the new process's round must run first
        g.close("a restore round is owed", serving=True)
        assert not g.lets(hold)  # a round of its own, not the one that let it through


async def test_a_request_that_names_no_slot_waits_for_the_whole_round() -> None:
    g, stats = _gate()
    read, work = _wanting(None)
    read.set()
    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        _restored(g, 0)
        _restored(g, 1)
        assert await _not_within(waiter)
        g.open(seen_at=float("inf"))
        assert await waiter
        assert hold.early is None


async def test_a_held_request_whose_conversation_is_no_slots_newest_has_it_restored_first_into_its_slot() -> None:
    older = dataclasses.replace(SNAPS[1], file="older1.bin", generation=0)  # slot 1's older conversation
    snaps = (*SNAPS[:2], older)
    g, stats = _gate()
    read = asyncio.Event()

    async def work() -> str | None:
        await read.wait()
        return older.file

    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        picking = asyncio.ensure_future(g.next_step((0, 1), lambda: snaps))
        assert await _not_within(picking)
        read.set()
        step = await picking
        assert (step.slot, step.candidates[0].file, step.wanted) == (1, "older1.bin", "older1.bin")
        g.restored(1, SNAPS[1].file)
        assert await _not_within(waiter)  # the slot's newest is not what it waits for
        g.restored(1, older.file)
        assert await waiter
        hold.leave_early()
        rest = await g.next_step((0,), lambda: snaps)
        assert (rest.slot, rest.candidates[0].file, rest.wanted) == (0, SNAPS[0].file, None)


async def test_a_wanted_snapshot_that_did_not_land_is_not_planned_again_into_another_slot() -> None:
    g, stats = _gate()
    read, work = _wanting(0)
    read.set()
    with g.hold(stats) as hold:
        waiter = asyncio.ensure_future(hold.wait(5.0, meanwhile=work))
        await _preparing(g)
        first = await g.next_step((0, 1), lambda: SNAPS)
        assert (first.slot, first.wanted) == (0, _file(0))
        # slot0.bin failed its check: the round restored nothing there and goes on with slot 1, its own
        step = await g.next_step((1,), lambda: SNAPS)
        assert (step.slot, step.wanted, step.candidates[0].file) == (1, None, _file(1))
        waiter.cancel()
