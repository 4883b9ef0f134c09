"""The proxy's resource caps under attack, in front of a real llama-server: the sidecar keeps its own work going.

40 clients each send 30 MiB of a 32 MiB body and stall; then 1,100 more
connect and send nothing. Meanwhile a conversation straight to llama-server
must still be saved, the sidecar's ``/healthz`` must answer, and the
sidecar's memory and file descriptors must stay within the documented caps
(``--proxy-max-inflight-body-bytes`` over its resting RSS; two descriptors
per ``--proxy-max-connections`` plus the reserve).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from pathlib import Path

import pytest

from sidecar.core import config
from sidecar.proxy import conns
from tests.support.llamabed import MakeServer, complete, http_json, make_prompt
from tests.support.net import free_port
from tests.support.report import SUMMARY
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

MiB = 1 << 20
BODY_TIMEOUT = 8.0
STALLERS = 40
IDLE = 1100


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _staller(port: int, chunk: bytes) -> bytes:
    """Declare 32 MiB, send 30 MiB, stall; return what the proxy answered (b'' if nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /completion HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {32 * MiB}\r\n\r\n"
    )
    try:
        writer.write(head.encode())
        for _ in range(30):
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 30)
    except (ConnectionError, TimeoutError):
        pass
    try:
        return await asyncio.wait_for(reader.read(4096), BODY_TIMEOUT + 20)
    except (ConnectionError, TimeoutError):
        return b""
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def _watch(side: SidecarProcess, pid: int, figures: dict[str, list[float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        code, _ = await asyncio.to_thread(side.get, "/healthz")
        figures["healthz_s"].append(time.monotonic() - started if code == 200 else float("inf"))
        figures["rss"].append(_rss(pid))
        figures["fds"].append(_fds(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


@pytest.mark.timeout(300)
async def test_stalled_bodies_and_idle_connections_leave_saves_healthz_memory_and_fds_within_the_caps(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE + STALLERS + 256
    assert hard == resource.RLIM_INFINITY or hard >= wanted, f"the hard fd limit {hard} cannot hold this test"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    server = llama(slot_dir)
    port = free_port()
    defaults = config.ProxySettings()
    side = sidecar(
        server,
        slot_dir,
        extra={"--proxy-listen": f"127.0.0.1:{port}", "--proxy-body-timeout": str(BODY_TIMEOUT)},
    )
    assert side.proc is not None
    pid = side.proc.pid
    prompt = make_prompt(server.url, 200, seed=1)
    await asyncio.to_thread(complete, f"http://127.0.0.1:{port}", prompt, 4)
    await asyncio.to_thread(side.wait_saved, 1)
    resting = _rss(pid)

    figures: dict[str, list[float]] = {"healthz_s": [], "rss": [], "fds": []}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(side, pid, figures, stop))
    chunk = b" " * MiB
    started = time.monotonic()
    stallers = [asyncio.create_task(_staller(port, chunk)) for _ in range(STALLERS)]
    await asyncio.sleep(3)  # the admitted bodies are read, the others refused
    idle = []
    for _ in range(IDLE):
        idle.append(await asyncio.open_connection("127.0.0.1", port))
    # while everything is open: a turn straight to llama-server is still saved
    saved = side.metric("llama_sidecar_snapshots_total", slot="0", result="ok")
    await asyncio.to_thread(complete, server.url, prompt + " and then some more words", 4)
    await asyncio.to_thread(
        side.wait_for,
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") > saved,
        timeout=60,
        what="a save during the attack",
    )
    open_now = side.metric("llama_sidecar_proxy_connections")
    refused_idle = 0
    for reader, _ in idle:
        with contextlib.suppress(TimeoutError):
            answer = await asyncio.wait_for(reader.read(4096), 0.01)
            if _status(answer) == 503 and b"--proxy-max-connections" in answer:
                refused_idle += 1
    answers = await asyncio.gather(*stallers)
    took = time.monotonic() - started
    stop.set()
    await watcher
    for _, writer in idle:
        writer.close()

    statuses = sorted(_status(a) for a in answers)
    admitted = defaults.max_inflight_body_bytes // (32 * MiB)
    assert statuses.count(408) == admitted, statuses  # stalled mid-body: cut at --proxy-body-timeout
    assert statuses.count(503) == STALLERS - admitted, statuses  # over the bytes in flight: refused unread
    assert open_now == defaults.max_connections
    assert refused_idle >= IDLE - defaults.max_connections, refused_idle
    assert side.metric("llama_sidecar_proxy_connections_refused_total") >= refused_idle
    assert max(figures["healthz_s"]) < 2.0, figures["healthz_s"]
    rss_over = max(figures["rss"]) - resting
    assert rss_over <= defaults.max_inflight_body_bytes + 64 * MiB, f"RSS rose {rss_over / MiB:.0f} MiB"
    assert max(figures["fds"]) <= 2 * defaults.max_connections + conns.FD_RESERVE, max(figures["fds"])
    assert took < BODY_TIMEOUT + 60
    pytestconfig.stash[SUMMARY].append(
        "proxy under 40 stalled 30 MiB bodies and 1,100 idle connections: "
        + json.dumps(
            {
                "rss_resting_mib": round(resting / MiB),
                "rss_peak_over_mib": round(rss_over / MiB),
                "fds_peak": max(figures["fds"]),
                "healthz_worst_s": round(max(figures["healthz_s"]), 3),
                "statuses": {s: statuses.count(s) for s in set(statuses)},
                "idle_refused": refused_idle,
                "seconds": round(took, 1),
            }
        )
    )
    assert http_json("GET", f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200, "the proxy serves again"
