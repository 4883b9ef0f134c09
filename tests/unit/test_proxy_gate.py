"""The restore gate and the proxy's route classification, without any network."""

from __future__ import annotations

import asyncio

import structlog
from prometheus_client import CollectorRegistry

from sidecar.core import events, metrics
from sidecar.engine import gate, lifecycle
from sidecar.proxy import routes
from tests.support import clocks


async def test_gate_starts_closed_and_opens_on_a_poll() -> None:
    g = gate.Gate(clock=clocks.FakeClock())
    assert not g.is_open
    assert g.reason == gate.NOT_POLLED
    assert not await g.wait(0.01)
    g.open(seen_at=0.0)
    assert g.is_open
    assert g.reason == ""
    assert await g.wait(0.0)


async def test_suspicion_is_cleared_only_by_a_poll_started_after_it() -> None:
    clock = clocks.FakeClock()
    g = gate.Gate(clock=clock)
    g.open(seen_at=clock.now)
    clock.now = 105.0
    g.suspect("connection refused")
    assert not g.is_open
    g.open(seen_at=104.9)  # a poll in flight when the proxy saw the failure: the old process
    g.open(seen_at=105.0)
    assert not g.is_open
    assert g.reason == "connection refused"
    g.open(seen_at=105.1)
    assert g.is_open


async def test_engine_closing_then_opening_within_one_poll_opens() -> None:
    """A restore round closes the gate after its poll started; the same poll opens it once done."""
    clock = clocks.FakeClock()
    g = gate.Gate(clock=clock)
    poll_started = clock.now
    clock.now += 0.5
    g.close("a restore round is owed")
    g.open(seen_at=poll_started)
    assert g.is_open


async def test_waiters_are_released_together_and_counted() -> None:
    g = gate.Gate(clock=clocks.FakeClock())
    waiters = [asyncio.create_task(g.wait(5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    assert g.waiting == 3
    g.open(seen_at=1.0)
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert g.waiting == 0


async def test_a_request_held_twice_is_counted_while_it_waits_and_its_hold_observed_once() -> None:
    """Gate.hold: the one count of a held request (relay, twice, and router admission use it)."""
    clock = clocks.FakeClock()
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    g = gate.Gate(clock=clock)
    sample = registry.get_sample_value

    async def opened_after(seconds: float) -> None:
        await asyncio.sleep(0)
        assert sample("llama_sidecar_proxy_held_requests") == 1  # counted while it waits
        clock.now += seconds
        g.open(seen_at=clock.now)

    with g.hold(stats) as hold:
        opening = asyncio.create_task(opened_after(2.0))
        assert await hold.wait(10.0)
        await opening
        g.close("llama-server is down")  # a replay finds it closed again
        opening = asyncio.create_task(opened_after(3.0))
        assert await hold.wait(10.0)
        await opening
        assert sample("llama_sidecar_proxy_held_requests") == 0
    assert sample("llama_sidecar_proxy_hold_seconds_count") == 1
    assert sample("llama_sidecar_proxy_hold_seconds_sum") == 5.0
    with g.hold(stats):
        pass  # never waited: not observed
    assert sample("llama_sidecar_proxy_hold_seconds_count") == 1


def test_hop_by_hop_headers_and_those_named_by_connection_are_dropped() -> None:
    headers = [
        ("Connection", "close, X-Hop"),
        ("X-Hop", "1"),
        ("Keep-Alive", "5"),
        ("Transfer-Encoding", "chunked"),
        ("Authorization", "Bearer k"),
        ("Host", "a"),
    ]
    assert routes.end_to_end(headers, drop=frozenset({"host"})) == [("Authorization", "Bearer k")]


async def test_work_meanwhile_starts_only_once_the_server_answers_and_is_done_before_the_wait_returns() -> None:
    clock = clocks.FakeClock()
    g = gate.Gate(clock=clock)
    g.close("llama-server is loading")
    done: list[str] = []
    release = asyncio.Event()

    async def work() -> str | None:
        done.append("started")
        await release.wait()
        done.append("ended")
        return None

    waiter = asyncio.ensure_future(g.wait_meanwhile(5.0, work))
    await asyncio.sleep(0.01)
    assert done == []  # the server does not answer yet: nothing to do meanwhile
    g.close("a restore round is owed", serving=True)
    await asyncio.sleep(0.01)
    assert done == ["started"]
    g.open(seen_at=clock.now)
    await asyncio.sleep(0.01)
    assert not waiter.done()  # the work under way is awaited: what it did is done when the request goes on
    release.set()
    assert await waiter == (True, None)
    assert done == ["started", "ended"]


async def test_work_meanwhile_is_not_started_when_the_gate_opens_first_and_the_open_says_how_many_did() -> None:
    clock = clocks.FakeClock()
    g = gate.Gate(clock=clock)
    g.close("llama-server is down")
    started: list[int] = []

    async def work() -> str | None:
        started.append(1)
        return None

    waiter = asyncio.ensure_future(g.wait_meanwhile(5.0, work))
    await asyncio.sleep(0.01)
    g.open(seen_at=clock.now)  # no restore round: straight from down to open
    assert await waiter == (True, None)
    assert started == []
    g.close("a restore round is owed", serving=True)
    assert await g.wait_meanwhile(0.05, work) == (False, None)  # closed throughout: the work ran, the wait timed out
    assert started == [1]
    assert g.prepared == 1
    g.close("llama-server is down")  # not serving: later waiters wait for the server first
    g.open(seen_at=clock.now)
    assert g.prepared == 0  # counted for the open's log line, then reset


def test_a_closed_gate_says_each_reason_once_however_many_requests_and_polls_see_it() -> None:
    clock = clocks.FakeClock()
    g = gate.Gate(clock=clock)
    g.open(seen_at=clock.now)
    polls = 500
    with structlog.testing.capture_logs() as logs:
        for i in range(polls):  # a client polls /health through the proxy while llama-server is down
            clock.now += 0.1
            g.suspect("the proxy could not connect to llama-server (ClientConnectorError)")
            g.see(lifecycle.Unhealthy(events.Health.DOWN))
            g.suspect(f"an error that differs each time ({i})")
        closed = [line for line in logs if line["event"] == "restore_gate_closed"]
        assert len(closed) == gate.SAID_REASONS  # each distinct reason once, and a bounded number of them
        assert closed[0]["reason"].startswith("the proxy could not connect")
        assert closed[1]["reason"] == "llama-server is down"
        g.open(seen_at=clock.now + 1)
        assert g.is_open
        g.suspect("the proxy could not connect to llama-server (ClientConnectorError)")
        again = [line for line in logs if line["event"] == "restore_gate_closed"]
    assert len(again) == gate.SAID_REASONS + 1  # a new closing says its reason again
