"""A llama-server that accepts connections and never answers.

Every poll must give up within ``request_timeout``, the sidecar's own
/healthz must keep answering, and ~20 hung polls must not pile up asyncio
tasks or sockets. When the server answers again with the same
``Process-Start-Time-Unix``, it is the same process: up again, no restart.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from sidecar.core import config, errors
from sidecar.observe import upstream
from tests.support.fakellama import FakeLlama, Reply
from tests.support.faultbed import Sidecar, make_settings, open_sockets, run_sidecar
from tests.support.wait import eventually, until

TIMEOUT = 0.5
SLACK = 0.6
"""Scheduling slack on a loaded 2-core machine, in seconds."""


async def _healthz(car: Sidecar) -> float:
    started = time.monotonic()
    code, body = await car.get("/healthz")
    assert code == 200, body
    return time.monotonic() - started


@pytest.mark.timeout(45)
async def test_hung_server_times_out_without_leaking(fake: FakeLlama, slot_dir: Path) -> None:
    # Every slot empty: were the unchanged start time ignored, "came back with every slot
    # empty after being unreachable" would be taken for a restart.
    settings = make_settings(fake.url, slot_dir, request_timeout=TIMEOUT)
    async with run_sidecar(settings) as car:
        await eventually(lambda: car.metric("server_up"), what="server_up 1")
        await eventually(
            lambda: _linked(car), what="the slot-dir probe to finish (no save in flight when the server hangs)"
        )

        fake.replies["*"] = Reply.hang()
        await eventually(lambda: _is_zero(car, "server_up"), timeout=3, what="server_up 0")
        first = len(fake.requests("/health"))
        await until(lambda: len(fake.requests("/health")) >= first + 3, what="hung polls")
        await _healthz(car)  # the test's keep-alive connection exists before counting
        tasks_before, sockets_before = len(asyncio.all_tasks()), open_sockets()

        start = len(fake.requests("/health"))
        slowest = 0.0
        while len(fake.requests("/health")) < start + 20:
            slowest = max(slowest, await _healthz(car))
            await asyncio.sleep(0.1)
        tasks_after, sockets_after = len(asyncio.all_tasks()), open_sockets()

        hung = [s for s in fake.requests("/health")[first:] if s.end is not None]
        assert len(hung) >= 20
        assert all(s.hung_up for s in hung), "the fake answered a request it should have hung"
        longest = max(s.seconds or 0.0 for s in hung)
        assert longest <= TIMEOUT + SLACK, f"a poll waited {longest:.2f} s, request_timeout is {TIMEOUT}"
        assert slowest < 1.0, f"/healthz took {slowest:.2f} s while llama-server hung"
        assert tasks_after <= tasks_before + 1, (tasks_before, tasks_after, asyncio.all_tasks())
        assert sockets_after <= sockets_before + 2, (sockets_before, sockets_after)
        assert await car.metric("server_up") == 0
        assert car.alive()

        fake.replies.clear()
        await eventually(lambda: car.metric("server_up"), timeout=3, what="server_up back to 1")
        polled = len(fake.requests("/metrics"))
        await until(lambda: len(fake.requests("/metrics")) >= polled + 3, what="polls with counters read after")
        assert await car.metric("server_restarts_total") == 0
        assert not car.events("server_restarted")

        # Control: the same sequence with a new start time is a restart.
        fake.replies["*"] = Reply.hang()
        await eventually(lambda: _is_zero(car, "server_up"), timeout=3, what="server_up 0 again")
        fake.restart()
        fake.replies.clear()
        await eventually(lambda: car.metric("server_restarts_total"), timeout=3, what="the restart to be counted")
        assert car.alive()


async def _linked(car: Sidecar) -> bool:
    return (await car.status())["server"]["slot_dir_linked"] is True


async def _is_zero(car: Sidecar, name: str) -> bool:
    return await car.metric(name) == 0


@pytest.mark.timeout(15)
async def test_timeout_is_reported_with_its_duration(fake: FakeLlama) -> None:
    fake.replies["*"] = Reply.hang()
    async with aiohttp.ClientSession() as session:
        client = upstream.LlamaClient(session, config.UpstreamSettings(url=fake.url, request_timeout=TIMEOUT))
        started = time.monotonic()
        with pytest.raises(errors.UpstreamUnavailable) as info:
            await client.slots()
        assert time.monotonic() - started <= TIMEOUT + SLACK
    assert info.value.endpoint == "/slots"
    assert f"no answer within {TIMEOUT} s" in str(info.value)
