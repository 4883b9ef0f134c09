"""upstream.LlamaClient.adapters: GET /lora-adapters as llama-server answers it, and bad answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pytest_aiohttp.plugin import AiohttpServer

from sidecar.core import config, errors, events
from sidecar.observe import upstream


class Answer:
    def __init__(self) -> None:
        self.status = 200
        self.body: Any = []


@pytest.fixture
async def answer_and_client(aiohttp_server: AiohttpServer) -> AsyncIterator[tuple[Answer, upstream.LlamaClient]]:
    answer = Answer()

    async def handler(request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == "Bearer k1"
        return web.json_response(answer.body, status=answer.status)

    app = web.Application()
    app.router.add_get("/lora-adapters", handler)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        settings = config.UpstreamSettings(url=str(server.make_url("/")), api_key="k1")
        yield answer, upstream.LlamaClient(session, settings)


async def test_adapters_as_the_server_lists_them(answer_and_client: tuple[Answer, upstream.LlamaClient]) -> None:
    answer, client = answer_and_client
    # tools/server/server-task.cpp server_task_result_get_lora::to_json
    answer.body = [
        {"id": 0, "path": "/models/style.gguf", "scale": 0.5, "task_name": "", "prompt_prefix": ""},
        {"id": 1, "path": "/models/law.gguf", "scale": 1, "task_name": "", "prompt_prefix": ""},
    ]
    assert await client.adapters() == (
        events.Adapter(0, "/models/style.gguf", 0.5),
        events.Adapter(1, "/models/law.gguf", 1.0),
    )
    answer.body = []
    assert await client.adapters() == ()


async def test_a_server_without_the_endpoint_says_nothing(
    answer_and_client: tuple[Answer, upstream.LlamaClient],
) -> None:
    answer, client = answer_and_client
    answer.status, answer.body = 404, {"error": {"message": "File Not Found"}}
    assert await client.adapters() is None


@pytest.mark.parametrize(
    "body",
    [{"id": 0}, [{"id": 0, "path": "/a.gguf", "scale": "1"}], [{"id": "0", "path": "/a", "scale": 1}], [3]],
    ids=["object", "scale string", "id string", "not an object"],
)
async def test_malformed_answers_name_the_endpoint(
    answer_and_client: tuple[Answer, upstream.LlamaClient], body: Any
) -> None:
    answer, client = answer_and_client
    answer.body = body
    with pytest.raises(errors.UpstreamProtocolError, match="/lora-adapters"):
        await client.adapters()
