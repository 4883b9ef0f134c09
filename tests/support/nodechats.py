"""Conversations sent through a balancer in front of nodes, and what each turn reused: for the tests and the bench.

Each turn's node is read from the ``x-node`` header :mod:`tests.support.haproxybed`
adds, its reuse from the answer's ``timings.cache_n``; with ``fetches``
given, whether the serving node fetched a snapshot from the shared store for
it (``conversation_requests_total{source="shared"}`` rose).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from tests.support.sidecarbed import SidecarProcess

AGENTS = ("You are agent one: answer in one short sentence.", "You are agent two: answer in a few words.")
"""Two agents' system prompts: conversation ``n`` is agent ``n % 2``'s."""


def settled(side: SidecarProcess) -> bool:
    """Every slot's content saved and uploaded: read in that order (a commit queues its upload)."""
    return bool(
        side.metric("llama_sidecar_slot_unsaved_since_timestamp_seconds") == 0
        and side.metric("llama_sidecar_snapshot_commits_pending") == 0
        and side.metric("llama_sidecar_shared_store_pending_uploads") == 0
    )


def fetches(side: SidecarProcess) -> float:
    """Routed requests the node served from the shared store so far."""
    return float(side.metric("llama_sidecar_conversation_requests_total", source="shared"))


class Chat:
    """A conversation of short turns: agent ``n % 2``'s one-line system prompt, answers of at most 4 tokens, and
    a one-line question each returning turn. ``system``, ``answer_tokens`` and ``follow`` (the next user message,
    given the number of turns sent) shape an agent's turns instead: a long system prompt shared by the agent's
    conversations, answers of exactly ``answer_tokens`` (the end of turn ignored), a tool's output each turn."""

    def __init__(
        self,
        n: int,
        first: str,
        *,
        system: str | None = None,
        answer_tokens: int | None = None,
        follow: Callable[[int], str] | None = None,
    ) -> None:
        self.n = n
        self.answer_tokens, self.follow = answer_tokens, follow
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": AGENTS[n % 2] if system is None else system},
            {"role": "user", "content": first},
        ]
        self.nodes: list[str] = []
        self.prompts: list[int] = []
        self.cached: list[int] = []
        self.seconds: list[float] = []
        self.server_seconds: list[float] = []
        """llama-server's own time for each turn: its answer's ``timings`` (prompt plus generation)."""
        self.generation_seconds: list[float] = []
        """llama-server's time generating each turn's answer (``timings.predicted_ms``)."""
        self.fetched: list[bool] = []
        self.answered: list[int] = []
        """Tokens of each turn's answer."""

    def turn(self, url: str, fetches: Mapping[str, Callable[[], float]] | None = None, timeout: float = 600) -> None:
        """Send the next turn through ``url``; ``fetches``: per node, its count of shared-store fetches."""
        before = {name: count() for name, count in (fetches or {}).items()}
        request: dict[str, Any] = {"messages": self.messages, "max_tokens": 4, "temperature": 0}
        if self.answer_tokens is not None:
            request |= {"max_tokens": self.answer_tokens, "ignore_eos": True}
        body = json.dumps(request).encode()
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        )
        started = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            node, answer = resp.headers["x-node"], json.loads(resp.read())
        self.seconds.append(time.monotonic() - started)
        self.nodes.append(node)
        self.fetched.append(fetches is not None and fetches[node]() > before[node])
        self.prompts.append(int(answer["usage"]["prompt_tokens"]))
        self.cached.append(int(answer["timings"]["cache_n"]))
        self.server_seconds.append((answer["timings"]["prompt_ms"] + answer["timings"]["predicted_ms"]) / 1000)
        self.generation_seconds.append(answer["timings"]["predicted_ms"] / 1000)
        self.answered.append(int(answer["usage"]["completion_tokens"]))
        question = f"Turn {len(self.nodes) + 1}: and what comes next in record {self.n}?"
        self.messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"},
            {"role": "user", "content": question if self.follow is None else self.follow(len(self.nodes))},
        ]

    def reused(self, turn: int) -> float:
        """Tokens turn ``turn`` (0-based) reused over the turn before's prompt."""
        return self.cached[turn] / self.prompts[turn - 1]
