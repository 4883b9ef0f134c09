"""The coding agents' own CLIs, Claude Code and Codex, driven non-interactively through the proxy.

The CLIs are npm packages pinned in ``tests/e2e/clients/package.json`` and
installed there by ``scripts/test`` (``npm ci``); a missing one fails the
test that needs it. Each runs with a HOME of its own in the test's temporary
directory, dummy API keys, every update check, telemetry and error report
turned off, and ``HTTPS_PROXY`` pointing at a :class:`Tripwire`: anything
that would leave the machine goes there instead, is refused and recorded
(host and port only), and the test fails on it (the proxy, on the loopback
address, is in ``NO_PROXY``). Codex 0.171 syncs its curated plugins from
github.com and chatgpt.com unless ``[features] plugins = false``.

With the test model, llama-server needs ``--jinja``, a ChatML template that
renders tools (:data:`TEMPLATE`: the model's own shows none) and
``--logit-bias 1+7`` (token 1 ends its turn, so a turn ends in a few tokens).

Each CLI's prompt is made smaller than its default by its own settings, the
way a user would: Claude Code with ``--tools Read`` (its own system prompt
and one tool: 2.7K tokens in place of 12.1K with every tool), Codex with
``model_instructions_file``, the web search, the sub-agents and the image
viewer turned off (its shell tools stay: 2.6K tokens, its request a quarter
of the default's 39.5K characters).
What the proxy sees is what it sees from a full prompt, only shorter: each
CLI's own request shapes, system blocks, tools and resumed sessions.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from tests.support.llamabed import cpu_has_amx
from tests.support.net import free_port
from tests.support.sidecarbed import FAST, SidecarProcess

CLIENTS = Path(__file__).resolve().parent.parent / "e2e" / "clients"
"""The npm project of the CLIs (``package.json``, ``package-lock.json``) and the chat template."""
TEMPLATE = CLIENTS / "chatml-tools.jinja"
TIMEOUT_MS = 300_000
"""The CLIs' own request timeout: far above a cold prefill on two busy cores."""
TURN_TIMEOUT = 300.0

SERVER_ARGS = ["-np", "2", "-c", "32768", "-t", "2", "--swa-full", "--jinja", "--logit-bias", "1+7", "-n", "8"]
"""llama-server's arguments for the agents: 16K tokens a slot (the trimmed prompts are ~2.7K), answers cut at
8 tokens (``-n`` caps every request's own limit: the tiny model's answers are noise, and generating them is slow)."""


def binary(name: str) -> Path:
    """The installed CLI ``name`` (``claude``, ``codex``); fails, saying how to install it, when missing."""
    path = CLIENTS / "node_modules" / ".bin" / name
    if not path.exists():
        raise AssertionError(
            f"{name} is not installed in {CLIENTS}: run scripts/test, or `npm ci` in that folder (Node.js 20+)"
        )
    return path


class Launched(SidecarProcess):
    """The sidecar in launcher mode: it starts llama-server (the test model, :data:`SERVER_ARGS`) as its child."""

    def __init__(self, llama_binary: Path, model: Path, slot_dir: Path, log_path: Path) -> None:
        super().__init__("", slot_dir, log_path)
        self.proxy = f"http://127.0.0.1:{free_port()}"
        self.child = [str(llama_binary), "-m", str(model), *SERVER_ARGS, "--chat-template-file", str(TEMPLATE)]
        if cpu_has_amx():
            self.child.append("--no-repack")

    def args(self) -> list[str]:
        cmd = [sys.executable, "-m", "sidecar", "run", "--slot-dir", str(self.slot_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--proxy-listen", self.proxy.removeprefix("http://"), "--log-format", "json"]
        for flag, value in FAST.items():
            cmd += [flag, value]
        return [*cmd, "--", *self.child]

    def ready(self) -> Launched:
        """Started, llama-server up and the proxy ready (``/readyz`` 200)."""
        self.start()
        self.wait_for(lambda: self.get("/readyz")[0] == 200, timeout=120, what="the sidecar ready")
        return self

    def child_pid(self) -> int:
        pid = self.status()["launcher"]["pid"]
        assert isinstance(pid, int), f"no llama-server running: {self.status()['launcher']}"
        return pid


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One request as llama-server served it, from its own log lines (counts only, no text)."""

    slot: int
    prompt: int
    """Prompt tokens of the request."""
    processed: int
    """Of those, the tokens it prefilled; the rest it reused."""
    kept: int
    """Tokens left in the slot when it finished (the prompt and the answer but its last token)."""

    @property
    def cached(self) -> int:
        return self.prompt - self.processed


_TASK_LINE = re.compile(
    r"slot +(?P<what>print_timing|release): id +(?P<slot>\d+) \| task (?P<task>\d+) \| +"
    r"(?:prompt eval time = .* / +(?P<processed>\d+) tokens|eval time = .* / +(?P<generated>\d+) tokens"
    r"|stop processing: n_tokens = (?P<kept>\d+))"
)


def tasks(side: SidecarProcess) -> list[Task]:
    """The requests llama-server finished, in order, from its lines in the launcher's log (``server_output``)."""
    seen: dict[tuple[int, str], dict[str, int]] = {}
    done: list[Task] = []
    for entry in side.log_events("server_output"):
        found = _TASK_LINE.search(str(entry.get("line", "")))
        if found is None:
            continue
        task = seen.setdefault((int(entry["pid"]), found["task"]), {"slot": int(found["slot"])})
        for key in ("processed", "generated", "kept"):
            if found[key] is not None:
                task[key] = int(found[key])
        if "kept" in task and "processed" in task:
            generated = task.get("generated", 0)
            prompt = task["kept"] - max(generated - 1, 0)
            done.append(Task(task["slot"], prompt, task["processed"], task["kept"]))
            del seen[(int(entry["pid"]), found["task"])]
    return done


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    session: str
    requests: list[Task]
    """What llama-server served for the turn, in order (a CLI may send more than one request a turn)."""
    seconds: float

    @property
    def first(self) -> Task:
        assert self.requests, "the turn reached llama-server with no request"
        return self.requests[0]

    @property
    def last(self) -> Task:
        assert self.requests, "the turn reached llama-server with no request"
        return self.requests[-1]


def saved(side: SidecarProcess, task: Task) -> None:
    """Wait until the slot ``task`` left is in a committed snapshot (the one a restore after a kill comes from)."""
    side.wait_for(
        lambda: any(
            e.get("slot") == task.slot and e.get("tokens") == task.kept for e in side.log_events("snapshot_committed")
        ),
        timeout=60,
        what=f"the snapshot of slot {task.slot} at {task.kept} tokens",
    )


class Cli(Protocol):
    def said(self, prompt: str, resume: str | None) -> str:
        """Run one turn; the session's id."""
        ...


def turn(side: SidecarProcess, cli: Cli, prompt: str, resume: str | None = None) -> Turn:
    """One turn of ``cli`` and the requests llama-server served for it."""
    before = len(tasks(side))
    started = time.monotonic()
    session = cli.said(prompt, resume)
    seconds = time.monotonic() - started
    return Turn(session, tasks(side)[before:], seconds)


class Tripwire:
    """A local HTTP proxy that lets nothing through: it records what each connection asked for and closes it."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        wire = self

        class Refuse(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(512).decode("latin-1").split()
                # "CONNECT host:443 HTTP/1.1", or "GET http://host/... HTTP/1.1": the target only, never a body.
                wire.asked.append(line[1].split("/")[2] if len(line) > 1 and "//" in line[1] else " ".join(line[:2]))

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Refuse)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="tripwire", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _quiet_env(home: Path, wire: Tripwire, extra: dict[str, str]) -> dict[str, str]:
    """A clean environment: a HOME of its own, nothing of the caller's, outbound traffic sent to ``wire``."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "HTTPS_PROXY": wire.url,
        "HTTP_PROXY": wire.url,
        "NO_PROXY": "127.0.0.1,localhost",
        **extra,
    }


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TURN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"{Path(argv[0]).name} exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


class ClaudeCode:
    """``claude -p PROMPT --output-format json`` against the proxy's Anthropic Messages API."""

    def __init__(self, proxy: str, root: Path, wire: Tripwire) -> None:
        self.exe = binary("claude")
        self.home, self.work = root / "claude-home", root / "claude-work"
        self.home.mkdir(parents=True)
        self.work.mkdir(parents=True)
        self.env = _quiet_env(
            self.home,
            wire,
            {
                "ANTHROPIC_BASE_URL": proxy,
                "ANTHROPIC_API_KEY": "dummy",
                "API_TIMEOUT_MS": str(TIMEOUT_MS),
                "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_TELEMETRY": "1",
                "DISABLE_ERROR_REPORTING": "1",
                "DISABLE_BUG_COMMAND": "1",
                "CLAUDE_CODE_MAX_RETRIES": "0",
            },
        )

    def said(self, prompt: str, resume: str | None) -> str:
        argv = [str(self.exe), "-p", prompt, "--output-format", "json", "--tools", "Read"]
        if resume is not None:
            argv += ["--resume", resume]
        result: dict[str, Any] = json.loads(_run(argv, self.env, self.work))
        assert not result.get("is_error"), f"claude reported an error: {result.get('result')!r}"
        return str(result["session_id"])


CODEX_CONFIG = """\
model = "tiny"
model_provider = "sidecar"
model_instructions_file = "{instructions}"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[agents]
enabled = false

[features]
view_image = false
plugins = false

[model_providers.sidecar]
name = "llama-kv-sidecar"
base_url = "{proxy}/v1"
wire_api = "responses"
env_key = "SIDECAR_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {timeout}
"""
CODEX_INSTRUCTIONS = "You are a coding agent in the Codex CLI. Answer in one short sentence.\n"


class Codex:
    """``codex exec --json`` (and ``codex exec resume``) against the proxy's OpenAI Responses API."""

    def __init__(self, proxy: str, root: Path, wire: Tripwire) -> None:
        self.exe = binary("codex")
        self.home, self.work = root / "codex-home", root / "codex-work"
        codex_home = self.home / ".codex"
        codex_home.mkdir(parents=True)
        self.work.mkdir(parents=True)
        instructions = codex_home / "instructions.md"
        instructions.write_text(CODEX_INSTRUCTIONS)
        (codex_home / "config.toml").write_text(
            CODEX_CONFIG.format(instructions=instructions, proxy=proxy, timeout=TIMEOUT_MS)
        )
        self.env = _quiet_env(self.home, wire, {"CODEX_HOME": str(codex_home), "SIDECAR_API_KEY": "dummy"})

    def said(self, prompt: str, resume: str | None) -> str:
        argv = [str(self.exe), "exec", "--json", "--skip-git-repo-check"]
        if resume is not None:
            argv += ["resume", resume]
        out = _run([*argv, prompt], self.env, self.work)
        events = [json.loads(line) for line in out.splitlines() if line[:1] == "{"]
        failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
        assert not failed, f"codex reported: {failed}"
        assert any(e.get("type") == "turn.completed" for e in events), f"codex's turn did not complete: {events}"
        return next(str(e["thread_id"]) for e in events if e.get("type") == "thread.started")
