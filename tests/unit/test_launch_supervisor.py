"""The launcher's supervisor with real child processes (a shell stands in for llama-server)."""

from __future__ import annotations

import asyncio
import sys

import structlog
from prometheus_client import CollectorRegistry

from sidecar.core import metrics, outcomes
from sidecar.launch import argv, restarts, supervisor
from tests.support.wait import until


def launch(script: str) -> argv.Launch:
    return argv.Launch(argv=("sh", "-c", script), url="http://127.0.0.1:1", added=(), router=False)


def made(
    script: str, *, stop_timeout: float = supervisor.STOP_TIMEOUT
) -> tuple[supervisor.Supervisor, CollectorRegistry]:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="test")
    sup = supervisor.Supervisor(launch(script), stats=stats, jitter=lambda: 0.0, stop_timeout=stop_timeout)
    return sup, registry


async def test_a_child_that_exits_at_once_is_restarted_then_given_up_as_a_crash_loop() -> None:
    sup, registry = made("echo 'cannot load model' >&2; exit 3")
    suspicions: list[str] = []
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(sup.run(suspicions.append), name="launcher")
        await until(lambda: sup.status().state is outcomes.ChildState.GAVE_UP, timeout=20, what="a crash loop")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ends = restarts.CRASH_LOOP_EXITS
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "failed"}) == ends
    assert registry.get_sample_value("llama_sidecar_server_crash_loop") == 1
    assert len(suspicions) == ends
    assert "exit status 3" in suspicions[0]
    status = sup.status()
    assert status.starts == ends
    assert status.last_cause is outcomes.ServerExit.FAILED
    assert f"ended {ends} times" in status.problem
    assert "restart llama-kv-sidecar" in status.problem
    assert not sup.hurried()
    given_up = [line for line in logs if line["event"] == "server_crash_loop"]
    assert len(given_up) == 1
    assert given_up[0]["hint"]
    said = [line for line in logs if line["event"] == "server_output"]
    assert {(line["stream"], line["line"]) for line in said} == {("stderr", "cannot load model")}
    restarting = [line["delay_seconds"] for line in logs if line["event"] == "server_restarting"]
    assert restarting == sorted(restarting)
    assert restarting[0] < restarting[-1]


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


async def test_a_missing_program_is_not_started_and_counted() -> None:
    sup = supervisor.Supervisor(
        argv.Launch(argv=(sys.prefix + "/no-such-llama-server",), url="", added=(), router=False),
        stats=metrics.Metrics(registry := CollectorRegistry(), version="test"),
        jitter=lambda: 0.0,
    )
    task = asyncio.create_task(sup.run(lambda _: None), name="launcher")
    await until(lambda: sup.status().state is outcomes.ChildState.GAVE_UP, timeout=20, what="a crash loop")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert registry.get_sample_value("llama_sidecar_server_exits_total", {"cause": "not_started"}) == 5
    assert sup.status().starts == 0
