"""A fake llama-server for the faults the real one cannot be made to produce on demand.

:class:`FakeLlama` is a real aiohttp app on a real loopback port, run on its
own thread and event loop so that its handlers (hung ones included) are
neither counted among the test's asyncio tasks nor able to stall the
sidecar under test. It mimics the llama-server API the sidecar uses
(as llama-server answers them): ``/health``, ``/slots``, ``/props``,
``/v1/models``, ``/metrics`` with the ``Process-Start-Time-Unix`` header, and
``POST /slots/{id}?action=save|restore|erase``, which really write and read
files in the slot dir it is given. ``--api-key`` is enforced like the real
server: every endpoint but ``/health`` (and ``/v1/models``) needs the Bearer key.

It is scripted at run time from the test's thread:

* ``fake.replies[endpoint] = Reply.hang()`` (or ``status``, ``raw``,
  ``json``, ``huge``, ``drip``, ``chunked``) replaces the answer of one
  endpoint (``"/health"``, ``"/slots"``, ``"/props"``, ``"/v1/models"``,
  ``"/metrics"``, ``"save"``, ``"restore"``, ``"erase"``, or ``"*"`` for all);
* ``fake.save_fault = SaveFault(...)`` makes saves lie: a truncated file
  with the full ``n_written``, no file at all, half a file then HTTP 500, a
  reply without ``n_written``, or a slow save;
* ``fake.use(slot, tokens)`` finishes a task on a slot, ``fake.restart()``
  behaves like a new server process.

Everything it saw is recorded in ``fake.seen`` (method, endpoint,
Authorization header, start/end, whether the client hung up) together with
the saves, restores and the highest number of saves in flight at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import json
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

HEADER = 44
"""Bytes of the fake's slot file header (an empty slot's save is 44 bytes, as in llama-server)."""
MAGIC = b"FAKEKV01"
BUILD_INFO = "b11434-515e85511"
MODEL_PATH = "/models/gemma-3-270m-it-Q4_K_M.gguf"
MODEL_SIZE = 253_115_008
MODEL_PARAMS = 268_098_176
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MakeFake = Callable[..., "FakeLlama"]
"""The ``make_fake`` fixture: starts a fake with the given options, stopped at teardown."""


class Kind(enum.StrEnum):
    HANG = "hang"
    STATUS = "status"
    RAW = "raw"
    HUGE = "huge"
    DRIP = "drip"
    CHUNKED = "chunked"


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """A scripted answer that replaces an endpoint's normal one."""

    kind: Kind
    status: int = 200
    body: bytes = b""
    pause: float = 0.0
    chunk: int = 1

    @classmethod
    def hang(cls) -> Reply:
        """Accept the request and never answer (until the client hangs up)."""
        return cls(Kind.HANG)

    @classmethod
    def error(cls, status: int = 500, message: str = "fake internal error") -> Reply:
        body = json.dumps({"error": {"code": status, "message": message, "type": "server_error"}})
        return cls(Kind.STATUS, status=status, body=body.encode())

    @classmethod
    def raw(cls, text: str, status: int = 200) -> Reply:
        """Exactly these bytes, declared as JSON (malformed JSON, Prometheus garbage...)."""
        return cls(Kind.RAW, status=status, body=text.encode())

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        """Valid JSON of the caller's choosing (wrong types, missing fields...)."""
        return cls(Kind.RAW, status=status, body=json.dumps(value).encode())

    @classmethod
    def huge(cls, size: int = 20 << 20) -> Reply:
        """A valid JSON list of ``size`` bytes, sent with a Content-Length."""
        head, tail = b'[{"id": 0, "n_ctx": 4096, "is_processing": false, "pad": "', b'"}]'
        return cls(Kind.HUGE, body=head + b"x" * (size - len(head) - len(tail)) + tail)

    @classmethod
    def drip(cls, value: Any, pause: float = 0.1) -> Reply:
        """Valid JSON sent one byte every ``pause`` seconds."""
        return cls(Kind.DRIP, body=json.dumps(value).encode(), pause=pause, chunk=1)

    @classmethod
    def chunked(cls, value: Any, chunk: int = 32 << 10, pause: float = 0.005) -> Reply:
        """Valid JSON sent in ``chunk``-byte pieces a little apart, as any streaming server may."""
        return cls(Kind.CHUNKED, body=json.dumps(value).encode(), pause=pause, chunk=chunk)


class SaveKind(enum.StrEnum):
    TRUNCATE = "truncate"
    """Write half the file, report the full ``n_written``."""
    NOTHING = "nothing"
    """Write no file, report success."""
    HALF_THEN_500 = "half_then_500"
    """Write half the file, then fail with HTTP 500 (a crash mid-save, seen from outside)."""
    BAD_REPLY = "bad_reply"
    """Write the whole file, answer without ``n_written`` and with ``n_saved`` a string."""
    SLOW = "slow"
    """Sleep ``delay`` seconds, then save normally."""


@dataclasses.dataclass(frozen=True, slots=True)
class SaveFault:
    kind: SaveKind
    slot: int | None = None
    """Only saves of this slot misbehave (None: every save, the link probe included)."""
    delay: float = 0.0


@dataclasses.dataclass(slots=True)
class Slot:
    id: int
    n_ctx: int
    task: int | None = None
    tokens: int = 0
    processing: bool = False


@dataclasses.dataclass(slots=True)
class Seen:
    """One request as the fake saw it."""

    method: str
    endpoint: str
    auth: str | None
    filename: str | None
    start: float
    end: float | None = None
    hung_up: bool = False
    """The client went away before the fake answered (its handler was cancelled)."""

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    slot: int
    filename: str


SEEN_KEY = web.RequestKey("seen", Seen)


class FakeLlama:
    def __init__(
        self,
        slot_dir: Path,
        *,
        n_slots: int = 2,
        n_ctx: int = 4096,
        api_key: str | None = None,
        bytes_per_token: int = 64,
    ) -> None:
        self.slot_dir = slot_dir
        self.n_ctx = n_ctx
        self.api_key = api_key
        self.bytes_per_token = bytes_per_token
        self.slots = [Slot(i, n_ctx) for i in range(n_slots)]
        self.start_time = int(time.time()) - 60
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.predicted_tokens = 0
        self.decode_calls = 0
        self.loading = False
        self.replies: dict[str, Reply] = {}
        self.save_fault: SaveFault | None = None
        self.seen: list[Seen] = []
        self.saves: list[Action] = []
        self.restores: list[Action] = []
        self.saves_in_flight = 0
        self.max_saves_in_flight = 0
        self._tasks = itertools.count(100)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- scripting, from the test's thread -------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def use(self, slot: int, tokens: int) -> int:
        """A task ran on ``slot`` and left ``tokens`` in its cache; returns its id_task."""
        task = next(self._tasks)
        view = self.slots[slot]
        view.task, view.tokens, view.processing = task, tokens, False
        self.prompt_tokens += tokens
        self.predicted_tokens += 8
        self.decode_calls += 9
        return task

    def tick(self) -> None:
        """Some work that changes no slot (e.g. a request that failed): /metrics counters move."""
        self.decode_calls += 1

    def restart(self) -> None:
        """Behave like a new llama-server process: new start time, empty slots, counters at 0."""
        self.start_time += 1
        self.slots = [Slot(s.id, self.n_ctx) for s in self.slots]
        self.prompt_tokens = self.cached_tokens = self.predicted_tokens = self.decode_calls = 0

    def respawn(self) -> None:
        """Like a process that exits and a new one on the same port: every connection closed, then :meth:`restart`."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._respawn(), self._loop).result(10)

    def requests(self, endpoint: str) -> list[Seen]:
        return [s for s in list(self.seen) if s.endpoint == endpoint]

    def slots_body(self) -> list[dict[str, Any]]:
        return [_slot_json(s) for s in self.slots]

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> FakeLlama:
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ready, failure), name="fakellama", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake llama-server did not start within 10 s")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:
            failure.append(exc)
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._runner = await self._listen(0)
        ready.set()
        try:
            await self._stopped.wait()
        finally:
            await self._runner.cleanup()

    async def _listen(self, port: int) -> web.AppRunner:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/health", self._health)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/props", self._props)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/slots/{id}", self._slot_action)
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        self.port = int(runner.addresses[0][1])
        return runner

    async def _respawn(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        self.restart()
        self._runner = await self._listen(self.port)

    # ---- request plumbing ---------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = request.path
        if endpoint.startswith("/slots/"):
            endpoint = request.query.get("action", "?")
        seen = Seen(request.method, endpoint, request.headers.get("Authorization"), None, time.monotonic())
        self.seen.append(seen)
        request[SEEN_KEY] = seen
        try:
            if (
                self.api_key is not None
                and endpoint not in ("/health", "/v1/models")
                and request.headers.get("Authorization") != f"Bearer {self.api_key}"
            ):
                return _error(401, "Invalid API Key", "authentication_error")
            reply = self.replies.get(endpoint) or self.replies.get("*")
            if reply is not None:
                return await self._scripted(request, reply)
            return await handler(request)
        except asyncio.CancelledError:
            seen.hung_up = True
            raise
        finally:
            seen.end = time.monotonic()

    async def _scripted(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        if reply.kind is Kind.HANG:
            await asyncio.get_running_loop().create_future()  # cancelled when the client hangs up
        if reply.kind in (Kind.STATUS, Kind.RAW, Kind.HUGE):
            return web.Response(status=reply.status, body=reply.body, content_type="application/json")
        response = web.StreamResponse(status=reply.status)
        response.content_type = "application/json"
        await response.prepare(request)
        for offset in range(0, len(reply.body), reply.chunk):
            await response.write(reply.body[offset : offset + reply.chunk])
            await asyncio.sleep(reply.pause)
        await response.write_eof()
        return response

    # ---- the llama-server API ---------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.loading:
            return _error(503, "Loading model", "unavailable_error")
        return web.json_response({"status": "ok"})

    async def _slots(self, request: web.Request) -> web.Response:
        return web.json_response(self.slots_body())

    async def _props(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": self.n_ctx, "speculative": False},
                "total_slots": len(self.slots),
                "model_alias": "gemma-3-270m-it",
                "model_path": MODEL_PATH,
                "modalities": {"vision": False, "audio": False},
                "build_info": BUILD_INFO,
                "is_sleeping": False,
                "model_ftype": "Q4_K - Medium",
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        meta = {"vocab_type": 1, "n_vocab": 262144, "n_ctx_train": 32768, "n_embd": 640}
        meta |= {"n_params": MODEL_PARAMS, "size": MODEL_SIZE}
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "gemma-3-270m-it", "object": "model", "owned_by": "llamacpp", "meta": meta}],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        families = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", self.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the KV cache.",
             self.cached_tokens),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.", self.predicted_tokens),
            ("n_decode_total", "counter", "Total number of llama_decode() calls", self.decode_calls),
            ("requests_processing", "gauge", "Number of requests processing.",
             sum(1 for s in self.slots if s.processing)),
            ("requests_deferred", "gauge", "Number of requests deferred.", 0),
        ]  # fmt: skip
        text = "".join(
            f"# HELP llamacpp:{name} {about}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
            for name, kind, about, value in families
        )
        return web.Response(
            text=text,
            content_type="text/plain",
            charset="utf-8",
            headers={"Process-Start-Time-Unix": str(self.start_time)},
        )

    async def _slot_action(self, request: web.Request) -> web.Response:
        action = request.query.get("action", "")
        try:
            slot_id = int(request.match_info["id"])
            slot = self.slots[slot_id]
        except (ValueError, IndexError):
            return _error(400, "Invalid slot ID", "invalid_request_error")
        if action == "erase":
            erased, slot.tokens = slot.tokens, 0
            return web.json_response({"id_slot": slot.id, "n_erased": erased})
        body = await request.json()
        filename = body.get("filename") if isinstance(body, dict) else None
        request[SEEN_KEY].filename = filename if isinstance(filename, str) else None
        if not isinstance(filename, str) or not _bare(filename):
            return _error(400, "Invalid filename", "invalid_request_error")
        if action == "save":
            return await self._save(slot, filename)
        if action == "restore":
            return self._restore(slot, filename)
        return _error(400, "Invalid action", "invalid_request_error")

    async def _save(self, slot: Slot, filename: str) -> web.Response:
        self.saves.append(Action(slot.id, filename))
        self.saves_in_flight += 1
        self.max_saves_in_flight = max(self.max_saves_in_flight, self.saves_in_flight)
        try:
            fault = self.save_fault
            if fault is not None and fault.slot not in (None, slot.id):
                fault = None
            if fault is not None and fault.kind is SaveKind.SLOW:
                await asyncio.sleep(fault.delay)
            started = time.perf_counter()
            data = self._file_bytes(slot)
            kind = fault.kind if fault is not None else None
            path = self.slot_dir / filename
            if kind is not SaveKind.NOTHING:
                whole = kind in (None, SaveKind.SLOW, SaveKind.BAD_REPLY)
                _write(path, data if whole else data[: len(data) // 2])
            if kind is SaveKind.HALF_THEN_500:
                return _error(500, "failed to write the slot file", "server_error")
            reply: dict[str, Any] = {
                "id_slot": slot.id,
                "filename": filename,
                "n_saved": slot.tokens,
                "n_written": len(data),
                "timings": {"save_ms": (time.perf_counter() - started) * 1000},
            }
            if kind is SaveKind.BAD_REPLY:
                del reply["n_written"]
                reply["n_saved"] = str(slot.tokens)
            return web.json_response(reply)
        finally:
            self.saves_in_flight -= 1

    def _restore(self, slot: Slot, filename: str) -> web.Response:
        self.restores.append(Action(slot.id, filename))
        started = time.perf_counter()
        try:
            data = (self.slot_dir / filename).read_bytes()
        except OSError:
            data = b""
        tokens = _tokens_in(data, self.bytes_per_token)
        if tokens is None or tokens > slot.n_ctx:
            slot.tokens = 0
            return _error(
                400,
                "Unable to restore slot, no available space in KV cache or invalid slot save file",
                "invalid_request_error",
            )
        slot.tokens = tokens
        return web.json_response(
            {
                "id_slot": slot.id,
                "filename": filename,
                "n_restored": tokens,
                "n_read": len(data),
                "timings": {"restore_ms": (time.perf_counter() - started) * 1000},
            }
        )

    def _file_bytes(self, slot: Slot) -> bytes:
        header = MAGIC + struct.pack("<qq", slot.tokens, slot.task or 0)
        header += b"\0" * (HEADER - len(header))
        body = bytes([(slot.task or 0) % 251]) * (slot.tokens * self.bytes_per_token)
        return header + body


def _slot_json(slot: Slot) -> dict[str, Any]:
    body: dict[str, Any] = {"id": slot.id, "n_ctx": slot.n_ctx, "speculative": False, "is_processing": slot.processing}
    if slot.task is not None:
        body |= {
            "id_task": slot.task,
            "n_prompt_tokens": slot.tokens,
            "n_prompt_tokens_processed": 0,
            "n_prompt_tokens_cache": 0,
            "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.8, "samplers": ["top_k", "top_p"]},
            "next_token": [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 8}],
        }
    return body


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


def _bare(filename: str) -> bool:
    return bool(filename) and "/" not in filename and "\\" not in filename and ".." not in filename


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _tokens_in(data: bytes, bytes_per_token: int) -> int | None:
    if len(data) < HEADER or not data.startswith(MAGIC):
        return None
    (tokens,) = struct.unpack_from("<q", data, len(MAGIC))
    if tokens < 0 or len(data) != HEADER + tokens * bytes_per_token:
        return None
    return int(tokens)
