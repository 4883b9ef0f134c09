"""/healthz sees a stuck poll loop, and only a stuck one.

Every call to llama-server has a timeout, so the loop can only be stuck on
something without one: here a commit whose disk never answers (a hung
network filesystem), held by a gate the test opens. A save that is merely
slow, within --action-timeout, must not count as stuck: a liveness probe
would restart the sidecar in the middle of it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sidecar.core import config
from sidecar.engine import report
from sidecar.snapshots import writer
from tests.support.fakellama import FakeLlama, SaveFault, SaveKind
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.wait import eventually, until

REQUEST_TIMEOUT = 0.2
INTERVAL = 0.05


def _settings(fake: FakeLlama, slot_dir: Path, action_timeout: float) -> config.Settings:
    return make_settings(
        fake.url,
        slot_dir,
        interval=INTERVAL,
        down_interval=INTERVAL,
        request_timeout=REQUEST_TIMEOUT,
        action_timeout=action_timeout,
    )


async def _healthz(car: Sidecar) -> tuple[int, dict[str, Any]]:
    code, body = await car.get("/healthz")
    return code, json.loads(body)


async def _linked(car: Sidecar) -> bool:
    return (await car.status())["server"]["slot_dir_linked"] is True


@pytest.mark.timeout(40)
async def test_a_slow_save_within_its_timeout_is_not_a_stuck_loop(fake: FakeLlama, slot_dir: Path) -> None:
    settings = _settings(fake, slot_dir, action_timeout=6.0)
    idle_bound = report.Liveness.of(settings).poll_seconds
    async with run_sidecar(settings) as car:
        await eventually(lambda: _linked(car), what="the slot-dir probe")
        fake.save_fault = SaveFault(SaveKind.SLOW, slot=0, delay=idle_bound + 1.5)
        fake.use(0, 300)
        await until(lambda: fake.saves_in_flight == 1, what="the slow save to start")
        started = time.monotonic()
        longest = 0.0
        while fake.saves_in_flight:
            code, body = await _healthz(car)
            assert code == 200, body
            longest = time.monotonic() - started
            await asyncio.sleep(0.1)
        assert longest > idle_bound, f"the save ended after {longest:.1f} s, before the idle bound {idle_bound} s"
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the slow save to commit")
        assert (await _healthz(car))[0] == 200


@pytest.mark.timeout(60)
async def test_a_loop_stuck_on_a_hung_disk_is_reported_by_healthz(
    fake: FakeLlama, slot_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    commit = writer.Writer.commit

    def hung_commit(self: writer.Writer, *args: Any, **kwargs: Any) -> Any:
        gate.wait(60)  # a disk that does not answer, until the test opens the gate
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(writer.Writer, "commit", hung_commit)
    settings = _settings(fake, slot_dir, action_timeout=1.0)
    bound = report.Liveness.of(settings)
    async with run_sidecar(settings) as car:
        try:
            await eventually(lambda: _linked(car), what="the slot-dir probe")
            assert (await _healthz(car))[0] == 200
            fake.use(0, 300)
            await until(lambda: fake.saves, what="the save whose commit hangs")
            stuck_at = time.monotonic()

            async def unhealthy() -> dict[str, Any] | None:
                code, body = await _healthz(car)
                return body if code == 503 else None

            body = await eventually(unhealthy, timeout=20, what="/healthz 503")
            assert body is not None
            waited = time.monotonic() - stuck_at
            # An action runs: the bound adds an action timeout per slot to the idle one (exact figures
            # in tests/unit/test_report.py); `waited` can only be short of the loop's quiet time.
            assert waited > bound.poll_seconds + 1.0, f"/healthz failed {waited:.1f} s into the hang"
            print(f"stuck loop reported {waited:.1f} s into the hang (idle bound {bound.poll_seconds:.2f} s)")
            assert body["status"] == "stuck"
            assert "has finished no poll" in body["problem"]
            assert "restart the sidecar" in body["problem"]
            code, ready = await car.get("/readyz")
            assert code == 503
            assert "has finished no poll" in ready
        finally:
            gate.set()
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the commit once unstuck")
        code, body = await _healthz(car)
        assert code == 200, body
