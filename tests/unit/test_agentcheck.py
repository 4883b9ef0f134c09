"""The agent check: the pure answer (standing) and the TCP port HAProxy reads it from (agentcheck)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import typing
from typing import Any

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.app import agentcheck, standing
from sidecar.core import errors, events, metrics, outcomes, protocols
from sidecar.engine import gate, report
from sidecar.router import fleet as router_fleet
from tests.support.wait import until


def _slot(slot: int, *, processing: bool = False, tokens: int = 0) -> events.SlotView:
    return events.SlotView(slot, 4096, processing, task=None if tokens == 0 else 7, tokens=tokens)


def _status(
    health: events.Health | None = events.Health.OK,
    slots: tuple[events.SlotView, ...] = (),
    *,
    gate: str = "",
    low_disk: bool = False,
    denied: tuple[str, ...] = (),
) -> report.Status:
    seen = None if health is None else events.Observation(at=1.0, health=health, slots=slots, denied=denied)
    return report.Status(
        server_url="http://llama:8080",
        observation=seen,
        identity=None,
        link_ok=None,
        link_problem="",
        last_snapshot=None,
        last_restore=(),
        progress_at=1.0,
        acting=False,
        restore_gate=gate,
        low_disk=low_disk,
    )


def _answer(status: report.Status) -> standing.Answer:
    return standing.answer(standing.facts(status))


@pytest.mark.parametrize("health", [None, events.Health.DOWN, events.Health.LOADING, events.Health.UNLOADED])
def test_a_server_not_serving_is_down_whatever_else_holds(health: events.Health | None) -> None:
    got = _answer(_status(health, gate="restore round owed", low_disk=True))
    assert got.state is outcomes.AgentState.DOWN
    assert got.line().startswith(b"down #")


def test_a_server_that_refuses_the_sidecars_key_is_down() -> None:
    assert _answer(_status(denied=("/slots: 401",))).state is outcomes.AgentState.DOWN


def test_a_restore_round_drains_and_says_up_so_a_node_back_from_down_is_draining() -> None:
    got = _answer(_status(slots=(_slot(0),), gate="restore round owed after a restart"))
    assert got.state is outcomes.AgentState.DRAIN
    assert got.line() == b"up drain #restore gate closed: restore round owed after a restart\n"


def test_a_full_slot_dir_drains() -> None:
    got = _answer(_status(slots=(_slot(0),), low_disk=True))
    assert got.state is outcomes.AgentState.DRAIN
    assert b"--min-free-bytes" in got.line()


def test_up_says_ready_so_it_ends_a_drain_and_keeps_full_weight_while_a_slot_is_free() -> None:
    slots = (_slot(0, processing=True, tokens=900), _slot(1, tokens=500), _slot(2))
    got = _answer(_status(slots=slots))
    assert got.line() == b"ready up 100% #2 of 3 slots free, 2 holding a conversation\n"


def test_the_weight_drops_only_while_every_slot_runs_a_request() -> None:
    busy = (_slot(0, processing=True, tokens=9), _slot(1, processing=True, tokens=9))
    assert _answer(_status(slots=busy)).weight == standing.SATURATED
    assert _answer(_status(slots=())).weight == standing.FULL  # slots not read: no reason to move the ring


def test_the_line_is_one_line_of_ascii_whatever_the_reason_says() -> None:
    line = _answer(_status(gate="llama-server's slots: ünïcode # and\nnewline")).line()
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert line.count(b"#") == 1
    line.decode("ascii")


def _router(health: events.Health | None, models: dict[str, report.Status], *, low_disk: bool = False) -> report.Status:
    """A router-mode status as the fleet builds it: the router's health (no slots), and each model's own status."""
    return dataclasses.replace(_status(health, low_disk=low_disk), models=tuple(models.items()))


def test_router_mode_one_model_restoring_keeps_the_node_up_and_names_the_model() -> None:
    alpha = _status(slots=(_slot(0), _slot(1, tokens=900)), gate="restore round running")
    beta = _status(slots=(_slot(0, processing=True, tokens=300), _slot(1)))
    got = _answer(_router(events.Health.OK, {"alpha": alpha, "beta": beta}))
    assert got.state is outcomes.AgentState.UP
    assert got.line() == (
        b"ready up 100% #restoring model alpha (its requests wait here); 3 of 4 slots free, 2 holding a conversation\n"
    )


def test_router_mode_counts_only_loaded_models_slots_and_restores() -> None:
    gone = _status(events.Health.UNLOADED, gate="llama-server is unloaded")  # an unloaded model's gate is closed
    busy = _status(slots=(_slot(0, processing=True, tokens=9),))
    got = _answer(_router(events.Health.OK, {"alpha": gone, "beta": busy}))
    assert got.line() == b"ready up 50% #0 of 1 slots free, 1 holding a conversation\n"


@dataclasses.dataclass
class _Core:
    now: report.Status

    def status(self) -> report.Status:
        return self.now


class _Router:
    """The router's client as the fleet's step reads it: healthy, its model list unreadable (the members stay)."""

    url = "http://router:8080"

    async def health(self) -> tuple[events.Health, str]:
        return events.Health.OK, ""

    @property
    def router(self) -> _Router:  # the router-mode calls are the client's part: the same fake
        return self

    async def models(self) -> list[str]:
        raise errors.UpstreamUnavailable("not listed in this test", endpoint="/models")


async def test_the_fleets_status_gives_the_agent_each_loaded_models_slots_and_restore() -> None:
    fleet = router_fleet.Fleet(
        client=typing.cast(Any, _Router()),
        snapshots=typing.cast(Any, None),
        stats=metrics.Metrics(CollectorRegistry(), version="test"),
        settings=typing.cast(Any, None),
        clock=protocols.SystemClock(),
    )
    restoring = _status(slots=(_slot(0), _slot(1, tokens=500)), gate="restore round running")
    fleet.members["alpha"] = router_fleet.Member("alpha", typing.cast(Any, _Core(restoring)), gate.Gate())
    await fleet.step()
    assert _answer(fleet.status()).line() == (
        b"ready up 100% #restoring model alpha (its requests wait here); 2 of 2 slots free, 1 holding a conversation\n"
    )


def test_router_mode_node_wide_states_hold_whatever_the_models_say() -> None:
    fine = {"alpha": _status(slots=(_slot(0),))}
    assert _answer(_router(events.Health.DOWN, fine)).state is outcomes.AgentState.DOWN
    drained = _answer(_router(events.Health.OK, fine, low_disk=True))
    assert drained.state is outcomes.AgentState.DRAIN
    assert b"--min-free-bytes" in drained.line()


views = st.builds(_slot, st.integers(0, 7), processing=st.booleans(), tokens=st.sampled_from([0, 1, 300, 4000])).map(
    lambda v: v
)


@given(
    health=st.sampled_from([None, *events.Health]),
    slots=st.lists(views, max_size=6).map(tuple),
    gate=st.sampled_from(["", "restore round running"]),
    low_disk=st.booleans(),
)
def test_every_status_gets_exactly_one_well_formed_answer(
    health: events.Health | None, slots: tuple[events.SlotView, ...], gate: str, low_disk: bool
) -> None:
    got = _answer(_status(health, slots, gate=gate, low_disk=low_disk))
    serving = health is events.Health.OK
    assert (got.state is outcomes.AgentState.DOWN) == (not serving)
    assert (got.state is outcomes.AgentState.DRAIN) == (serving and bool(gate or low_disk))
    if got.state is outcomes.AgentState.UP:
        assert got.weight in (standing.FULL, standing.SATURATED)
        assert got.line().startswith(f"ready up {got.weight}% #".encode())


@dataclasses.dataclass
class _Node:
    """The seam, in memory: the status the agent reads, changed by the test."""

    now: report.Status

    def status(self) -> report.Status:
        return self.now


async def _ask(port: int, send: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if send:
        writer.write(send)
    answer = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    return answer


async def test_the_port_answers_each_connection_with_the_status_of_that_moment() -> None:
    node = _Node(_status(slots=(_slot(0),)))
    agent = await agentcheck.start(node, host="127.0.0.1", port=0)
    try:
        assert await _ask(agent.port) == b"ready up 100% #1 of 1 slots free, 0 holding a conversation\n"
        node.now = _status(events.Health.DOWN)
        assert await _ask(agent.port, b"backend/node-a\n") == b"down #llama-server is down\n"  # agent-send text
    finally:
        await agent.close()


async def test_a_client_that_never_closes_is_closed_after_the_timeout() -> None:
    agent = await agentcheck.start(_Node(_status()), host="127.0.0.1", port=0, timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        started = time.monotonic()
        line = await asyncio.wait_for(reader.readline(), timeout=5)
        assert line.startswith(b"ready up")
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # closed by the agent, not by us
        assert time.monotonic() - started < 3
        await until(lambda: not agent.state.open, what="the connection forgotten")
        writer.close()
    finally:
        await agent.close()


async def test_a_client_that_sends_too_much_is_cut_off() -> None:
    agent = await agentcheck.start(_Node(_status()), host="127.0.0.1", port=0, timeout=30, max_input=64)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        await reader.readline()
        writer.write(b"x" * 4096)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(_read_to_end(reader), timeout=5)
        await until(lambda: not agent.state.open, what="the connection closed")
        writer.close()
    finally:
        await agent.close()


async def _read_to_end(reader: asyncio.StreamReader) -> None:
    data = await reader.read()
    if not data:
        raise asyncio.IncompleteReadError(b"", None)


async def test_connections_over_the_cap_are_closed_unanswered() -> None:
    agent = await agentcheck.start(_Node(_status()), host="127.0.0.1", port=0, timeout=30, max_connections=2)
    held = [await asyncio.open_connection("127.0.0.1", agent.port) for _ in range(2)]
    try:
        for reader, _ in held:
            assert (await reader.readline()).startswith(b"ready up")
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        try:
            extra = await asyncio.wait_for(reader.read(), timeout=5)
        except ConnectionError:
            extra = b""
        assert extra == b""
        assert agent.refused == 1
        writer.close()
        for _, w in held:
            w.close()
        await until(lambda: not agent.state.open, what="the held connections closed")
        assert (await _ask(agent.port)).startswith(b"ready up")  # room again
    finally:
        await agent.close()


def test_the_port_answers_on_uvloop_the_loop_the_sidecar_runs_on() -> None:
    """uvloop's transports are no ``asyncio.Transport`` subclasses: the port must not rely on that."""

    async def ask_once() -> bytes:
        agent = await agentcheck.start(_Node(_status()), host="127.0.0.1", port=0)
        try:
            return await _ask(agent.port)
        finally:
            await agent.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(ask_once()).startswith(b"ready up 100% #")
