"""The launcher's supervisor with real child processes (a shell stands in for llama-server)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry

from sidecar.core import errors, metrics, outcomes
from sidecar.launch import argv, restarts, supervisor
from tests.support.wait import until


def children() -> set[int]:
    """The pids of this process's children, reaped or not (a zombie is still listed)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


@pytest.fixture(autouse=True)
async def no_child_outlives_its_test() -> AsyncIterator[None]:
    """Each test ends with its children ended and reaped while its event loop still runs.

    A child reaped after its loop closed leaves asyncio's record of it open; once its pid is used again,
    that record's next poll reaps the new process, whose end then reads ``exit status 255``.
    """
    before = children()
    yield
    await until(lambda: not children() - before, timeout=10, what="every child this test started to be reaped")


def launch(script: str) -> argv.Launch:
    return argv.Launch(argv=("sh", "-c", script), url="http://127.0.0.1:1", added=(), router=False)


def made(
    script: str, *, stop_timeout: float = supervisor.STOP_TIMEOUT
) -> tuple[supervisor.Supervisor, CollectorRegistry]:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="test")
    sup = supervisor.Supervisor(launch(script), stats=stats, jitter=lambda: 0.0, stop_timeout=stop_timeout)
    return sup, registry


async def test_a_child_that_exits_on_its_own_before_it_ever_served_ends_the_launcher_naming_its_lines() -> None:
    sup, registry = made("echo 'starting' >&2; echo 'error: unknown argument: --bogus' >&2; exit 3")
    suspicions: list[str] = []
    with structlog.testing.capture_logs() as logs, pytest.raises(errors.ServerNotStarted) as ended:
        await asyncio.wait_for(sup.run(suspicions.append), timeout=20)
    assert ended.value.exit_code == 3
    assert "exit status 3 before it ever served" in str(ended.value)
    assert "unknown argument: --bogus" in str(ended.value)
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "failed"}) == 1
    status = sup.status()
    assert status.starts == 1
    assert status.state is outcomes.ChildState.GAVE_UP
    assert "unknown argument" in status.problem
    assert not sup.hurried()
    said = [line for line in logs if line["event"] == "server_not_started"]
    assert len(said) == 1
    assert said[0]["last_lines"] == ["starting", "error: unknown argument: --bogus"]
    assert said[0]["hint"]


async def test_a_child_that_served_is_restarted_past_any_crash_loop_with_a_growing_delay() -> None:
    sup, registry = made("sleep 0.4; exit 3")
    ticks = iter(range(10**9))  # the gate opens again at every look: each run serves
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(sup.run(lambda _: None, lambda: next(ticks)), name="launcher")
        try:
            await until(
                lambda: sup.status().starts > restarts.CRASH_LOOP_EXITS + 1, timeout=30, what="restarts past a loop"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await sup.stop()
    assert registry.get_sample_value("llama_sidecar_server_crash_loop") == 0
    assert not [line for line in logs if line["event"] in ("server_crash_loop", "server_not_started")]
    restarting = [line["delay_seconds"] for line in logs if line["event"] == "server_restarting"]
    assert restarting == sorted(restarting)
    assert restarting[0] == 0.0 < restarting[-1] <= restarts.MAX_DELAY


async def test_a_child_that_served_then_cannot_come_up_is_a_crash_loop_said_once_and_kept_trying(
    tmp_path: Path,
) -> None:
    first = tmp_path / "first-run"
    sup, registry = made(f"if [ ! -e {first} ]; then touch {first}; sleep 1; fi; exit 4")
    served = {"opened": 0}
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(sup.run(lambda _: None, lambda: served["opened"]), name="launcher")
        try:
            await until(lambda: sup.status().starts >= 1, timeout=10, what="the first start")
            served["opened"] = 1  # as if the first run had served before it ended
            await until(
                lambda: sup.status().starts > restarts.CRASH_LOOP_EXITS + 1, timeout=30, what="restarts in a loop"
            )
            assert not task.done(), "the launcher gave up on a server that had served"
            assert registry.get_sample_value("llama_sidecar_server_crash_loop") == 1
            assert "keeps starting it" in sup.status().problem
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await sup.stop()
    looped = [line for line in logs if line["event"] == "server_crash_loop"]
    assert len(looped) == 1
    assert looped[0]["hint"]


async def test_a_killed_child_is_known_by_its_signal_and_started_again() -> None:
    sup, registry = made("exec sleep 30")
    suspicions: list[str] = []
    task = asyncio.create_task(sup.run(suspicions.append), name="launcher")
    try:
        first = await until(lambda: sup.status().pid, timeout=10, what="the first child")
        sup.kill_now()
        second = await until(lambda: (p := sup.status().pid) != first and p, timeout=10, what="the second child")
        assert second != first
        assert suspicions == ["llama-server killed by SIGKILL; the launcher starts it again"]
        assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "killed"}) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sup.stop()


async def test_stop_sends_sigterm_then_sigkill_after_the_timeout() -> None:
    sup, registry = made("trap '' TERM; echo ready; while true; do sleep 0.05; done", stop_timeout=0.3)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(sup.run(lambda _: None), name="launcher")
        await until(  # its trap is set once it has said so
            lambda: any(line.get("line") == "ready" for line in logs), timeout=10, what="the child's trap"
        )
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await sup.stop()
    status = sup.status()
    assert status.state is outcomes.ChildState.STOPPED
    assert status.last_exit == "killed by SIGKILL"  # it ignored SIGTERM
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "stopped"}) == 1
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "killed"}) == 0


async def test_a_missing_program_is_not_started_and_ends_the_launcher() -> None:
    sup = supervisor.Supervisor(
        argv.Launch(argv=(sys.prefix + "/no-such-llama-server",), url="", added=(), router=False),
        stats=metrics.Metrics(registry := CollectorRegistry(), version="test"),
        jitter=lambda: 0.0,
    )
    with pytest.raises(errors.ServerNotStarted) as ended:
        await asyncio.wait_for(sup.run(lambda _: None), timeout=20)
    assert ended.value.exit_code == 1
    assert "could not be started" in str(ended.value)
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "not_started"}) == 1
    assert sup.status().starts == 0
