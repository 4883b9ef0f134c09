"""The one command, ``llama-kv-sidecar run -- llama-server ARGS``, with no sidecar flag but the test's own ports.

The proxy takes the port the user gave llama-server, llama-server saves into a RAM staging dir on
/dev/shm, the block store lives in the state dir (``$XDG_STATE_HOME/llama-kv-sidecar``), and after a
``kill -9`` of llama-server every conversation, more of them than slots, is warm again: its next
turn reuses at least 99% of its previous prompt. At exit the RAM staging dir is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.environ import child_env
from tests.support.llamabed import call, cpu_has_amx, make_prompt
from tests.support.net import free_port
from tests.support.readers import json_lines
from tests.support.wait import wait_until

CONVERSATIONS = 3
SLOTS = 2
TOKENS = 700


class OneCommand:
    """``python -m sidecar run --listen 127.0.0.1:0 -- llama-server ... --port PORT``, state dir from the env."""

    def __init__(self, binary: Path, model: Path, tmp: Path, *, server_args: tuple[str, ...] = (), env: dict[str, str]):
        self.port = free_port()
        self.log = tmp / "sidecar.log"
        self.argv = [
            sys.executable, "-m", "sidecar", "run", "--listen", "127.0.0.1:0", "--log-format", "json", "--",
            str(binary), "-m", str(model), "-np", str(SLOTS), "-c", "8192", "-t", "2", "--swa-full",
            *server_args, *(("--no-repack",) if cpu_has_amx() else ()),
        ]  # fmt: skip
        self.env = child_env({"XDG_STATE_HOME": str(tmp / "xdg"), **env})
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, url: str) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        wait_until(lambda: _healthy(url), timeout=120, what="/health through the proxy", gone=self._gone)

    def _gone(self) -> str | None:
        code = self.process.poll() if self.process is not None else None
        return None if code is None else f"the sidecar exited with status {code}: {self.log.read_text()[-2000:]}"

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in json_lines(self.log) if line.get("event") == name]

    def status(self) -> dict[str, Any]:
        port = [e for e in self.events("listening") if e.get("port")][-1]["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
            found: dict[str, Any] = json.loads(reply.read())
        return found

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def chat(url: str, messages: list[dict[str, str]]) -> tuple[dict[str, Any], int]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "cache_prompt": True}
    reply: dict[str, Any] = call("POST", url + "/v1/chat/completions", body)
    timings = reply["timings"]
    return reply, int(timings["prompt_n"]) + int(timings["cache_n"])


def following(messages: list[dict[str, str]], reply: dict[str, Any], n: int) -> list[dict[str, str]]:
    answer = reply["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"And then? ({n})"}]


def test_the_one_command_proxy_on_the_users_port_ram_staging_block_store_and_every_conversation_warm_after_kill_9(
    llama_binary: Path, model: Path, tmp_path: Path
) -> None:
    one = OneCommand(llama_binary, model, tmp_path, env={})
    url = f"http://127.0.0.1:{one.port}"
    one.argv += ["--port", str(one.port)]
    state = tmp_path / "xdg" / "llama-kv-sidecar"
    try:
        one.start(url)
        status = one.status()
        staging = status["staging"]
        assert staging["where"] == "ram", staging
        ram = Path(staging["slot_dir"])
        assert ram.parent == Path("/dev/shm")
        assert ram.is_dir()
        assert (ram.stat().st_mode & 0o777) == 0o700
        assert (state.stat().st_mode & 0o777) == 0o700
        assert status["launcher"]["pid"] is not None
        assert status["server"]["url"] != url, "llama-server moved to a private port"
        proxied = one.events("proxy_listening")[-1]
        assert proxied["port"] == one.port
        talks: list[tuple[list[dict[str, str]], int]] = []
        for seed in range(CONVERSATIONS):
            messages = [{"role": "user", "content": make_prompt(url, TOKENS, seed=70 + seed)}]
            reply, prompt = chat(url, messages)
            talks.append((following(messages, reply, 1), prompt))
        store = state / "store" / "snapshots"
        wait_until(
            lambda: len(list(store.glob("*.json"))) >= CONVERSATIONS,
            timeout=60,
            what="a snapshot of every conversation in the block store of the state dir",
        )
        os.kill(status["launcher"]["pid"], signal.SIGKILL)
        for n, (messages, prompt) in enumerate(talks):
            reply, _ = chat(url, messages)  # held at the proxy until llama-server is back and restored
            cached = int(reply["timings"]["cache_n"])
            print(f"the one command, conversation {n} after kill -9: cache_n {cached} of its previous {prompt}")
            assert cached >= 0.99 * prompt, f"conversation {n}: {cached} of {prompt} tokens reused"
        assert [e["cause"] for e in one.events("server_exited")] == ["killed"]
        assert one.stop() == 0
        assert not ram.exists(), "the RAM staging dir is removed at exit"
    finally:
        one.kill()


def test_vertex_ai_mode_and_a_list_of_addresses_through_the_launcher(
    llama_binary: Path, model: Path, tmp_path: Path
) -> None:
    """With ``AIP_MODE=PREDICTION`` llama-server binds ``AIP_HTTP_PORT`` whatever ``--port`` says: the proxy
    takes it and the child is given its private port; ``--host`` with two addresses: the proxy listens on each."""
    port = free_port()
    one = OneCommand(llama_binary, model, tmp_path, env={"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port)})
    one.argv += ["--host", "127.0.0.1,::1", "--port", str(free_port())]
    try:
        one.start(f"http://127.0.0.1:{port}")
        assert _healthy(f"http://[::1]:{port}"), "the proxy listens on the second address too"
        assert one.events("server_started"), "llama-server started on its private port"
        assert not one.events("server_exited"), "no bind failure of the child"
        assert one.stop() == 0
        text = one.log.read_text()
        assert "was never awaited" not in text
    finally:
        one.kill()
