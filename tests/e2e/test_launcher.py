"""Launcher mode end to end: the sidecar as a llama-swap model's ``cmd``, with the real llama-server.

llama-swap (and its fork llmsnap) cannot be built here, so :class:`Swap`
does what it does with a model's ``cmd``: put a free port in ``${PORT}``,
start the command, wait for ``/health`` on that port, send requests there,
and SIGTERM the command on a swap or a TTL unload. The sidecar must save
what changed before it exits, and the next start must restore it before the
first request: that request's own ``timings.cache_n`` says so.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sidecar.engine import gate
from sidecar.launch import restarts
from tests.support.environ import child_env
from tests.support.llamabed import call, cpu_has_amx, make_prompt
from tests.support.net import free_port
from tests.support.readers import json_lines, parse_metrics, sample
from tests.support.sidecarbed import FAST
from tests.support.wait import wait_until

TOKENS = 1500
CMD = (
    "{python} -m sidecar run --listen 127.0.0.1:0 --log-format json {fast} "
    "-- {binary} -m {model} --port ${{PORT}} -np 1 -c 8192 -t 2 --swa-full{repack}"
)
"""The sidecar put in front of the model's own llama-server ``cmd``: the proxy takes its ``--port ${PORT}``."""


def store_manifests() -> list[str]:
    """The snapshots committed in the block store of the default state dir (``$XDG_STATE_HOME``, per test)."""
    return manifests_in(Path(os.environ["XDG_STATE_HOME"]) / "llama-kv-sidecar" / "store" / "snapshots")


def manifests_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("slot*.json"))


def command(binary: Path, model: Path, *, model_arg: str | None = None) -> str:
    """A llama-swap ``cmd`` line that runs the sidecar as the launcher of llama-server."""
    fast = " ".join(f"{flag} {value}" for flag, value in FAST.items())
    return CMD.format(
        python=shlex.quote(sys.executable),
        fast=fast,
        binary=shlex.quote(str(binary)),
        model=shlex.quote(model_arg or str(model)),
        repack=" --no-repack" if cpu_has_amx() else "",
    )


class Swap:
    """A stand-in for llama-swap running one model's ``cmd``."""

    def __init__(self, cmd: str, log: Path) -> None:
        self.cmd, self.log = cmd, log
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, healthy: bool = True) -> None:
        self.port = free_port()
        argv = shlex.split(self.cmd.replace("${PORT}", str(self.port)))
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        if healthy:
            wait_until(self._healthy, timeout=120, what="the model's /health", gone=self._gone)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _gone(self) -> str | None:
        code = self.process.poll() if self.process is not None else None
        return None if code is None else f"the cmd exited with status {code}"

    def swap(self, timeout: float = 60.0) -> int:
        """SIGTERM, as llama-swap does on a swap or a TTL unload; the exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def lines(self) -> list[dict[str, Any]]:
        return json_lines(self.log)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("event") == name]

    def status_url(self) -> str:
        listening = [line for line in self.events("listening") if line.get("port")]
        return f"http://127.0.0.1:{listening[-1]['port']}"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "cache_prompt": True}
    reply: dict[str, Any] = call("POST", url + "/v1/chat/completions", body)
    return reply


def first_turn(url: str, seed: int) -> tuple[list[dict[str, str]], int]:
    """A long first turn; the messages of the next turn and this turn's prompt tokens."""
    messages = [{"role": "user", "content": make_prompt(url, TOKENS, seed=seed)}]
    reply = chat(url, messages)
    prompt = int(reply["timings"]["prompt_n"]) + int(reply["timings"]["cache_n"])
    answer = reply["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}], prompt


def test_llama_swap_contract_sigterm_saves_and_the_next_start_restores_before_the_first_request(
    llama_binary: Path, model: Path, tmp_path: Path
) -> None:
    swap = Swap(command(llama_binary, model), tmp_path / "cmd.log")
    try:
        swap.start()
        following, prompt = first_turn(swap.url, seed=43)
        assert swap.swap() == 0
        assert store_manifests(), "the SIGTERM of a swap left no snapshot"
        assert swap.events("server_stopped"), "the launcher did not stop llama-server"
        swap.start()
        warm = chat(swap.url, following)
        cached = int(warm["timings"]["cache_n"])
        print(f"launcher, llama-swap stand-in: after a swap, cache_n {cached} of the first turn's {prompt} tokens")
        assert cached >= 0.9 * prompt
        assert swap.swap() == 0
    finally:
        swap.kill()


KILLS = restarts.CRASH_LOOP_EXITS + 1
"""More kills -9 in a row than a crash loop's ends: a server that serves is never given up on."""
POLLS = 40
"""Client /health polls through the proxy while llama-server is down, after the first kill."""


def test_a_child_killed_with_sigkill_again_and_again_is_always_restarted_and_each_next_turn_is_warm(
    llama_binary: Path, model: Path, tmp_path: Path
) -> None:
    swap = Swap(command(llama_binary, model), tmp_path / "cmd.log")
    try:
        swap.start()
        following, prompt = first_turn(swap.url, seed=44)
        wait_until(store_manifests, timeout=30, what="the first turn's snapshot")
        pids = []
        for kill in range(KILLS):
            pid = wait_until(
                lambda: _get(swap.status_url() + "/status")[1]["launcher"]["pid"], timeout=60, what="a running child"
            )
            pids.append(pid)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            if kill == 0:
                for _ in range(POLLS):  # a client's health checks while it is down: one log line, not two each
                    _status(swap.url + "/health")
            warm = chat(swap.url, following)  # held at the gate until the new process is up and restored
            back = time.monotonic() - killed_at
            cached = int(warm["timings"]["cache_n"])
            print(
                f"launcher, kill -9 {kill + 1} of its child: the next turn answered {back:.2f} s after the kill, "
                f"cache_n {cached} of the first turn's {prompt} tokens"
            )
            assert cached >= 0.9 * prompt
            following = [*following, {"role": "assistant", "content": warm["choices"][0]["message"]["content"]}]
            following.append({"role": "user", "content": f"And after {kill}?"})
        exited = swap.events("server_exited")
        assert [(e["cause"], e["signal"]) for e in exited] == [("killed", "SIGKILL")] * KILLS
        assert not swap.events("server_crash_loop")
        after = _get(swap.status_url() + "/status")[1]["launcher"]
        assert after["pid"] not in (None, *pids)
        assert after["starts"] == KILLS + 1
        assert after["state"] == "running"
        with urllib.request.urlopen(swap.status_url() + "/metrics", timeout=5) as reply:
            scraped = parse_metrics(reply.read().decode())
        assert sample(scraped, "llama_sidecar_server_exits_total", cause="killed") == KILLS
        assert sample(scraped, "llama_sidecar_server_crash_loop") == 0
        lines = [e.get("event") for e in swap.lines()]
        killed = lines.index("server_exited")
        opened = lines.index("restore_gate_open", killed)
        said = lines[killed:opened].count("restore_gate_closed")
        assert said <= gate.SAID_REASONS, f"{said} restore_gate_closed lines in one outage with {POLLS} polls"
        assert swap.swap() == 0
    finally:
        swap.kill()


@pytest.mark.parametrize("fault", ["missing model", "bad argument"])
def test_a_server_that_cannot_start_ends_the_sidecar_at_once_with_its_status_and_last_lines(
    llama_binary: Path, model: Path, tmp_path: Path, fault: str
) -> None:
    if fault == "missing model":
        cmd = command(llama_binary, model, model_arg=str(tmp_path / "no-such-model.gguf"))
    else:
        cmd = command(llama_binary, model) + " --no-such-flag"
    swap = Swap(cmd, tmp_path / "cmd.log")
    try:
        started = time.monotonic()
        swap.start(healthy=False)
        assert swap.process is not None
        code = swap.process.wait(timeout=60)
        took = time.monotonic() - started
        print(f"launcher, {fault}: the sidecar ended with status {code} {took:.1f} s after its start")
        assert code == 1  # llama-server's own status
        assert took < 30
        assert [e["cause"] for e in swap.events("server_exited")] == ["failed"]
        said = [e["line"] for e in swap.events("server_output") if e["stream"] == "stderr" and e["line"].strip()]
        assert said, "llama-server's own lines are not in the log"
        failed = swap.events("server_not_started")
        assert len(failed) == 1
        assert failed[0]["last_lines"][-1] == said[-1]
        text = swap.log.read_text()
        assert "llama-kv-sidecar: error: llama-server exit status 1 before it ever served" in text
        assert said[-1] in text.splitlines()[-1]  # the error names the server's own last line
        closed = swap.events("restore_gate_closed")
        assert len(closed) <= 3, closed
    finally:
        swap.kill()


def test_conflicting_arguments_are_refused_with_status_2_naming_the_flag(llama_binary: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--",
            str(llama_binary),
            "-m",
            "x.gguf",
            "--port",
            str(free_port()),
            "--no-slots",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "llama-server's --no-slots turns off /slots" in done.stderr
    assert not (Path(os.environ["XDG_STATE_HOME"]) / "llama-kv-sidecar" / "store").exists(), "refused before"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
