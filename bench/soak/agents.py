"""The soak's conversations: agents of real shapes, sent through the proxy with the official SDKs.

Every conversation starts with the same long preamble (a repository's context, as coding agents send it)
and a task of its own, then goes on with tool results and questions; each uses one API and mode (Chat
Completions streamed or not, Anthropic Messages streamed or not, Responses streamed), round-robin. A
Chat Completions turn also asks for the top log-probabilities of its first token, and the same request
is sent to the cold reference server (:func:`reference_top`) to check the KV from outside.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import time
from typing import Any

from bench.beds import llamabed
from bench.soak import invariants
from tests.support import agents

TOP = 5
"""Top log-probabilities asked for the first token of a Chat Completions turn."""
RETIRE_TOKENS = 3000
"""A conversation whose prompt passes this is done (a slot holds 4,096 tokens): a new one takes its place."""
PREAMBLE_TOKENS = 600
"""The preamble every conversation shares (its blocks are stored once): past the test model's sliding window
(512), as agents' system prompts and tool lists are past real models' windows; a conversation within its
window is counted apart (``cold_window``)."""
TASK_TOKENS = 120


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """What one turn got: the reply or the error, when, and the first token's top log-probabilities."""

    started: float
    ended: float
    reply: agents.Reply | None
    error: str = ""
    top: dict[str, float] = dataclasses.field(default_factory=dict)
    body: dict[str, Any] | None = None
    """The Chat Completions request as sent (for the reference); None for the other APIs."""


class ProbedChat(agents.Chat):
    """Chat Completions that also reads the first token's top log-probabilities (not streamed: llama-server
    refuses ``logprobs`` with ``tools`` on a stream)."""

    def send_probed(self, conversation: agents.Conversation) -> tuple[agents.Reply, dict[str, float], dict[str, Any]]:
        common: dict[str, Any] = {
            "model": "m",
            "messages": self.messages(conversation),
            "tools": agents.chat_tools(),
            "max_tokens": agents.MAX_TOKENS,
            "temperature": 0,
        }
        if not self.stream:  # llama-server refuses logprobs with tools on a stream
            common |= {"logprobs": True, "top_logprobs": TOP}
            raw = self.client.chat.completions.with_raw_response.create(**common)
            answer = raw.parse()
            usage = answer.usage
            assert usage is not None
            details = usage.prompt_tokens_details
            choice = answer.choices[0]
            top = _top(choice.logprobs.content if choice.logprobs is not None else None)
            reply = agents.Reply(
                choice.message.content or "",
                (details.cached_tokens or 0) if details is not None else -1,
                usage.prompt_tokens,
                raw.headers.get(agents.PREFIX, ""),
                choice.finish_reason is not None,
            )
            return reply, top, common
        with self.client.chat.completions.with_streaming_response.create(
            **common, stream=True, stream_options={"include_usage": True}
        ) as response:
            return agents.chat_stream(response), {}, common


def _top(content: Any) -> dict[str, float]:
    """The first token's top log-probabilities, by token text (an SDK object's ``logprobs.content``)."""
    if not content:
        return {}
    out: dict[str, float] = {}
    for item in content[0].top_logprobs or []:
        out[item.token] = max(out.get(item.token, -1e9), float(item.logprob))
    return out


def reference_top(url: str, body: dict[str, Any]) -> dict[str, float]:
    """The same request on the cold reference server (nothing reused): its first token's top log-probabilities."""
    status, answer = llamabed.http_json(
        "POST", url + "/v1/chat/completions", {**body, "cache_prompt": False, "stream": False}, timeout=300
    )
    if status != 200:
        raise RuntimeError(f"the reference server answered HTTP {status}: {str(answer)[:300]}")
    content = (answer["choices"][0].get("logprobs") or {}).get("content") or []
    if not content:
        return {}
    out: dict[str, float] = {}
    for item in content[0].get("top_logprobs") or []:
        out[str(item["token"])] = max(out.get(str(item["token"]), -1e9), float(item["logprob"]))
    return out


def api_for(url: str, n: int) -> agents.Api:
    """Conversation ``n``'s API and mode: Chat, Chat streamed, Messages, Messages streamed, Responses."""
    kind = n % 5
    if kind < 2:
        return ProbedChat(url, stream=kind == 1)
    if kind < 4:
        return agents.Messages(url, stream=kind == 3)
    return agents.Responses(url)


@dataclasses.dataclass(slots=True)
class Agent:
    """One conversation, its API, and the turns it had answered."""

    conversation: agents.Conversation
    api: agents.Api
    done: list[invariants.Done] = dataclasses.field(default_factory=list)
    retired: bool = False
    failed: bool = False
    """An attempt of its next turn failed: the same request goes again, and may have reached the server."""

    def send(self, clock: Any) -> Sent:
        """Its next turn; ``clock()`` is the run's clock."""
        started = clock()
        try:
            if isinstance(self.api, ProbedChat):
                reply, top, body = self.api.send_probed(self.conversation)
            else:
                reply, top, body = self.api.send(self.conversation), {}, None
        except Exception as exc:  # every client-visible error is counted, never raised
            return Sent(started, clock(), None, error=f"{exc.__class__.__name__}: {str(exc)[:200]}")
        return Sent(started, clock(), reply, top=top, body=body)

    def answered(self, sent: Sent, rng: random.Random) -> None:
        assert sent.reply is not None
        self.done.append(invariants.Done(sent.ended, sent.reply.prompt))
        self.failed = False
        follow = f"Tool output {len(self.done)}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
        self.conversation.answered(sent.reply, follow)
        self.retired = sent.reply.prompt > RETIRE_TOKENS


WORDS = tuple(
    "file line error import class module test build commit branch merge patch diff value index cache token "  # noqa: SIM905
    "buffer stream socket thread queue worker request response header status retry timeout config option".split()
)


def preamble(url: str, seed: int) -> str:
    """The preamble every conversation of the run shares."""
    return "Repository context:\n" + llamabed.make_prompt(url, PREAMBLE_TOKENS, seed=seed)


def new_agent(url: str, reference: str, shared: str, n: int, seed: int) -> Agent:
    """Conversation ``n``: the shared preamble, then a task of its own (its tokens counted on ``reference``)."""
    task = llamabed.make_prompt(reference, TASK_TOKENS, seed=seed * 1000 + n)
    return Agent(agents.Conversation.start(n, f"{shared}\n\nTask {n}: {task}"), api_for(url, n))


def leave_mid_stream(url: str, agent: Agent, read: int = 64) -> str:
    """Send ``agent``'s next turn streamed on a raw connection and close it after ``read`` bytes (a client
    that leaves); the conversation does not change. What happened, in words."""
    assert isinstance(agent.api, ProbedChat)
    body: dict[str, Any] = {"model": "m", "messages": agent.api.messages(agent.conversation)}
    body["tools"] = agents.chat_tools()
    body |= {"max_tokens": 64, "temperature": 0, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        got = response.read1(read) if response.status == 200 else b""
        return f"HTTP {response.status}, left after {len(got)} bytes"
    except OSError as exc:
        return f"no answer: {exc.__class__.__name__}"
    finally:
        conn.close()


def now_from(start: float) -> Any:
    """The run's clock: seconds since ``start`` (monotonic)."""
    return lambda: time.monotonic() - start
