"""The restore gate as the engine drives it: the whole sidecar with its proxy, in front of the fake server.

The fake can hold a restore call open and report "loading" on demand,
which the real llama-server cannot: these tests see a request wait at the
gate for exactly as long as the restore round or the load lasts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import aiohttp
import pytest

from sidecar.core import config
from tests.support.fakellama import FakeLlama, Reply
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.wait import eventually


def _settings(fake: FakeLlama, slot_dir: Path) -> config.Settings:
    settings = make_settings(fake.url, slot_dir)
    return dataclasses.replace(settings, proxy=config.ProxySettings(host="127.0.0.1", port=0, hold_seconds=30.0))


def _proxy_url(car: Sidecar) -> str:
    port = next(int(e["port"]) for e in car.logs if e.get("event") == "proxy_listening")
    return f"http://127.0.0.1:{port}"


async def _complete(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.post(url + "/completion", json={"prompt": "x"}) as resp:
        await resp.read()
        return resp.status


async def _readyz(car: Sidecar) -> tuple[int, list[str]]:
    code, body = await car.get("/readyz")
    return code, json.loads(body)["problems"]


@pytest.mark.timeout(40)
async def test_completion_waits_for_the_restore_round_and_readyz_says_why(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    fake.replies["/completion"] = Reply.json({"content": "ok", "timings": {"cache_n": 299}})
    async with run_sidecar(_settings(fake, slot_dir)) as car:
        proxy = _proxy_url(car)
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="a snapshot of slot 0")
        assert (await _readyz(car))[0] == 200
        assert await _complete(proxy) == 200

        fake.replies["restore"] = Reply.hang()  # the restore round runs until the call times out (5 s)
        fake.restart()

        async def gate_closed_for_restore() -> bool:
            code, problems = await _readyz(car)
            return code == 503 and any("restore gate closed: a restore round" in p for p in problems)

        await eventually(gate_closed_for_restore, what="/readyz naming the owed restore round")
        request = asyncio.create_task(_complete(proxy))
        await eventually(lambda: car.metric("proxy_held_requests"), what="the completion held at the gate")
        completions = len(fake.requests("/completion"))
        del fake.replies["restore"]
        assert await request == 200
        restore = fake.requests("restore")[0]
        assert restore.end is not None
        held = fake.requests("/completion")[completions]
        assert held.start >= restore.end, "the completion reached the server before the restore round ended"
        await eventually(lambda: car.metric("proxy_hold_seconds_count"), what="the hold observed")
        assert await car.metric("proxy_requests_total", route="completion", outcome="ok") == 2
        code, _ = await _readyz(car)
        assert code == 200


@pytest.mark.timeout(30)
async def test_completion_waits_while_the_server_loads_other_routes_do_not(fake: FakeLlama, slot_dir: Path) -> None:
    fake.replies["/completion"] = Reply.json({"content": "ok"})
    fake.replies["/tokenize"] = Reply.json({"tokens": [1, 2]})
    async with run_sidecar(_settings(fake, slot_dir)) as car:
        proxy = _proxy_url(car)
        await eventually(lambda: car.metric("server_up"), what="server up")
        await eventually(lambda: _is_ready(car), what="/readyz 200")
        fake.loading = True

        async def says_loading() -> bool:
            code, problems = await _readyz(car)
            return code == 503 and "restore gate closed: llama-server is loading" in problems

        await eventually(says_loading, what="/readyz naming the load")
        request = asyncio.create_task(_complete(proxy))
        await eventually(lambda: car.metric("proxy_held_requests"), what="the completion held at the gate")
        async with aiohttp.ClientSession() as session, session.post(proxy + "/tokenize", json={}) as resp:
            assert resp.status == 200, "a route that runs no slot task does not wait"
        assert not fake.requests("/completion")
        fake.loading = False
        assert await request == 200
        assert len(fake.requests("/completion")) == 1


async def _is_ready(car: Sidecar) -> bool:
    return (await _readyz(car))[0] == 200


@pytest.mark.timeout(40)
async def test_a_restart_between_two_polls_holds_the_next_completion_until_the_restore(
    fake: FakeLlama, slot_dir: Path
) -> None:
    """The server restarts (every connection dropped, a new process on the port) with no request in flight
    and the next poll 30 s away: the completion that follows still waits for the restore round."""
    fake.use(0, 300)
    fake.replies["/completion"] = Reply.json({"content": "ok", "timings": {"cache_n": 299}})
    settings = dataclasses.replace(
        _settings(fake, slot_dir), poll=config.PollSettings(interval=30.0, down_interval=0.05)
    )
    async with run_sidecar(settings) as car:
        proxy = _proxy_url(car)
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="a snapshot of slot 0")
        await eventually(lambda: _is_ready(car), what="the gate open")
        polls = len(fake.requests("/props"))
        fake.respawn()
        assert fake.requests("restore") == []
        assert await _complete(proxy) == 200
        restores = fake.requests("restore")
        assert restores, "the completion reached the new process and no restore round ran before it"
        assert restores[0].end is not None
        completion = fake.requests("/completion")[-1]
        assert completion.start >= restores[0].end, "the completion reached the server before the restore ended"
        assert len(fake.requests("/props")) > polls, "no poll saw the new process"
        events = [e for e in car.logs if e.get("event") == "server_connection_dropped"]
        assert events, "the sentinel's drop was not logged"
