"""The placer's ``GET /slots`` on the relay's client, against a real llama-server with an API key.

What it reads must be what the poller's client reads (the same slots, tasks
and token counts), on kept-alive connections and on one the server closed;
a key the server refuses is the poller's error. Its faults are
tests/faults/test_fault_slots_reader.py.
"""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import config, errors, metrics
from sidecar.library import reads
from sidecar.observe import upstream
from tests.support.llamabed import MakeServer, complete, make_prompt

KEY = "sk-slots-reads-41c2"


async def test_the_slots_read_on_the_relays_client_are_the_pollers(llama: MakeServer) -> None:
    server = llama(n_slots=2, api_key=KEY)
    settings = config.UpstreamSettings(url=server.url, api_key=KEY)
    answer = complete(server.url, make_prompt(server.url, 300, seed=5, api_key=KEY), id_slot=1, api_key=KEY)
    registry = CollectorRegistry()
    reader = reads.SlotsReader(settings, stats=metrics.Metrics(registry, version="test"))
    try:
        async with aiohttp.ClientSession() as session:
            polled = await upstream.LlamaClient(session, settings).slots()
        read = [await reader.slots() for _ in range(3)]
        server.restart()  # the kept-alive connection is gone with the process; the next read opens another
        after = await reader.slots()
    finally:
        await reader.close()
    assert read == [polled] * 3
    assert [v.id for v in polled] == [0, 1]
    assert polled[1].tokens == answer["timings"]["prompt_n"] + answer["timings"]["predicted_n"] - 1
    assert polled[1].task is not None
    assert polled[0].task is None
    assert [(v.id, v.task, v.tokens) for v in after] == [(0, None, 0), (1, None, 0)]
    retried = [
        registry.get_sample_value("llama_sidecar_library_slots_read_retries_total", {"answered": a})
        for a in metrics.SLOTS_RETRY_ANSWERS
    ]
    assert retried == [0.0] * len(metrics.SLOTS_RETRY_ANSWERS), "a healthy server's reads are answered at once"


async def test_a_key_the_server_refuses_is_denied(llama: MakeServer) -> None:
    server = llama(api_key=KEY)
    reader = reads.SlotsReader(
        config.UpstreamSettings(url=server.url, api_key="sk-revoked-0000"),
        stats=metrics.Metrics(CollectorRegistry(), version="test"),
    )
    try:
        with pytest.raises(errors.UpstreamDenied, match="/slots: HTTP 401") as caught:
            await reader.slots()
    finally:
        await reader.close()
    assert caught.value.status == 401
