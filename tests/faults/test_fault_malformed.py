"""Malformed, hostile, huge and slow replies on each llama-server endpoint.

The sidecar first takes a snapshot (it works), then one endpoint turns bad.
Required: the sidecar task stays alive, keeps polling, logs a line naming
the endpoint and the problem, and once the replies are good again it saves
the slot's new content.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from sidecar.core import protocols
from sidecar.snapshots import manifest, store
from tests.support.fakellama import FakeLlama, Reply
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.wait import eventually, until

MakeReply = Callable[[FakeLlama], Reply]


def _slots(change: Callable[[list[dict[str, Any]]], Any]) -> MakeReply:
    """A /slots reply: the fake's current one, changed by ``change`` (which may return a replacement)."""

    def make(fake: FakeLlama) -> Reply:
        body = fake.slots_body()
        replaced = change(body)
        return Reply.json(body if replaced is None else replaced)

    return make


def _props(change: Callable[[dict[str, Any]], None]) -> MakeReply:
    def make(fake: FakeLlama) -> Reply:
        body = {
            "default_generation_settings": {"n_ctx": fake.n_ctx},
            "total_slots": len(fake.slots),
            "model_path": "/models/x.gguf",
            "build_info": "b1",
        }
        change(body)
        return Reply.json(body)

    return make


def _set(index: int, key: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    def change(body: list[dict[str, Any]]) -> None:
        body[index][key] = value

    return change


def _drop(index: int, key: str) -> Callable[[list[dict[str, Any]]], None]:
    def change(body: list[dict[str, Any]]) -> None:
        del body[index][key]

    return change


def _const(reply: Reply) -> MakeReply:
    return lambda fake: reply


@dataclasses.dataclass(frozen=True)
class Case:
    endpoint: str
    reply: MakeReply
    event: str
    says: tuple[str, ...]
    """Words of the problem, one of which the log line must name (besides the endpoint)."""


def _case(endpoint: str, reply: MakeReply, event: str, *says: str, id: str) -> Any:
    return pytest.param(Case(endpoint, reply, event, says), id=id)


def _drip(fake: FakeLlama) -> Reply:
    return Reply.drip(fake.slots_body(), pause=0.1)


CASES = [
    _case("/slots", _const(Reply.raw('[{"id": 0, "n_ctx": 40')), "slots_unreadable", "JSON", id="slots-bad-json"),
    _case("/slots", _slots(lambda b: {"slots": b}), "slots_unreadable", "not return a list", id="slots-not-a-list"),
    _case("/slots", _slots(_drop(0, "id")), "slots_unreadable", "'id'", id="slots-missing-id"),
    _case("/slots", _slots(_drop(1, "n_ctx")), "slots_unreadable", "'n_ctx'", id="slots-missing-n_ctx"),
    _case("/slots", _slots(_set(0, "id_task", "101")), "slots_unreadable", "id_task", id="slots-id_task-string"),
    _case("/slots", _slots(_set(0, "n_prompt_tokens", -5)), "slots_unreadable", "-5", id="slots-negative-tokens"),
    _case("/slots", _slots(_set(1, "n_ctx", True)), "slots_unreadable", "'n_ctx'", id="slots-n_ctx-bool"),
    _case("/slots", _const(Reply.error(500)), "slots_unreadable", "HTTP 500", id="slots-500"),
    _case(
        "/slots",
        _slots(lambda b: [dict(b[0], id=i) for i in range(20_000)]),
        "slots_unreadable",
        "total_slots",
        id="slots-20000-not-announced",
    ),
    _case("/slots", _const(Reply.hang()), "slots_unreadable", "Timeout", "no answer", id="slots-hang"),
    _case("/slots", _const(Reply.huge()), "slots_unreadable", "more than", id="slots-20MB"),
    _case("/slots", _drip, "slots_unreadable", "Timeout", "no answer", id="slots-slow-drip"),
    _case("/props", _const(Reply.raw("<html>502 Bad Gateway</html>")), "props_unreadable", "JSON", id="props-html"),
    _case("/props", _props(lambda b: b.pop("model_path")), "props_unreadable", "'model_path'", id="props-missing"),
    _case("/props", _props(lambda b: b.update(total_slots="2")), "props_unreadable", "'total_slots'", id="props-str"),
    _case("/props", _const(Reply.json([1, 2])), "props_unreadable", "not return an object", id="props-list"),
    _case("/props", _const(Reply.error(500)), "props_unreadable", "HTTP 500", id="props-500"),
    _case(
        "/metrics",
        _const(Reply.raw("llamacpp:prompt_tokens_total abc\n")),
        "metrics_unreadable",
        "Prometheus",
        id="metrics-garbage",
    ),
    _case("/metrics", _const(Reply.error(500)), "metrics_unreadable", "HTTP 500", id="metrics-500"),
    _case("/metrics", _const(Reply.huge()), "metrics_unreadable", "more than", id="metrics-20MB"),
    _case("/health", _const(Reply.error(500)), "server_unreachable", "500", id="health-500"),
    _case(
        "/health",
        _const(Reply.hang()),
        "server_unreachable",
        "Timeout",
        "no answer",
        id="health-hang",
    ),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES)
async def test_malformed_reply(fake: FakeLlama, slot_dir: Path, case: Case) -> None:
    fake.use(0, 300)
    settings = make_settings(fake.url, slot_dir)
    async with run_sidecar(settings) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the first snapshot")
        logged = len(car.logs)
        asked = len(fake.requests(case.endpoint))

        fake.replies[case.endpoint] = case.reply(fake)
        fake.tick()  # activity in /metrics: the sidecar reads /slots again
        entry = await until(lambda: _first(car, case.event, logged), what=f"a {case.event} log line")
        assert entry is not None
        await until(lambda: len(fake.requests(case.endpoint)) >= asked + 3, what=f"polls of {case.endpoint}")
        assert car.alive(), "the sidecar task ended on a bad reply"
        code, _ = await car.get("/healthz")
        assert code == 200

        fake.replies.clear()
        fake.use(0, 500)
        await eventually(
            lambda: _saved_twice(car), timeout=5, what="a snapshot of the new content once replies are good again"
        )
        assert car.alive()
        status = await car.status()
        assert status["server"]["health"] == "ok"
        assert status["server"]["problem"] == ""
        assert [s["tokens"] for s in status["slots"]] == [500, 0]

        text = json.dumps(dict(entry))
        assert case.endpoint in text, f"the log line does not name {case.endpoint}: {text}"
        assert any(word in text for word in case.says), f"the log line says none of {case.says}: {text}"


@pytest.mark.timeout(30)
async def test_valid_big_slots_reply_is_read(fake: FakeLlama, slot_dir: Path) -> None:
    """A valid 256 KB /slots reply (long sampler params), sent in 16 KB pieces, is a normal reply."""
    fake.use(0, 300)
    body = fake.slots_body()
    for entry in body:
        entry["params"] = {"grammar": "root ::= " + " | ".join(f'"word{i}"' for i in range(20_000))[: 128 << 10]}
    fake.replies["/slots"] = Reply.chunked(body, chunk=16 << 10, pause=0.002)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the snapshot of slot 0")
        assert car.alive()
        problems = [e["error"] for e in car.events("slots_unreadable")]
        assert not problems, problems
        assert await car.metric("snapshots_total", slot="0", result="ok") == 1


@pytest.mark.timeout(30)
async def test_models_endpoint_failing_after_a_blip_is_not_a_restart(fake: FakeLlama, slot_dir: Path) -> None:
    fake.replies["/metrics"] = Reply.error(501, "This server does not support metrics endpoint.")
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the first snapshot")
        fake.replies["/health"] = Reply.hang()
        await eventually(lambda: _is_zero(car, "server_up"), what="server_up 0 during the blip")
        fake.replies["/v1/models"] = Reply.error(500)
        del fake.replies["/health"]
        await eventually(lambda: car.metric("server_up"), what="server_up 1 after the blip")
        asked = len(fake.requests("/slots"))
        await until(lambda: len(fake.requests("/slots")) >= asked + 5, what="polls after the blip")
        assert car.alive()
        assert await car.metric("server_restarts_total") == 0, [e["reasons"] for e in car.events("server_restarted")]


def _first(car: Sidecar, event: str, after: int) -> MutableMapping[str, Any] | None:
    return next((e for e in car.logs[after:] if e.get("event") == event), None)


async def _saved_twice(car: Sidecar) -> bool:
    return await car.metric("snapshots_total", slot="0", result="ok") >= 2


async def _is_zero(car: Sidecar, name: str) -> bool:
    return await car.metric(name) == 0


def _strict(text: str) -> Any:
    """JSON as every reader reads it: NaN and Infinity are none."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.timeout(30)
async def test_numbers_that_are_not_make_a_manifest_corrupt_and_the_page_and_status_answer(
    fake: FakeLlama, slot_dir: Path
) -> None:
    snaps = store.SnapshotStore(slot_dir, clock=protocols.SystemClock())
    fp = manifest.Fingerprint("b1", "/models/m.gguf", 100, 200, 4096, 2)
    doctored = {"created": "NaN", "tokens": str(2**63), "prefill_rate": "Infinity", "generation": "1e400"}
    for field, value in doctored.items():
        temp = snaps.writer.temp_name(0)
        (slot_dir / temp).write_bytes(b"kv" * 500)
        record = snaps.writer.commit(temp, slot=0, tokens=300, written=1000, task=3, fingerprint=fp, prefill_rate=10.0)
        path = slot_dir / record.file.replace(".bin", ".json")
        text = re.sub(rf'"{field}": [^,\n]+', f'"{field}": {value}', path.read_text(), count=1)
        assert value in text
        path.write_text(text)
    meta = f'{{"data": [{{"id": "m", "meta": {{"n_params": {10**400}, "size": {2**63}}}}}]}}'
    fake.replies["/v1/models"] = Reply.raw(meta)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: _quarantined(car, len(doctored)), what="each doctored manifest quarantined")
        await eventually(lambda: _identity_known(car), what="the server's identity read")
        code, body = await car.get("/status")
        assert code == 200, body
        status = _strict(body)
        assert status["snapshots"] == {}
        assert status["server"]["identity"]["model_params"] is None  # unknown, not 10**400
        assert status["server"]["identity"]["model_size"] is None
        code, body = await car.get("/")
        assert code == 200, body


async def _identity_known(car: Sidecar) -> bool:
    code, body = await car.get("/status")
    return code == 200 and json.loads(body)["server"]["identity"] is not None


async def _quarantined(car: Sidecar, n: int) -> bool:
    return await car.metric("snapshots_quarantined_total", reason="manifest") == n


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["device", "fifo"])
async def test_a_model_path_that_is_no_file_is_refused_and_polling_goes_on(
    fake: FakeLlama, slot_dir: Path, tmp_path: Path, kind: str
) -> None:
    """/props naming /dev/zero (a hash that never ends) or a FIFO (an open that never returns)."""
    path = "/dev/zero"
    if kind == "fifo":
        path = str(tmp_path / "model.gguf")
        os.mkfifo(path)
    fake.replies["/props"] = _props(lambda b: b.update(model_path=path))(fake)
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="the first snapshot")
        refused = await until(lambda: car.events("model_file_refused"), what="a model_file_refused line")
        assert "not a regular file" in refused[0]["error"], refused
        assert refused[0]["model_path"] == path
        asked = len(fake.requests("/props"))
        fake.restart()  # the next server process: its identity is read again, and polling still goes on
        await until(lambda: len(fake.requests("/props")) >= asked + 3, what="polls after a restart")
        assert car.alive()
        assert len(car.events("model_file_refused")) == 1, "said once per path"
