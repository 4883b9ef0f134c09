"""A streaming client, and waiting for the sidecar to go quiet.

Shared by the stall and footprint benchmarks.
"""

from __future__ import annotations

import http.client
import json
import time

from bench import rig
from bench.beds import sidecarbed

STORY = "Write a very long story about a lighthouse keeper and the ships she watched over, chapter by chapter."


def stream(port: int, seconds: float, out: list[float]) -> None:
    """Stream a long completion on slot 0 for `seconds`; append token arrival times (unix) to `out`."""
    body = json.dumps(
        {
            "prompt": STORY,
            "n_predict": 6000,
            "stream": True,
            "id_slot": 0,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise rig.BenchError(f"stream answered HTTP {resp.status}: {resp.read()[:300]!r}")
        deadline = time.monotonic() + seconds
        for line in resp:
            if line.startswith(b"data: "):
                out.append(time.time())
                if time.monotonic() > deadline or b'"stop":true' in line:
                    break
    finally:
        conn.close()  # the server cancels the task when it next writes to the closed socket


def settle(side: sidecarbed.SidecarProcess, *, quiet: float = 4.0, timeout: float = 90.0) -> None:
    """Wait until the sidecar has committed no snapshot for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(side.log_events("snapshot_committed"))
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.2)


def first_event(resp: http.client.HTTPResponse) -> bytes:
    """Read a streamed answer up to the end of its first event's data line, keep-alives skipped (SSE comments,
    Anthropic's ``ping``: the proxy sends them while a stream waits); returns what was read."""
    got = b""
    while line := resp.readline():
        got += line
        if line.startswith(b"data: ") and not line.startswith(b'data: {"type":"ping"}'):
            break
    return got
