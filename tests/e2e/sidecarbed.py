"""The sidecar as a real process, for end-to-end tests and benchmarks.

`SidecarProcess` runs `python -m sidecar run` against a `LlamaServer`, with
short timings so tests move fast, and reads its /metrics and /status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

from llamabed import free_port
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
MakeSidecar = Callable[..., "SidecarProcess"]

FAST = {
    "--poll-interval": "0.25",
    "--idle-seconds": "0.5",
    "--min-tokens": "100",
    "--min-free-bytes": "0",
}


class SidecarProcess:
    def __init__(
        self,
        server_url: str,
        slot_dir: Path,
        log_path: Path,
        *,
        extra: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.server_url, self.slot_dir, self.log_path = server_url, slot_dir, log_path
        self.port = free_port()
        self.options = {**FAST, **(extra or {})}
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--server",
            self.server_url,
            "--slot-dir",
            str(self.slot_dir),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--log-format",
            "json",
        ]
        for flag, value in self.options.items():
            cmd += [flag, value]
        return cmd

    def start(self, wait: bool = True) -> Self:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        log.close()
        if wait:
            self.wait_for(lambda: self.get("/healthz")[0] == 200, timeout=20, what="/healthz")
        return self

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()
        except OSError:
            return 0, ""

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample (0.0 when absent)."""
        code, text = self.get("/metrics")
        assert code == 200, text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return [entry for entry in self.logs() if entry.get("event") == event]

    def wait_for(self, check: Callable[[], T], *, timeout: float = 60.0, what: str = "") -> T:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
