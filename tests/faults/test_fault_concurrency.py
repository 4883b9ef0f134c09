"""Saves slower than the poll interval: never more than one save in flight.

A save stalls every slot of llama-server, so the sidecar must never have
two in flight, whoever asked for them (the policy, an admin, the slot-dir
probe). The fake counts the saves it is serving at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path

import pytest

from tests.support.fakellama import FakeLlama, MakeFake, SaveFault, SaveKind
from tests.support.faultbed import make_settings, run_sidecar
from tests.support.wait import eventually, until

ADMIN = "admin-token-for-tests"


async def _keep_changing(fake: FakeLlama, every: float) -> None:
    for n in itertools.count():
        fake.use(n % len(fake.slots), 100 + n)
        await asyncio.sleep(every)


@pytest.mark.timeout(30)
async def test_slow_saves_never_overlap(make_fake: MakeFake, slot_dir: Path) -> None:
    fake = make_fake(n_slots=3)
    fake.save_fault = SaveFault(SaveKind.SLOW, delay=0.3)
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN)) as car:
        changer = asyncio.create_task(_keep_changing(fake, 0.03))
        try:
            await until(lambda: len(fake.saves) >= 6, timeout=10, what="six saves")
        finally:
            changer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await changer
        assert car.alive()
        assert fake.max_saves_in_flight == 1
        assert (
            await car.metric("snapshots_total", result="ok", slot="0")
            + await car.metric("snapshots_total", result="ok", slot="1")
            + await car.metric("snapshots_total", result="ok", slot="2")
            >= 3
        )


@pytest.mark.timeout(30)
async def test_admin_snapshot_waits_for_a_policy_save(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    fake.use(1, 300)
    fake.save_fault = SaveFault(SaveKind.SLOW, delay=0.5)
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN)) as car:
        await until(lambda: fake.saves_in_flight == 1, what="a policy save in flight")
        code, body = await car.request("POST", "/snapshot?slot=1", headers={"Authorization": f"Bearer {ADMIN}"})
        assert code == 200, body
        assert fake.max_saves_in_flight == 1


@pytest.mark.timeout(30)
async def test_admin_snapshot_during_slot_dir_probe(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)  # slot 1 stays empty: the probe goes there
    fake.save_fault = SaveFault(SaveKind.SLOW, delay=0.5)
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN, min_tokens=100_000)) as car:
        await until(lambda: fake.saves_in_flight == 1, what="the probe save in flight")
        assert fake.saves[0].filename.startswith(".probe-")
        code, body = await car.request("POST", "/snapshot?slot=0", headers={"Authorization": f"Bearer {ADMIN}"})
        assert code == 200, body
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the admin snapshot")
        assert fake.max_saves_in_flight == 1
