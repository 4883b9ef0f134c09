"""poller.Poller against the in-memory server: which polls read /slots, and what they show."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from sidecar.core import config, errors, events
from sidecar.observe import poller
from tests.support import clocks
from tests.unit.memllama import MemLlama


@pytest.fixture
def server(tmp_path: Path) -> MemLlama:
    return MemLlama(tmp_path)


def make_poller(server: MemLlama) -> poller.Poller:
    return poller.Poller(server, config.PollSettings(), clock=clocks.FakeClock())


async def slot_reads(watcher: poller.Poller, server: MemLlama) -> tuple[events.Observation, int]:
    """One poll; the observation and how many times it read /slots."""
    before = server.names().count("slots")
    obs, _ = await watcher.step()
    return obs, server.names().count("slots") - before


async def test_quiet_server_small_counters_slots_read_once(server: MemLlama) -> None:
    watcher = make_poller(server)
    server.prompt_tokens = 5000.0
    assert (await slot_reads(watcher, server))[1] == 1  # came up
    for _ in range(3):
        assert (await slot_reads(watcher, server))[1] == 0  # /metrics shows nothing new: the cached view


async def test_end_of_a_turn_with_rounded_counters_is_seen(server: MemLlama) -> None:
    # A server that has prefilled 1e8 tokens prints 1e+08: a 40-token turn does not move the counters.
    server.prompt_tokens, server.cached_tokens, server.decodes = 1e8, 5e8, 4e6
    server.metrics_text_digits = 6
    watcher = make_poller(server)
    await watcher.step()
    server.set_slot(0, task=1, tokens=40, processing=True)
    obs, _ = await slot_reads(watcher, server)
    assert obs.slot(0) == events.SlotView(0, 4096, True, 1, 40)
    server.set_slot(0, tokens=60, processing=False)  # the turn ends; the rounded counters stay put
    server.prompt_tokens += 40
    server.decodes += 2
    obs, reads = await slot_reads(watcher, server)
    assert reads == 1
    assert obs.slot(0) == events.SlotView(0, 4096, False, 1, 60)


async def test_a_slot_seen_busy_is_read_again_once_none_is_processing(server: MemLlama) -> None:
    # Counters that do not move (rounded, or a server whose counters lag) are not proof the turn is still on.
    watcher = make_poller(server)
    await watcher.step()
    server.set_slot(1, task=3, tokens=900, processing=True)
    server.decodes += 1
    await watcher.step()
    server.set_slot(1, processing=False)  # no counter moved
    obs, reads = await slot_reads(watcher, server)
    assert reads == 1
    view = obs.slot(1)
    assert view is not None
    assert not view.processing


async def test_a_whole_turn_between_two_polls_is_seen_when_counters_are_rounded(server: MemLlama) -> None:
    server.prompt_tokens, server.cached_tokens, server.decodes = 1e8, 5e8, 4e6
    server.metrics_text_digits = 6
    watcher = make_poller(server)
    await watcher.step()
    with structlog.testing.capture_logs() as logs:
        server.run_turn(1, task=7, tokens=300, cached=290)  # 10 new tokens: invisible at 6 digits
        obs, reads = await slot_reads(watcher, server)
    assert reads == 1
    assert obs.slot(1) == events.SlotView(1, 4096, False, 7, 300)
    assert [e["event"] for e in logs].count("server_counters_rounded") == 1


async def test_small_counters_are_evidence_enough(server: MemLlama) -> None:
    server.prompt_tokens, server.decodes, server.metrics_text_digits = 999_000.0, 90_000.0, 6
    watcher = make_poller(server)
    await watcher.step()
    server.run_turn(1, task=7, tokens=300, cached=290)
    assert (await slot_reads(watcher, server))[1] == 1  # the counters moved: read
    assert (await slot_reads(watcher, server))[1] == 0  # and nothing since: not read


async def test_slots_are_not_read_on_every_poll_of_a_generation(server: MemLlama) -> None:
    clock = clocks.FakeClock()
    watcher = poller.Poller(server, config.PollSettings(), clock=clock)
    await watcher.step()
    server.set_slot(1, task=3, tokens=900, processing=True)
    server.decodes += 1
    assert (await slot_reads(watcher, server))[1] == 1  # a slot started: read
    reads = 0
    for _ in range(4):  # it generates: the counters move every poll, the same slot stays busy
        clock.now += 1.0
        server.decodes += 10
        reads += (await slot_reads(watcher, server))[1]
    assert reads == 0
    clock.now += poller.BUSY_REFRESH
    assert (await slot_reads(watcher, server))[1] == 1  # but never older than BUSY_REFRESH
    server.set_slot(0, task=4, tokens=100, processing=True)  # a second slot starts
    assert (await slot_reads(watcher, server))[1] == 1


async def test_a_router_is_reported_to_the_caller_before_its_metrics_are_read(server: MemLlama) -> None:
    server.router = True
    watcher = poller.Poller(server, config.PollSettings(), clock=clocks.FakeClock(), detect_router=True)
    with structlog.testing.capture_logs() as logs, pytest.raises(errors.RouterDetected):
        await watcher.step()
    assert "counters" not in server.names()
    assert not [e for e in logs if e["log_level"] == "warning"]


async def test_a_router_with_router_mode_forced_off_is_said_once(server: MemLlama) -> None:
    server.router = True
    watcher = make_poller(server)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            obs, _ = await watcher.step()
    assert obs.identity is None
    assert [e["event"] for e in logs if e["event"] in ("server_is_router", "props_unreadable")] == ["server_is_router"]


class FallsAsleepWhileFactsAreRead(MemLlama):
    """llama-server with a short --sleep-idle-seconds: asleep by the time the model's facts are read."""

    async def model_meta(self) -> tuple[int | None, int | None]:
        self.sleeping = True
        return None, None


async def test_a_server_that_fell_asleep_while_its_model_was_read_is_not_woken(tmp_path: Path) -> None:
    server = FallsAsleepWhileFactsAreRead(tmp_path)
    watcher = make_poller(server)
    obs, reads = await slot_reads(watcher, server)
    assert obs.sleeping
    assert reads == 0  # /slots is a task on llama-server's loop: reading it would wake the server
    assert "adapters" not in server.names()  # /lora-adapters too
