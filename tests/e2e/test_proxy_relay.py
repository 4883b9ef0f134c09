"""The relay's own path in front of a real llama-server: what it leaves off the client's wait."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from support.llamabed import MakeServer, http_json
from support.net import free_port
from support.sidecarbed import MakeSidecar


async def test_back_to_back_streams_are_never_sent_twice(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """llama-server closes its connection after every streamed answer (without saying so in a header): the
    proxy must not put that connection back in its pool, where the next request would find it dead and be
    sent again."""
    server = llama(slot_dir=slot_dir)
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: http_json("GET", proxy + "/health", timeout=2)[0] == 200, timeout=20, what="the proxy")
    body = {"prompt": "Count: one, two,", "n_predict": 2, "stream": True, "temperature": 0, "id_slot": 0}
    async with aiohttp.ClientSession() as session:
        for _ in range(60):
            async with session.post(proxy + "/completion", json=body) as resp:
                assert resp.status == 200
                assert b"data: " in await resp.read()
    assert side.log_events("proxy_request_replayed") == []
    assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="ok") == 60
