"""The poller puts the weights checksum and the LoRA adapters into the identity, once per server process."""

from __future__ import annotations

import pytest

from sidecar.core import config, events
from sidecar.observe import poller, upstream


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
