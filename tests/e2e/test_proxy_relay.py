"""The relay's own path in front of a real llama-server: what it leaves off the client's wait."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from sidecar.proxy import answer, tickets
from tests.support.llamabed import MakeServer, http_json
from tests.support.net import free_port
from tests.support.proxybed import Proxy, run_proxy
from tests.support.sidecarbed import MakeSidecar
from tests.support.wait import until


@dataclasses.dataclass(slots=True)
class _Placed:
    body: bytes
    header: str = ""
    ended: answer.Ended | None = None
    counted: bool = True
    later: bool = False

    def answered(self, ended: answer.Ended) -> None:
        self.ended = ended


class _SlowBookkeeping:
    """A pinner whose end-of-request bookkeeping (the library's /slots read after an Anthropic answer) lasts
    until the test lets it end."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.placed: list[_Placed] = []

    async def prepare(self, raw_path: str, body: bytes, *, owner: str = "") -> str | None:
        return None

    @contextlib.asynccontextmanager
    async def pin(
        self, raw_path: str, body: bytes, *, owner: str = "", ticket: tickets.Ticket | None = None
    ) -> AsyncIterator[_Placed]:
        placed = _Placed(body)
        self.placed.append(placed)
        yield placed
        await self.finish.wait()


async def test_the_client_has_its_whole_answer_before_the_end_of_request_bookkeeping(
    llama: MakeServer, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    pinner = _SlowBookkeeping()
    body = {"prompt": "Count: one, two,", "n_predict": 4, "temperature": 0}
    async with run_proxy(server.url, pinner=pinner) as proxy, aiohttp.ClientSession() as session:
        for stream in (False, True):
            pinner.finish.clear()
            async with asyncio.timeout(20):  # without the relay ending the answer itself: never, until set
                async with session.post(proxy.url + "/completion", json={**body, "stream": stream}) as resp:
                    assert resp.status == 200
                    got = await resp.read()
            assert (b"data: " in got) is stream
            assert b'"content"' in got
            ended = pinner.placed[-1].ended
            assert ended is not None
            assert ended.outcome == "ok"
            assert proxy.count("completion", "ok") == int(stream)  # counted once the bookkeeping ends
            pinner.finish.set()
            await _counted(proxy, int(stream) + 1)


async def _counted(proxy: Proxy, n: int) -> None:
    await until(lambda: proxy.count("completion", "ok") == n, timeout=10, what=f"{n} requests counted ok")


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


def _established_to(port: int) -> int:
    """TCP connections to ``port`` on this host, ESTABLISHED, seen from their client side."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rpartition(":")[2], 16) == port and fields[3] == "01":
            count += 1
    return count


async def test_after_a_stream_a_spare_connection_waits_for_the_next_request(llama: MakeServer, slot_dir: Path) -> None:
    """llama-server closes its connection after a streamed answer: the next request would pay for a new one
    before its first byte. The relay opens one while the client reads the stream, and the next request
    takes it (one spare at a time, never one per stream)."""
    server = llama(slot_dir=slot_dir)
    body = {"prompt": "Count: one, two,", "n_predict": 2, "stream": True, "temperature": 0}
    async with run_proxy(server.url) as proxy, aiohttp.ClientSession() as session:
        for n in range(1, 4):
            async with session.post(proxy.url + "/completion", json=body) as resp:
                assert resp.status == 200
                assert b"data: " in await resp.read()
            await until(lambda: _established_to(server.port) == 1, timeout=10, what="a spare connection")
            # counted once the relay has finished the response, which may be just after the client read its end
            await until(lambda: proxy.count("completion", "ok") == n, timeout=10, what=f"request {n} counted ok")  # noqa: B023
        assert proxy.count("completion", "ok") == 3
        assert _established_to(server.port) == 1
