"""A llama-server that refuses the sidecar's key: not ready, said once, counted; and back when it accepts it.

llama-server with ``--api-key`` answers /health to anyone and 401 to every
other call without one of its keys. The sidecar then sees a healthy server
whose slots it cannot read: it must not call itself ready, must say why in
one log line (not one per poll) and must show it in a metric for alerts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.fakellama import MakeFake
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.wait import eventually, until

RIGHT = "sk-right-5e1dcar"
WRONG = "sk-wrong-5e1dcar"


async def _readyz(car: Sidecar) -> tuple[int, dict[str, object]]:
    code, body = await car.get("/readyz")
    return code, json.loads(body)


async def _refused(car: Sidecar) -> str:
    """The problems /readyz lists once it names the refusal; empty before."""
    code, body = await _readyz(car)
    problems = " ".join(str(p) for p in body["problems"])  # type: ignore[attr-defined]
    return problems if code == 503 and "refuses the sidecar" in problems else ""


async def _ready(car: Sidecar) -> bool:
    return (await _readyz(car))[0] == 200


@pytest.mark.timeout(40)
async def test_a_refused_key_is_not_ready_said_once_and_counted(make_fake: MakeFake, slot_dir: Path) -> None:
    fake = make_fake(api_key=RIGHT)
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir, api_key=WRONG)) as car:
        problems = await eventually(lambda: _refused(car), what="/readyz 503 naming the refusal")
        assert "HTTP 401" in problems
        assert "Invalid API Key" in problems
        assert "--api-key-file" in problems
        assert await car.metric("server_readable") == 0
        assert await car.metric("server_up") == 1
        status = await car.status()
        assert status["server"]["denied"], status["server"]

        # Many refused polls later: one error line, no warning per poll.
        seen = len(fake.requests("/props"))
        await until(lambda: len(fake.requests("/props")) >= seen + 20, what="20 more refused polls")
        refusals = car.events("server_refuses_sidecar")
        assert len(refusals) == 1, refusals
        assert refusals[0]["log_level"] == "error"
        assert "LLAMA_API_KEY_FILE" in refusals[0]["hint"]
        noisy = [
            e for e in car.logs if e.get("event") in ("props_unreadable", "metrics_unreadable", "slots_unreadable")
        ]
        assert noisy == []
        assert not list(slot_dir.glob("slot0-*.json")), "a snapshot without reading the slots?"

        # The server accepts the sidecar's key from now on (a key rotation finished).
        fake.api_key = WRONG
        await eventually(lambda: _ready(car), what="/readyz 200 once the key is accepted")
        assert await car.metric("server_readable") == 1
        await until(lambda: list(slot_dir.glob("slot0-*.json")), what="the slot saved once readable")
        assert len(car.events("server_readable")) == 1
        assert len(car.events("server_refuses_sidecar")) == 1
    assert {s.auth for s in fake.seen if s.endpoint != "/health"} == {f"Bearer {WRONG}"}
