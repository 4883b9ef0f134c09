"""Launcher mode: a second SIGTERM during the graceful stop stops at once.

The real llama-server ends on SIGTERM within milliseconds, so the graceful
stop never lasts long enough to send a second signal into it on demand. The
child here is a stand-in that ignores SIGTERM: after the first signal the
sidecar waits for it (up to its 10 s stop timeout, then SIGKILL); the second
signal must end both at once, with status 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.environ import child_env
from tests.support.readers import json_lines
from tests.support.wait import wait_until

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); time.sleep(600)"
)
"""A child that outlives SIGTERM (the launcher appends llama-server's flags to its argv: ignored)."""
AT_ONCE = 3.0
"""Seconds within which the second signal must end the sidecar (the child's stop timeout is 10 s)."""


def _events(log: Path, name: str) -> list[dict[str, object]]:
    return [line for line in json_lines(log) if line.get("event") == name]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_the_graceful_stop_kills_the_child_and_exits_at_once(
    tmp_path: Path, sig: signal.Signals
) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    log = tmp_path / "sidecar.log"
    argv = [
        sys.executable, "-m", "sidecar", "run", "--slot-dir", str(slots), "--listen", "127.0.0.1:0", "--no-proxy",
        "--log-format", "json", "--", sys.executable, "-c", STUBBORN,
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    try:
        started = wait_until(lambda: _events(log, "server_started"), timeout=30, what="the child started")
        child = int(str(started[0]["pid"]))
        deaf = wait_until(
            lambda: [e for e in _events(log, "server_output") if e.get("line") == "deaf"],
            timeout=30,
            what="the child ignoring SIGTERM",
        )
        assert deaf
        proc.send_signal(sig)
        wait_until(lambda: _events(log, "stopping"), timeout=30, what="the graceful stop begun")
        time.sleep(0.2)  # the child has its SIGTERM now, and ignores it
        assert proc.poll() is None, "the sidecar ended before the child did"
        second = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        took = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 1, json_lines(log)[-5:]
    assert took < AT_ONCE, f"the sidecar took {took:.1f} s to exit after the second signal"
    assert len(_events(log, "exit_at_once")) == 1
    wait_until(lambda: not _alive(child), timeout=5, what="the child killed")
