"""The poller puts the weights checksum and the LoRA adapters into the identity, once per server process."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sidecar.core import config, events
from sidecar.observe import poller, upstream
from tests.support import wait


class Client:
    """The slice of upstream.LlamaClient the poller calls, with counters."""

    url = "http://fake"

    def __init__(self) -> None:
        self.sleeping = False
        self.start_time = 1.0
        self.adapter_reads = 0
        self.processing = 0.0

    async def health(self) -> tuple[events.Health, str]:
        return events.Health.OK, ""

    async def props(self) -> tuple[events.Identity, bool]:
        return events.Identity("b1", "/models/m.gguf", 1, 4096), self.sleeping

    async def model_meta(self) -> tuple[int | None, int | None]:
        return 1000, 10

    async def adapters(self) -> tuple[events.Adapter, ...] | None:
        assert not self.sleeping, "/lora-adapters wakes a sleeping server"
        self.adapter_reads += 1
        return (events.Adapter(0, "/models/style.gguf", 0.5),)

    async def counters(self) -> events.Counters:
        return events.Counters(start_time=self.start_time, prompt_tokens=0, cached_tokens=0, processing=self.processing)

    async def slots(self) -> tuple[events.SlotView, ...]:
        return (events.SlotView(id=0, n_ctx=4096, processing=False, task=None, tokens=0),)


class Weights:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, model_path: str) -> str | None:
        self.calls.append(model_path)
        return "xxh3-128:" + "ab" * 16


@pytest.mark.parametrize("sleeping", [False, True])
async def test_weights_and_adapters_are_read_when_the_server_comes_up(sleeping: bool) -> None:
    client, weights = Client(), Weights()
    client.sleeping = sleeping
    poll = poller.Poller(client, config.PollSettings(), weights=weights)  # type: ignore[arg-type]
    for _ in range(3):
        obs = await poll.poll_once()
        poll.prev = obs
    assert obs.identity is not None
    assert obs.identity.weights == "xxh3-128:" + "ab" * 16
    assert weights.calls == ["/models/m.gguf"]  # once, not per poll
    if sleeping:
        assert obs.identity.adapters is None  # unknown: not read from a sleeping server
        assert client.adapter_reads == 0
    else:
        assert obs.identity.adapters == (events.Adapter(0, "/models/style.gguf", 0.5),)
        assert client.adapter_reads == 1


def test_the_client_has_every_method_the_fake_stands_in_for() -> None:
    for name in ("health", "props", "model_meta", "adapters", "counters", "slots"):
        assert callable(getattr(upstream.LlamaClient, name)), name


async def test_adapters_wait_for_an_idle_server_and_never_hold_the_poll() -> None:
    # /lora-adapters is a task on the server's loop: while a prefill runs it would wait behind it.
    client = Client()
    client.processing = 1.0
    poll = poller.Poller(client, config.PollSettings(), weights=Weights())  # type: ignore[arg-type]
    for _ in range(2):
        obs = await poll.poll_once()
        poll.prev = obs
        assert obs.identity is not None
        assert obs.identity.weights is not None  # the rest of the identity is there at once
        assert obs.identity.adapters is None
    assert client.adapter_reads == 0
    client.processing = 0.0
    obs = await poll.poll_once()
    assert obs.identity is not None
    assert obs.identity.adapters == (events.Adapter(0, "/models/style.gguf", 0.5),)
    assert client.adapter_reads == 1


async def test_a_restart_seen_as_the_server_comes_back_reads_the_model_once() -> None:
    # The poll that sees a restarted server up has read its identity afresh; reading it again would put
    # a second /props, /v1/models and model-file read on the restore round's path.
    client, weights = Client(), Weights()
    poll = poller.Poller(client, config.PollSettings(), weights=weights)  # type: ignore[arg-type]
    await poll.step()
    up = client.health

    async def down() -> tuple[events.Health, str]:
        return events.Health.DOWN, "refused"

    client.health = down  # type: ignore[method-assign]
    await poll.step()
    client.health = up  # type: ignore[method-assign]
    client.start_time = 2.0  # a new process
    weights.calls.clear()
    _, evts = await poll.step()
    assert events.Transition.RESTARTED in {e.transition for e in evts}
    assert weights.calls == ["/models/m.gguf"]


async def test_a_restart_between_two_polls_reads_the_new_identity() -> None:
    client, weights = Client(), Weights()
    poll = poller.Poller(client, config.PollSettings(), weights=weights)  # type: ignore[arg-type]
    await poll.step()
    await poll.step()
    client.start_time = 2.0  # restarted between two polls that both saw it up
    weights.calls.clear()
    obs, evts = await poll.step()
    assert events.Transition.RESTARTED in {e.transition for e in evts}
    assert weights.calls == ["/models/m.gguf"]  # the old process's identity is not carried on
    assert obs.counters is not None
    assert obs.counters.start_time == 2.0


async def test_a_server_down_is_polled_fast_while_requests_wait_for_it() -> None:
    client = Client()
    polls = 0

    async def down() -> tuple[events.Health, str]:
        nonlocal polls
        polls += 1
        return events.Health.LOADING, "loading"

    client.health = down  # type: ignore[method-assign]
    waiting = False
    poll = poller.Poller(
        client,  # type: ignore[arg-type]
        config.PollSettings(down_interval=30.0),
        weights=Weights(),
        hurry=lambda: waiting,
    )

    async def sink(obs: events.Observation, evts: list[events.Event]) -> None:
        return None

    task = asyncio.create_task(poll.run(sink))
    try:
        await wait.eventually(lambda: _true(polls == 1), timeout=5, what="the first poll")
        waiting = True
        poll.poll_soon()  # the gate does this when the first request starts waiting
        # 5 polls in well under one down_interval: HURRIED apart while a request waits.
        await wait.eventually(lambda: _true(polls >= 6), timeout=5, what="hurried polls")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _true(value: bool) -> bool:
    return value
