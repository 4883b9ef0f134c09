"""upstream.LlamaClient against a fake llama-server: a real in-process aiohttp app on loopback.

The fake answers what the real server answers and, per test,
the faults the real one cannot be made to produce on demand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import pytest
from aiohttp import web
from pytest_aiohttp.plugin import AiohttpServer

from sidecar.core import config, errors, events, protocols
from sidecar.observe import upstream

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

METRICS_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12002
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 41.3
# HELP llamacpp:prompt_tokens_cached_total Prompt tokens reused from the KV cache.
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 4000
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 77
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 480.5
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""

SLOTS: list[dict[str, Any]] = [
    {"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False},
    {
        "id": 1,
        "n_ctx": 4096,
        "speculative": False,
        "is_processing": True,
        "id_task": 42,
        "n_prompt_tokens": 4001,
        "n_prompt_tokens_processed": 0,
        "n_prompt_tokens_cache": 0,
        "params": {"temperature": 0.8},
        "next_token": [{"has_next_token": True, "n_remain": -1}],
    },
]


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]
    authorization: str | None
    body: bytes


class FakeLlama:
    """A llama-server stand-in: routes keyed by (method, path), every request recorded."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.seen: list[Seen] = []
        self.url = ""
        self.release = asyncio.Event()
        """Set at teardown so hung handlers finish and the server closes at once."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(request.method, request.path, dict(request.query), request.headers.get("Authorization"), body)
        )
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            return web.json_response(
                {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}, status=404
            )
        return await handler(request)

    def json(self, method: str, path: str, body: Any, *, status: int = 200) -> None:
        async def handler(request: web.Request) -> web.StreamResponse:
            return web.json_response(body, status=status)

        self.routes[(method, path)] = handler

    def text(
        self, method: str, path: str, text: str, *, status: int = 200, headers: dict[str, str] | None = None
    ) -> None:
        async def handler(request: web.Request) -> web.StreamResponse:
            return web.Response(text=text, status=status, headers=headers)

        self.routes[(method, path)] = handler

    def error(self, method: str, path: str, status: int, message: str) -> None:
        kind = {400: "invalid_request_error", 501: "not_supported_error"}.get(status, "server_error")
        self.json(method, path, {"error": {"code": status, "message": message, "type": kind}}, status=status)

    def hang(self, method: str, path: str) -> None:
        async def handler(request: web.Request) -> web.StreamResponse:
            await self.release.wait()
            return web.json_response([])

        self.routes[(method, path)] = handler


class Connect(Protocol):
    def __call__(self, **settings: Any) -> upstream.LlamaClient: ...


@pytest.fixture
async def fake(aiohttp_server: AiohttpServer) -> AsyncIterator[FakeLlama]:
    llama = FakeLlama()
    llama.json("GET", "/health", {"status": "ok"})
    server = await aiohttp_server(llama.app())
    llama.url = str(server.make_url("/"))
    yield llama
    llama.release.set()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def connect(fake: FakeLlama, session: aiohttp.ClientSession) -> Connect:
    def make(**settings: Any) -> upstream.LlamaClient:
        url = settings.pop("url", fake.url)
        return upstream.LlamaClient(session, config.UpstreamSettings(url=url, **settings))

    return make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ---- /health -------------------------------------------------------------------------


async def test_health_ok(connect: Connect) -> None:
    assert await connect().health() == (events.Health.OK, "")


async def test_health_loading_on_503(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/health", 503, "Loading model")
    health, problem = await connect().health()
    assert health is events.Health.LOADING
    assert "503" in problem


async def test_health_down_on_500(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/health", 500, "boom")
    health, problem = await connect().health()
    assert health is events.Health.DOWN
    assert "boom" in problem


async def test_health_down_on_connection_refused(session: aiohttp.ClientSession) -> None:
    port = free_port()
    client = upstream.LlamaClient(session, config.UpstreamSettings(url=f"http://127.0.0.1:{port}"))
    health, problem = await client.health()
    assert health is events.Health.DOWN
    assert str(port) in problem


async def test_connection_refused_is_unavailable(session: aiohttp.ClientSession) -> None:
    client = upstream.LlamaClient(session, config.UpstreamSettings(url=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(errors.UpstreamUnavailable) as info:
        await client.slots()
    assert info.value.endpoint == "/slots"
    assert info.value.status is None
    assert isinstance(info.value.__cause__, aiohttp.ClientError | OSError)


async def test_health_down_when_hung(fake: FakeLlama, connect: Connect) -> None:
    fake.hang("GET", "/health")
    started = time.monotonic()
    health, problem = await connect(request_timeout=0.3).health()
    assert health is events.Health.DOWN
    assert "0.3 s" in problem
    assert time.monotonic() - started < 2.0


# ---- /slots --------------------------------------------------------------------------


async def test_slots_parsed(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/slots", SLOTS)
    assert await connect().slots() == (
        events.SlotView(id=0, n_ctx=4096, processing=False, task=None, tokens=0),
        events.SlotView(id=1, n_ctx=4096, processing=True, task=42, tokens=4001),
    )


async def test_slots_next_token_as_object_is_fine(fake: FakeLlama, connect: Connect) -> None:
    older = [dict(SLOTS[1], next_token={"has_next_token": False})]
    fake.json("GET", "/slots", older)
    assert (await connect().slots())[0].task == 42


def without(key: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in SLOTS[1].items() if k != key}]


def _with(key: str, value: Any) -> list[dict[str, Any]]:
    return [dict(SLOTS[1], **{key: value})]


BAD_SLOTS: list[tuple[str, Any, str]] = [
    ("id missing", without("id"), "'id'"),
    ("id string", _with("id", "1"), "'id'"),
    ("id bool", _with("id", True), "'id'"),
    ("n_ctx missing", without("n_ctx"), "'n_ctx'"),
    ("n_ctx float", _with("n_ctx", 4096.5), "'n_ctx'"),
    ("is_processing missing", without("is_processing"), "'is_processing'"),
    ("is_processing int", _with("is_processing", 1), "'is_processing'"),
    ("id_task string", _with("id_task", "42"), "id_task"),
    ("n_prompt_tokens string", _with("n_prompt_tokens", "4001"), "n_prompt_tokens"),
    ("n_prompt_tokens negative", _with("n_prompt_tokens", -1), "n_prompt_tokens"),
    ("entry not an object", [SLOTS[0], 7], "object"),
    ("an object, not a list", {"slots": SLOTS}, "list"),
    ("null", None, "list"),
]


@pytest.mark.parametrize(("body", "names"), [b[1:] for b in BAD_SLOTS], ids=[b[0] for b in BAD_SLOTS])
async def test_malformed_slots_name_the_field(fake: FakeLlama, connect: Connect, body: Any, names: str) -> None:
    fake.json("GET", "/slots", body)
    with pytest.raises(errors.UpstreamProtocolError) as info:
        await connect().slots()
    assert names in str(info.value)
    assert info.value.endpoint == "/slots"


@pytest.mark.parametrize(
    ("listed", "says"),
    [
        ([dict(SLOTS[0], id=i) for i in range(20_000)], "20000 slots, more than the 2"),
        ([SLOTS[0], dict(SLOTS[1], id=7)], "not distinct ids below the 2"),
        ([SLOTS[0], dict(SLOTS[1], id=0)], "not distinct ids below the 2"),
        ([SLOTS[0], dict(SLOTS[1], id=-1)], "not distinct ids below the 2"),
    ],
    ids=["20000-slots", "id-past-the-count", "id-twice", "id-negative"],
)
async def test_slots_that_props_did_not_announce_are_refused(
    fake: FakeLlama, connect: Connect, listed: list[dict[str, Any]], says: str
) -> None:
    fake.json("GET", "/props", dict(PROPS, total_slots=2))
    fake.json("GET", "/slots", listed)
    client = connect()
    await client.props()
    with pytest.raises(errors.UpstreamProtocolError, match="total_slots") as info:
        await client.slots()
    assert says in str(info.value)
    assert info.value.endpoint == "/slots"


async def test_non_json_is_a_protocol_error(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/slots", "<html>502 Bad Gateway</html>")
    with pytest.raises(errors.UpstreamProtocolError, match="JSON") as info:
        await connect().slots()
    assert isinstance(info.value.__cause__, ValueError)


async def test_501_is_not_supported(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/slots", 501, "This server does not support slots endpoint.")
    with pytest.raises(errors.UpstreamNotSupported) as info:
        await connect().slots()
    assert info.value.status == 501
    assert "does not support slots endpoint" in str(info.value)


async def test_500_is_unavailable(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/slots", 500, "internal")
    with pytest.raises(errors.UpstreamUnavailable) as info:
        await connect().slots()
    assert info.value.status == 500


async def test_hung_endpoint_times_out_within_request_timeout(fake: FakeLlama, connect: Connect) -> None:
    fake.hang("GET", "/slots")
    started = time.monotonic()
    with pytest.raises(errors.UpstreamUnavailable) as info:
        await connect(request_timeout=0.3).slots()
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 2.0
    assert info.value.endpoint == "/slots"


async def test_timeout_message_names_the_timeout(fake: FakeLlama, connect: Connect) -> None:
    fake.hang("GET", "/slots")
    with pytest.raises(errors.UpstreamUnavailable, match=r"no answer within 0\.3 s"):
        await connect(request_timeout=0.3).slots()


async def test_body_larger_than_max_body_is_refused_for_its_size(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/slots", "[" + " " * upstream.MAX_BODY + "]")
    with pytest.raises(errors.UpstreamProtocolError, match=f"more than {upstream.MAX_BODY} bytes"):
        await connect().slots()


async def test_large_valid_slots_reply_below_max_body(fake: FakeLlama, connect: Connect) -> None:
    # /slots with prompts is big: 64 slots carrying 16 KB each is ~1 MB, well below MAX_BODY.
    body = [dict(SLOTS[1], id=i, prompt="x" * 16_000) for i in range(64)]
    assert len(json.dumps(body)) < upstream.MAX_BODY
    fake.json("GET", "/slots", body)
    assert len(await connect().slots()) == 64


# ---- auth ----------------------------------------------------------------------------


async def test_authorization_header_sent_when_api_key_set(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/slots", SLOTS)
    client = connect(api_key="s3cret")
    await client.health()
    await client.slots()
    assert [s.authorization for s in fake.seen] == ["Bearer s3cret", "Bearer s3cret"]


async def test_no_authorization_header_without_api_key(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/slots", SLOTS)
    await connect().slots()
    assert [s.authorization for s in fake.seen] == [None]


async def test_401_is_rejected_with_the_servers_message(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/slots", 401, "Invalid API Key")
    with pytest.raises(errors.UpstreamRejected, match="Invalid API Key") as info:
        await connect(api_key="wrong").slots()
    assert info.value.status == 401


# ---- /props --------------------------------------------------------------------------


PROPS = {
    "build_info": "b11434-515e85511",
    "model_path": "/models/gemma3.gguf",
    "total_slots": 4,
    "is_sleeping": False,
    "default_generation_settings": {"n_ctx": 4096},
}


async def test_props_and_model_meta(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/props", PROPS)
    fake.json("GET", "/v1/models", {"data": [{"id": "gemma3", "meta": {"size": 253_000_000, "n_params": 268_098_176}}]})
    client = connect()
    identity, sleeping = await client.props()
    assert identity == events.Identity(
        build_info="b11434-515e85511", model_path="/models/gemma3.gguf", total_slots=4, n_ctx=4096
    )
    assert sleeping is False
    assert await client.model_meta() == (253_000_000, 268_098_176)


@pytest.mark.parametrize(
    "models",
    [
        {"data": []},
        {"data": [{"id": "x"}]},
        {"data": [{"id": "x", "meta": {"size": True, "n_params": "many"}}]},
        {"data": [{"id": "x", "meta": {"size": 2**63, "n_params": 10**400}}]},
        {"data": [{"id": "x", "meta": {"size": -1, "n_params": 2**53}}]},
        {"data": [{"id": "x", "meta": None}]},
        [],
    ],
)
async def test_model_meta_unknown_when_the_server_does_not_say(fake: FakeLlama, connect: Connect, models: Any) -> None:
    fake.json("GET", "/v1/models", models)
    assert await connect().model_meta() == (None, None)


async def test_model_meta_without_models_endpoint(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/props", dict(PROPS, is_sleeping=True))
    client = connect()
    identity, sleeping = await client.props()
    assert (identity.model_size, identity.model_params, sleeping) == (None, None, True)
    assert await client.model_meta() == (None, None)


async def test_identity_names_missing_props_field(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/props", {k: v for k, v in PROPS.items() if k != "total_slots"})
    with pytest.raises(errors.UpstreamProtocolError, match="'total_slots'"):
        await connect().props()


# ---- /metrics ------------------------------------------------------------------------


async def test_counters(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/metrics", METRICS_TEXT, headers={"Process-Start-Time-Unix": "1764414733"})
    counters = await connect().counters()
    assert (counters.start_time, counters.prompt_tokens, counters.cached_tokens) == (1764414733.0, 12002.0, 4000.0)
    assert counters.processing == 1.0
    assert 77.0 in counters.activity
    assert 12002.0 in counters.activity


async def test_counters_activity_moves_with_work(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/metrics", METRICS_TEXT)
    client = connect()
    before = await client.counters()
    fake.text("GET", "/metrics", METRICS_TEXT.replace("n_decode_total 77", "n_decode_total 78"))
    after = await client.counters()
    assert before.activity != after.activity
    assert (before.prompt_tokens, before.cached_tokens) == (after.prompt_tokens, after.cached_tokens)


async def test_counters_without_start_time_header(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/metrics", METRICS_TEXT)
    counters = await connect().counters()
    assert counters.start_time is None
    assert counters.prompt_tokens == 12002.0
    assert counters.prompt_seconds == 41.3  # the prefill rate is their ratio


async def test_counters_start_time_header_any_case(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/metrics", METRICS_TEXT, headers={"process-start-time-unix": "1764414733"})
    assert (await connect().counters()).start_time == 1764414733.0


async def test_counters_not_prometheus_text(fake: FakeLlama, connect: Connect) -> None:
    fake.text("GET", "/metrics", "this is not {prometheus")
    with pytest.raises(errors.UpstreamProtocolError, match="Prometheus"):
        await connect().counters()


async def test_metrics_off_is_not_supported(fake: FakeLlama, connect: Connect) -> None:
    fake.error("GET", "/metrics", 501, "This server does not support metrics endpoint.")
    with pytest.raises(errors.UpstreamNotSupported):
        await connect().counters()


# ---- slot actions --------------------------------------------------------------------


async def test_save(fake: FakeLlama, connect: Connect) -> None:
    fake.json(
        "POST",
        "/slots/1",
        {"id_slot": 1, "filename": "a.bin", "n_saved": 4001, "n_written": 20_123_456, "timings": {"save_ms": 11.5}},
    )
    result = await connect().save(1, "a.bin")
    assert result == protocols.ActionResult(slot=1, filename="a.bin", tokens=4001, bytes=20_123_456, server_ms=11.5)
    assert [(s.method, s.path, s.query, json.loads(s.body)) for s in fake.seen] == [
        ("POST", "/slots/1", {"action": "save"}, {"filename": "a.bin"})
    ]


async def test_restore(fake: FakeLlama, connect: Connect) -> None:
    fake.json(
        "POST",
        "/slots/0",
        {"id_slot": 0, "filename": "b.bin", "n_restored": 12001, "n_read": 45_000_000, "timings": {"restore_ms": 13}},
    )
    result = await connect().restore(0, "b.bin")
    assert result == protocols.ActionResult(slot=0, filename="b.bin", tokens=12001, bytes=45_000_000, server_ms=13.0)
    assert fake.seen[0].query == {"action": "restore"}


async def test_save_without_timings(fake: FakeLlama, connect: Connect) -> None:
    fake.json("POST", "/slots/0", {"id_slot": 0, "filename": "a.bin", "n_saved": 5, "n_written": 44})
    assert (await connect().save(0, "a.bin")).server_ms == 0.0


async def test_save_reply_missing_n_written(fake: FakeLlama, connect: Connect) -> None:
    fake.json("POST", "/slots/0", {"id_slot": 0, "filename": "a.bin", "n_saved": 5, "timings": {"save_ms": 1}})
    with pytest.raises(errors.UpstreamProtocolError, match="'n_written'"):
        await connect().save(0, "a.bin")


async def test_400_is_rejected_with_the_servers_message(fake: FakeLlama, connect: Connect) -> None:
    fake.error("POST", "/slots/0", 400, "Invalid filename")
    with pytest.raises(errors.UpstreamRejected) as info:
        await connect().save(0, "../x.bin")
    assert info.value.status == 400
    assert "Invalid filename" in str(info.value)


async def test_save_without_slot_save_path_is_not_supported(fake: FakeLlama, connect: Connect) -> None:
    fake.error("POST", "/slots/0", 501, "This server does not support slot actions.")
    with pytest.raises(errors.UpstreamNotSupported):
        await connect().save(0, "a.bin")


async def test_restore_rejected_with_the_servers_message(fake: FakeLlama, connect: Connect) -> None:
    message = "Unable to restore slot: No available space in KV cache or invalid slot save file"
    fake.error("POST", "/slots/2", 400, message)
    with pytest.raises(errors.UpstreamRejected, match="invalid slot save file"):
        await connect().restore(2, "c.bin")


# ---- router mode: a client bound to one model ----------------------------------------

ROUTER_MODELS = {
    "data": [
        {"id": "alpha", "status": {"value": "loaded", "args": []}},
        {"id": "beta", "status": {"value": "unloaded", "args": []}},
        {"id": "gamma", "status": {"value": "loading", "args": []}},
        {"id": "delta", "status": {"value": "sleeping", "args": []}},
    ],
    "object": "list",
}


def bound(connect: Connect, model: str) -> upstream.LlamaClient:
    plain = connect()
    return plain.for_model(model, config.UpstreamSettings(url=plain.url))


@pytest.mark.parametrize(
    ("model", "health"),
    [
        ("alpha", events.Health.OK),
        ("delta", events.Health.OK),
        ("gamma", events.Health.LOADING),
        ("beta", events.Health.UNLOADED),
        ("omega", events.Health.DOWN),
    ],
)
async def test_a_models_health_is_its_state_in_the_routers_model_list(
    fake: FakeLlama, connect: Connect, model: str, health: events.Health
) -> None:
    fake.json("GET", "/models", ROUTER_MODELS)
    got, problem = await bound(connect, model).health()
    assert got is health
    assert (problem == "") is (health is events.Health.OK)
    assert all(seen.path != "/health" for seen in fake.seen), "the router's /health does not speak for a model"


async def test_every_read_and_action_names_the_model_and_never_autoloads(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/slots", SLOTS)
    fake.json(
        "GET",
        "/props",
        {
            "build_info": "b1",
            "model_path": "/m/alpha.gguf",
            "total_slots": 2,
            "default_generation_settings": {"n_ctx": 8192},
        },
    )
    fake.text("GET", "/metrics", METRICS_TEXT)
    fake.json("GET", "/lora-adapters", [])
    reply = {"id_slot": 1, "filename": "f.bin", "n_saved": 9, "n_written": 99, "n_restored": 9, "n_read": 99}
    fake.json("POST", "/slots/1", reply)
    client = bound(connect, "alpha")
    await client.slots()
    await client.props()
    await client.counters()
    await client.adapters()
    await client.save(1, "f.bin")
    await client.restore(1, "f.bin")
    assert len(fake.seen) == 6
    for seen in fake.seen:
        assert seen.query.get("model") == "alpha", seen
        assert seen.query.get("autoload") == "false", seen
    actions = [json.loads(seen.body) for seen in fake.seen if seen.method == "POST"]
    assert actions == [{"filename": "f.bin", "model": "alpha"}] * 2
    assert [seen.query["action"] for seen in fake.seen if seen.method == "POST"] == ["save", "restore"]


async def test_the_rewinds_calls_name_the_model_and_never_autoload(fake: FakeLlama, connect: Connect) -> None:
    """A router refuses a POST whose body names no model: a windowed or hybrid model's rewind to its prompt's
    boundary (a template, a tokenize, a completion) must name the model, or its slots are saved past the reply."""
    fake.json("POST", "/apply-template", {"prompt": "<start>x"})
    fake.json("POST", "/tokenize", {"tokens": [2, 7]})
    fake.json("POST", "/completion", {"timings": {"prompt_n": 1, "cache_n": 1}})
    client = bound(connect, "alpha")
    assert await client.prompts.apply_template({"messages": [{"role": "user", "content": "x"}]}) == "<start>x"
    assert await client.prompts.tokenize("x") == [2, 7]
    assert await client.prompts.complete_ids(0, [2, 7]) == (1, 1)
    assert len(fake.seen) == 3
    for seen in fake.seen:
        assert json.loads(seen.body)["model"] == "alpha", seen
        assert seen.query.get("autoload") == "false", seen


async def test_a_plain_client_sends_no_model(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/slots", SLOTS)
    await connect().slots()
    assert fake.seen[-1].query == {}


async def test_the_router_list_parses_unknown_states_as_unknown(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/models", {"data": [{"id": "a", "status": {"value": "teleporting"}}]})
    assert await connect().router.models() == {"a": events.ModelStatus.UNKNOWN}


async def test_a_malformed_router_list_is_a_protocol_error(fake: FakeLlama, connect: Connect) -> None:
    fake.json("GET", "/models", {"data": [{"id": 7, "status": {}}]})
    with pytest.raises(errors.UpstreamProtocolError, match="/models"):
        await connect().router.models()


async def test_a_router_is_recognised_by_its_props(fake: FakeLlama, connect: Connect) -> None:
    fake.json(
        "GET",
        "/props",
        {"role": "router", "model_path": "none", "build_info": "b1", "default_generation_settings": {"n_ctx": 0}},
    )
    with pytest.raises(errors.UpstreamIsRouter, match="router mode"):
        await connect().props()
