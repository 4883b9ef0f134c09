"""The hybrid section's chats and records: a chat conversation streamed turn by turn, each turn's time to first
token and reuse, and the runs :mod:`bench.hybrid` takes per model and mode.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bench import client, rig
from bench.beds import tinymodels

ALONE, BESIDE, PROXY = "alone", "beside", "proxy"
MODES = (ALONE, BESIDE, PROXY)
REPLY_TOKENS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Model:
    name: str
    path: Path
    swa_full: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    chat: int
    turn: int
    ttft_ms: float
    cache_n: int
    prompt_tokens: int
    previous: int
    """The conversation's previous prompt, in tokens; 0 on its first turn."""
    server_ms: float = math.nan
    """The server's own ``timings.prompt_ms``: its share of the wait, whatever routed the request."""

    @property
    def reuse(self) -> float:
        return self.cache_n / self.previous if self.previous else math.nan


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    model: str
    mode: str
    turns: list[Turn]
    after_kill: list[Turn]
    """The first turn of each conversation after the kill -9: the one the slot held last first."""
    collided: list[Turn] = dataclasses.field(default_factory=list)
    """Beside: turns sent as the sidecar's idle-time save (the boundary step first, on a hybrid) started.
    Through the proxy: the other chat's turns sent at once after a turn (the swap saves the slot first)."""
    quiet: list[Turn] = dataclasses.field(default_factory=list)
    """Beside: turns sent once that snapshot was committed. Through the proxy: swaps after the pause."""
    first: list[Turn] = dataclasses.field(default_factory=list)
    """Alone: turns preceded by the proxy-side way to a boundary state (emulated), timed from its first call."""
    plain: list[Turn] = dataclasses.field(default_factory=list)
    """Alone: the turns in between, as they come."""
    step_s: list[float] = dataclasses.field(default_factory=list)
    """With the sidecar: the boundary steps' durations (``slot_rewound_to_boundary``), on a hybrid."""

    @property
    def warm(self) -> list[Turn]:
        return [t for t in self.turns if t.previous]


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    tokens: int
    runs: list[Run]

    def run(self, model: str, mode: str) -> Run:
        return next(r for r in self.runs if r.model == model and r.mode == mode)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.runs))


class Chat:
    """One chat conversation: a long first message, short follow-ups, replies as the server wrote them."""

    def __init__(self, n: int, text: str) -> None:
        self.n = n
        self.messages: list[dict[str, str]] = [{"role": "user", "content": text}]
        self.prompt_tokens = 0
        self.turns = 0

    def turn(self, url: str) -> Turn:
        ttft_ms, reply, timings = stream(url, self.messages)
        earlier, self.prompt_tokens = self.prompt_tokens, int(timings["prompt_n"]) + int(timings["cache_n"])
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": f"And what does record {self.n} say next?"})
        self.turns += 1
        cached, server_ms = int(timings["cache_n"]), float(timings.get("prompt_ms", math.nan))
        return Turn(self.n, self.turns, ttft_ms, cached, self.prompt_tokens, earlier, server_ms)


def stream(url: str, messages: list[dict[str, str]]) -> tuple[float, str, dict[str, Any]]:
    """A streamed chat completion: (ms to the first byte of its body, the reply, the server's timings)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
    body = {"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True}
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = client.first_event(resp)  # the proxy's keep-alives before it are no token
        ttft_ms = (time.perf_counter() - started) * 1000
        lines = [*first.splitlines(), *resp.read().splitlines()]
    finally:
        conn.close()
    if resp.status != 200:
        raise rig.BenchError(f"chat turn answered HTTP {resp.status}: {b''.join(lines)[:300]!r}")
    reply: list[str] = []
    timings: dict[str, Any] | None = None
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        for choice in event.get("choices") or []:
            reply.append((choice.get("delta") or {}).get("content") or "")
        timings = event.get("timings", timings)
    if timings is None:
        raise rig.BenchError("the streamed answer carried no timings")
    return ttft_ms, "".join(reply), timings


def models(bed: rig.Rig) -> list[Model]:
    tiny = [Model(a.value, tinymodels.model(a, tokenizer_from=bed.model), swa_full=False) for a in tinymodels.Arch]
    return [Model("dense (gemma3-270m)", bed.model, swa_full=True), *tiny]
