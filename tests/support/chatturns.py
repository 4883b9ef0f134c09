"""One chat conversation sent turn by turn to a server or a proxy, its replies kept as the server wrote them."""

from __future__ import annotations

from typing import Any

from tests.support.llamabed import http_json

WARM = 0.9
"""Share of a conversation's previous prompt its next turn must find cached."""


class Chat:
    """One chat conversation: a long first message, short follow-ups, replies as the server wrote them."""

    def __init__(self, n: int, text: str) -> None:
        self.n = n
        self.messages: list[dict[str, str]] = [{"role": "user", "content": text}]
        self.prompt_tokens = 0
        """Prompt tokens of the last turn."""

    def send(self, url: str, messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
        body = {"messages": messages or self.messages, "max_tokens": 8, "temperature": 0}
        status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
        assert status == 200, answer
        result: dict[str, Any] = answer
        return result

    def turn(self, url: str) -> tuple[int, int]:
        """Send the conversation and add the reply and a follow-up; returns (cache_n, the previous prompt's tokens)."""
        answer = self.send(url)
        earlier = self.prompt_tokens
        self.prompt_tokens = answer["usage"]["prompt_tokens"]
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"And what does record {self.n} say next?"})
        return int(answer["timings"]["cache_n"]), earlier
