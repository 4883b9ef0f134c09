"""Coding agents' conversations sent with the official SDKs, the way each API's clients send them.

A :class:`Conversation` keeps one neutral history (a long first user message,
then the model's replies, a tool call with its result, follow-ups) and each
:class:`Api` renders it in its own format and sends it with its SDK
(``openai`` for Chat Completions and Responses, ``anthropic`` for Messages),
with ``max_retries=0`` so the test sees exactly what the proxy did. Every
request carries one tool; every reply gives the answer's own reuse figure
and prompt size as the API reports them, and the proxy's
``X-Llama-Sidecar-Prefix`` header (for a stream the proxy started before
the request was placed, the SSE comment that stands for it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import anthropic
import httpx2
import openai

from tests.support import llamabed

SYSTEM = "You answer in one short sentence."
TOOL_NAME = "read_file"
TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
MAX_TOKENS = 4
GREEDY = {"temperature": 0}
"""Sent as an extra field where the SDK has no parameter for it (llama-server takes it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    text: str
    cached: int
    """Prompt tokens the server reused for this request, from the answer itself."""
    prompt: int
    """Prompt tokens of this request."""
    header: str
    complete: bool
    """The answer ended as its API ends a whole answer (a finish reason, ``message_stop``, ``response.completed``)."""


@dataclasses.dataclass(slots=True)
class Conversation:
    n: int
    history: list[dict[str, Any]]
    prompt: int = 0
    """Prompt tokens of the last turn sent."""
    turns: int = 0

    @classmethod
    def start(cls, n: int, text: str) -> Conversation:
        return cls(n, [{"role": "user", "text": text}])

    def answered(self, reply: Reply, follow_up: str) -> None:
        """Add the reply and the next user turn: a tool call and its result after the first turn, else a question."""
        self.prompt = reply.prompt
        self.turns += 1
        if self.turns == 1:
            call = f"call_{self.n}"
            self.history.append({"role": "assistant", "text": reply.text, "call": call})
            self.history.append({"role": "tool", "call": call, "result": f"record {self.n}: {follow_up}"})
        else:
            self.history.append({"role": "assistant", "text": reply.text})
            self.history.append({"role": "user", "text": follow_up})


def _args(conversation: Conversation) -> str:
    return json.dumps({"path": f"records/{conversation.n}.txt"})


class Api:
    name = ""
    stream = False

    def __init__(self, url: str) -> None:
        self.url = url

    def send(self, conversation: Conversation) -> Reply:
        raise NotImplementedError


PREFIX = "X-Llama-Sidecar-Prefix"
_COMMENT = b": " + PREFIX.encode() + b": "


class _Prefixed(httpx2.HTTPTransport):
    """Reads the proxy's prefix header, or the comment that stands for it in a stream the proxy started
    before the request was placed (set then in the response's headers, once the stream was read)."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        if PREFIX not in response.headers:
            response.stream = _Peek(response.stream, response)
        return response


class _Peek(httpx2.SyncByteStream):
    def __init__(self, inner: Any, response: httpx2.Response) -> None:
        self._inner, self._response = inner, response

    def __iter__(self) -> Any:
        for chunk in self._inner:
            if (at := chunk.find(_COMMENT)) >= 0 and PREFIX not in self._response.headers:
                line = chunk[at + len(_COMMENT) :].split(b"\n", 1)[0]
                self._response.headers[PREFIX] = line.decode()
            yield chunk

    def close(self) -> None:
        self._inner.close()


def _http() -> httpx2.Client:
    return httpx2.Client(transport=_Prefixed(), timeout=600)


_made: list[openai.OpenAI | anthropic.Anthropic] = []
"""Every SDK client made, until :func:`close_all`."""


def close_all() -> None:
    """Close every client made so far (their pooled connections), so none is left to the garbage collector."""
    while _made:
        _made.pop().close()


def chat_tools() -> list[dict[str, Any]]:
    """The tool every Chat Completions request carries, as the body's ``tools``."""
    function = {"name": TOOL_NAME, "description": "Read a file", "parameters": TOOL_SCHEMA}
    return [{"type": "function", "function": function}]


class Chat(Api):
    """OpenAI Chat Completions (opencode, aider and most agents), with ``stream`` on or off."""

    def __init__(self, url: str, *, stream: bool) -> None:
        super().__init__(url)
        self.stream = stream
        self.name = "chat, streamed" if stream else "chat"
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=600, http_client=_http()
        )
        _made.append(self.client)

    def messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for item in conversation.history:
            if item["role"] == "user":
                out.append({"role": "user", "content": item["text"]})
            elif item["role"] == "assistant":
                message: dict[str, Any] = {"role": "assistant", "content": item["text"]}
                if "call" in item:
                    function = {"name": TOOL_NAME, "arguments": _args(conversation)}
                    message["tool_calls"] = [{"id": item["call"], "type": "function", "function": function}]
                out.append(message)
            else:
                out.append({"role": "tool", "tool_call_id": item["call"], "content": item["result"]})
        return out

    def send(self, conversation: Conversation) -> Reply:
        tools: Any = chat_tools()
        messages: Any = self.messages(conversation)
        common: dict[str, Any] = {"model": "m", "messages": messages, "tools": tools, "max_tokens": MAX_TOKENS}
        if not self.stream:
            raw = self.client.chat.completions.with_raw_response.create(**common, temperature=0)
            answer = raw.parse()
            usage = answer.usage
            assert usage is not None
            assert usage.prompt_tokens_details is not None
            return Reply(
                answer.choices[0].message.content or "",
                usage.prompt_tokens_details.cached_tokens or 0,
                usage.prompt_tokens,
                raw.headers.get("X-Llama-Sidecar-Prefix", ""),
                answer.choices[0].finish_reason is not None,
            )
        with self.client.chat.completions.with_streaming_response.create(
            **common, temperature=0, stream=True, stream_options={"include_usage": True}
        ) as response:
            return chat_stream(response)


def chat_stream(response: Any) -> Reply:
    """The reply of a streamed Chat Completion (an SDK's ``with_streaming_response``), read to its end."""
    text, cached, prompt, finished = "", -1, 0, False
    for chunk in response.parse():
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finished = finished or choice.finish_reason is not None
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
            prompt = chunk.usage.prompt_tokens
    return Reply(text, cached, prompt, response.headers.get(PREFIX, ""), finished)


class Messages(Api):
    """Anthropic Messages (Claude Code), with ``stream`` on or off."""

    def __init__(self, url: str, *, stream: bool) -> None:
        super().__init__(url)
        self.stream = stream
        self.name = "anthropic, streamed" if stream else "anthropic"
        self.client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600, http_client=_http())
        _made.append(self.client)

    def messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in conversation.history:
            if item["role"] == "user":
                out.append({"role": "user", "content": item["text"]})
            elif item["role"] == "assistant":
                content: list[dict[str, Any]] = [{"type": "text", "text": item["text"]}]
                if "call" in item:
                    use = {"type": "tool_use", "id": item["call"], "name": TOOL_NAME}
                    content.append({**use, "input": json.loads(_args(conversation))})
                out.append({"role": "assistant", "content": content})
            else:
                result = {"type": "tool_result", "tool_use_id": item["call"], "content": item["result"]}
                out.append({"role": "user", "content": [result]})
        return out

    def send(self, conversation: Conversation) -> Reply:
        tools: Any = [{"name": TOOL_NAME, "description": "Read a file", "input_schema": TOOL_SCHEMA}]
        messages: Any = self.messages(conversation)
        common: dict[str, Any] = {"model": "m", "system": SYSTEM, "messages": messages, "tools": tools}
        if not self.stream:
            raw = self.client.messages.with_raw_response.create(**common, max_tokens=MAX_TOKENS, extra_body=GREEDY)
            answer = raw.parse()
            cached = answer.usage.cache_read_input_tokens or 0
            text = "".join(block.text for block in answer.content if block.type == "text")
            header = raw.headers.get("X-Llama-Sidecar-Prefix", "")
            return Reply(text, cached, cached + answer.usage.input_tokens, header, answer.stop_reason is not None)
        text, cached, prompt, stopped = "", -1, 0, False
        with self.client.messages.with_streaming_response.create(
            **common, max_tokens=MAX_TOKENS, extra_body=GREEDY, stream=True
        ) as response:
            for event in response.parse():
                if event.type == "message_start":
                    cached = event.message.usage.cache_read_input_tokens or 0
                    prompt = cached + event.message.usage.input_tokens
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
                elif event.type == "message_stop":
                    stopped = True
            header = response.headers.get(PREFIX, "")
        return Reply(text, cached, prompt, header, stopped)


class Responses(Api):
    """OpenAI Responses (Codex): streamed, ``store=false``, the whole history in ``input``."""

    name = "responses, streamed"
    stream = True

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=600, http_client=_http()
        )
        _made.append(self.client)

    def items(self, conversation: Conversation) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in conversation.history:
            if item["role"] == "user":
                out.append({"type": "message", "role": "user", "content": item["text"]})
            elif item["role"] == "assistant":
                text = {"type": "output_text", "text": item["text"]}
                out.append({"type": "message", "role": "assistant", "content": [text]})
                if "call" in item:
                    call = {"type": "function_call", "call_id": item["call"], "name": TOOL_NAME}
                    out.append({**call, "arguments": _args(conversation)})
            else:
                out.append({"type": "function_call_output", "call_id": item["call"], "output": item["result"]})
        return out

    def send(self, conversation: Conversation) -> Reply:
        tools: Any = [{"type": "function", "name": TOOL_NAME, "description": "Read a file", "parameters": TOOL_SCHEMA}]
        items: Any = self.items(conversation)
        text, cached, prompt, completed = "", -1, 0, False
        with self.client.responses.with_streaming_response.create(
            model="m", instructions=SYSTEM, input=items, tools=tools, max_output_tokens=MAX_TOKENS,
            temperature=0, store=False, stream=True,
        ) as response:  # fmt: skip
            for event in response.parse():
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.completed":
                    completed = True
                    usage = event.response.usage
                    assert usage is not None
                    cached, prompt = usage.input_tokens_details.cached_tokens, usage.input_tokens
            header = response.headers.get(PREFIX, "")
        return Reply(text, cached, prompt, header, completed)


def first_turn_direct(server: str, api: Chat, chat: Conversation, slot: int) -> None:
    """``chat``'s first turn straight to llama-server at ``server``, in ``slot``, as ``api`` would send it;
    ``chat`` gets its answer and a next user turn."""
    body = {
        "messages": api.messages(chat),
        "tools": chat_tools(),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "id_slot": slot,
    }
    status, answer = llamabed.http_json("POST", server + "/v1/chat/completions", body, timeout=300)
    assert status == 200, answer
    text = answer["choices"][0]["message"].get("content") or ""
    chat.answered(Reply(text, 0, answer["usage"]["prompt_tokens"], "", True), f"Read record {chat.n}.")


def sent_across_a_kill9(side: Any, server: Any, api: Api, chat: Conversation) -> Reply:
    """Kill llama-server with SIGKILL, wait for the sidecar's gate to close, start the server again (not
    waited for) and send ``chat``'s next turn at once: it is held at the gate while the server loads."""
    server.kill()
    side.wait_for(lambda: side.get("/readyz")[0] == 503, what="the gate closed for the kill")
    server.start()
    reply = api.send(chat)
    assert reply.complete, reply
    return reply


def every_api(url: str) -> list[Api]:
    """The APIs and modes the agents use: Chat Completions (both), Anthropic Messages (both), Responses (streamed)."""
    return [Chat(url, stream=False), Chat(url, stream=True), Messages(url, stream=False), Messages(url, stream=True),
            Responses(url)]  # fmt: skip
