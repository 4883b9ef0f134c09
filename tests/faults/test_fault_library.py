"""The conversation library's routing when llama-server cannot tokenize: the request goes as it came."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.support.fakellama import FakeLlama, Reply
from tests.support.faultbed import Sidecar, make_settings, run_sidecar, with_proxy
from tests.support.wait import eventually


async def _ready(car: Sidecar) -> bool:
    return (await car.get("/readyz"))[0] == 200


@pytest.mark.timeout(30)
async def test_a_prompt_the_server_cannot_tokenize_is_forwarded_unpinned_counted_and_logged_once(
    fake: FakeLlama, slot_dir: Path
) -> None:
    fake.replies["/completion"] = Reply.json({"content": "ok"})
    fake.replies["/v1/chat/completions"] = Reply.json({"choices": []})
    fake.replies["/tokenize"] = Reply.error(500, "the tokenizer failed")
    async with run_sidecar(with_proxy(make_settings(fake.url, slot_dir))) as car, aiohttp.ClientSession() as session:
        proxy = car.proxy_url
        await eventually(lambda: _ready(car), what="/readyz 200")
        for path, body in (
            ("/completion", {"prompt": "a prompt " * 40}),
            ("/completion", {"prompt": "another one " * 40}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            async with session.post(proxy + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert len(fake.requests("/completion")) == 2
        assert len(fake.requests("/v1/chat/completions")) == 1
        assert await car.metric("conversation_unrouted_total", reason="tokenize") == 3
        assert await car.metric("proxy_requests_total", route="completion", outcome="ok") == 3
        said = [e for e in car.logs if e.get("event") == "request_not_routed"]
        assert len(said) == 1, said
        assert "a prompt" not in str(car.logs)
