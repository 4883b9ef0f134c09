"""The sidecar as a real process, for end-to-end tests, fault tests and benchmarks.

`SidecarProcess` runs `python -m sidecar run` against a llama-server URL (real
or fake) with short timings so tests move fast, JSON logs in a file, and a
listen port chosen by the system (read back from its `listening` log line).
The caller's `LLAMA_*` variables are not passed on: the CLI reads them as
defaults, so a developer's environment would change what is tested.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

from tests.support.environ import child_env
from tests.support.net import free_port
from tests.support.readers import json_lines, parse_metrics, sample
from tests.support.wait import wait_until

T = TypeVar("T")
MakeSidecar = Callable[..., "SidecarProcess"]

FAST = {
    "--poll-interval": "0.25",
    "--idle-seconds": "0.5",
    "--min-tokens": "100",
    "--min-free-bytes": "0",
}


def manifests(slot_dir: Path) -> list[str]:
    """Names of the committed snapshots' manifests in a slot dir, oldest first."""
    return sorted(p.name for p in slot_dir.glob("slot*.json"))


def manifest_records(slot_dir: Path) -> list[dict[str, Any]]:
    """The committed manifests in a slot dir, as read now.

    The sidecar prunes an older snapshot when a newer one of the same slot or
    conversation is committed, so a manifest listed a moment ago may be gone
    when it is opened: it is left out, as it is no longer committed.
    """
    records = []
    for path in slot_dir.glob("slot*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except FileNotFoundError:
            continue
    return records


def bin_of(manifest_name: str) -> str:
    return manifest_name.removesuffix(".json") + ".bin"


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
        self.options = {**FAST, **(extra or {})}
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        cmd = [sys.executable, "-m", "sidecar", "run", "--server", self.server_url, "--slot-dir", str(self.slot_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--log-format", "json"]
        for flag, value in self.options.items():
            cmd += [flag, value] if value else [flag]  # "": a switch (--whole-files)
        return cmd

    def start(self) -> Self:
        """Spawn, and return once it listens and answers /healthz."""
        before = len(self.logs())
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(self.env)
            )
        self.port = self.wait_for(lambda: self._listening(before), timeout=20, what="the 'listening' log line")
        self.wait_for(lambda: self.get("/healthz")[0] == 200, timeout=20, what="/healthz")
        return self

    def run_to_exit(self, timeout: float = 30.0) -> int:
        """Spawn and wait for it to exit on its own (a start-up that must fail); returns the exit code."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(self.env)
            )
        return self.proc.wait(timeout)

    def _listening(self, after: int) -> int:
        return next((int(e["port"]) for e in self.logs()[after:] if e.get("event") == "listening"), 0)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for the exit code; SIGKILL (and its code) if it outlives `timeout`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

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

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """One HTTP call to the sidecar; (0, "") when it does not answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()
        except OSError:
            return 0, ""

    def get(self, path: str) -> tuple[int, str]:
        return self.request("GET", path)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample (summed over labels not named; 0.0 when absent)."""
        code, text = self.get("/metrics")
        assert code == 200, text
        return sample(parse_metrics(text), name, **labels)

    def wait_saved(self, n: int = 1, slot: int = 0, timeout: float = 60.0) -> None:
        """Wait until `n` snapshots of `slot` were committed."""
        self.wait_for(
            lambda: self.metric("llama_sidecar_snapshots_total", slot=str(slot), result="ok") >= n,
            timeout=timeout,
            what=f"{n} snapshot(s) of slot {slot}",
        )

    def wait_restored(self, n: int = 1, slot: int = 0, timeout: float = 60.0) -> None:
        """Wait until the server restored `n` snapshots into `slot` (`slot_restored`).

        Not `restores_total{result="ok"}`: on a sliding-window model (the test model) a restore
        is counted only once the slot's next request shows the server reused it.
        """
        self.wait_for(
            lambda: len([e for e in self.log_events("slot_restored") if e.get("slot") == slot]) >= n,
            timeout=timeout,
            what=f"{n} restore(s) of slot {slot}",
        )

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []

    def logs(self) -> list[dict[str, Any]]:
        return json_lines(self.log_path)

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return [entry for entry in self.logs() if entry.get("event") == event]

    def _exited(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"the sidecar exited ({self.proc.returncode})"
        return None

    def wait_for(self, check: Callable[[], T], *, timeout: float = 60.0, what: str = "") -> T:
        """Wait for `check()`; fail at once if the sidecar exits, with its log's tail."""
        try:
            return wait_until(check, timeout=timeout, what=what, every=0.1, gone=self._exited)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.tail()}") from None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines()[-n:])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def log_time(entry: dict[str, Any]) -> float:
    """Unix time of a sidecar JSON log line (ISO 8601 UTC `timestamp`)."""
    stamp = str(entry["timestamp"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def proxied(
    make: MakeSidecar, server: Any, slot_dir: Path, extra: dict[str, str] | None = None
) -> tuple[SidecarProcess, str]:
    """A sidecar beside ``server`` with its proxy on a free port, ready (``/readyz`` 200); and the proxy's URL."""
    port = free_port()
    side = make(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}", **(extra or {})})
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    return side, f"http://127.0.0.1:{port}"
