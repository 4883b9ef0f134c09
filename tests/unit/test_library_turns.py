"""A request's conversation key: which requests continue the turn a slot ran last, from their bodies alone."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.library import prompt, turns

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*messages: dict[str, Any], path: str = "/v1/chat/completions", **fields: Any) -> turns.Key:
    request = prompt.of(path, json.dumps({"messages": list(messages), **fields}).encode())
    assert isinstance(request, prompt.Prompt)
    key = turns.of(request)
    assert key is not None
    return key


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_the_same_messages_and_more_continue_a_turn() -> None:
    last = chat(SYSTEM, user("a"))
    assert last.continued_by(chat(SYSTEM, user("a"), assistant("ok"), user("b")))
    assert last.continued_by(chat(SYSTEM, user("a")))  # the same request again
    assert chat(SYSTEM, user("a"), assistant("ok"), user("b")).length == 4


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(chat(SYSTEM, user("A"), assistant("ok")), id="a message edited"),
        pytest.param(chat(user("a"), assistant("ok")), id="the system prompt dropped"),
        pytest.param(chat(SYSTEM), id="the history cut back"),
        pytest.param(chat(user("a"), SYSTEM, assistant("ok")), id="the messages reordered"),
        pytest.param(chat(SYSTEM, user("a"), tools=[{"type": "function"}]), id="tools given"),
        pytest.param(chat(SYSTEM, user("a"), chat_template_kwargs={"enable_thinking": False}), id="template options"),
        pytest.param(chat(SYSTEM, {"role": "user", "content": "a", "name": "x"}), id="a field of a message"),
    ],
)
def test_anything_that_changes_the_prompt_before_the_new_messages_does_not(other: turns.Key) -> None:
    assert not chat(SYSTEM, user("a")).continued_by(other)


def test_sampling_fields_are_no_part_of_the_prompt() -> None:
    last = chat(SYSTEM, user("a"), stream=False, max_tokens=1, temperature=0)
    assert last.continued_by(chat(SYSTEM, user("a"), user("b"), stream=True, max_tokens=900, top_p=0.5, seed=3))


def test_a_key_holds_no_prompt_text() -> None:
    key = chat(SYSTEM, user("a secret"))
    assert b"secret" not in key.head + b"".join(key.marks)


def test_each_api_is_keyed_by_the_chat_the_server_renders_of_it() -> None:
    first = {"model": "m", "system": "terse", "messages": [user("a")], "max_tokens": 9}
    more = {**first, "messages": [user("a"), assistant("ok"), user("b")], "stream": True}
    keys = []
    for body in (first, more):
        request = prompt.of("/v1/messages", json.dumps(body).encode())
        assert isinstance(request, prompt.Prompt)
        key = turns.of(request)
        assert key is not None
        keys.append(key)
    assert keys[0].continued_by(keys[1])


def text(body: dict[str, Any]) -> tuple[turns.Key, bytes]:
    request = prompt.of("/completion", json.dumps(body).encode())
    assert isinstance(request, prompt.Prompt)
    key = turns.of(request)
    assert key is not None
    return key, request.text.encode()


def test_a_text_prompt_continues_one_it_starts_with() -> None:
    last, _ = text({"prompt": "Q: one\nA:", "n_predict": 1})
    key, data = text({"prompt": "Q: one\nA: ok\nQ: two\nA:", "n_predict": 8, "stream": True})
    assert last.continued_by(key, data)
    other, data = text({"prompt": "Q: One\nA: ok\nQ: two\nA:"})
    assert not last.continued_by(other, data)
    shorter, data = text({"prompt": "Q: one"})
    assert not last.continued_by(shorter, data)
    grammar, data = text({"prompt": "Q: one\nA: ok", "grammar": "root ::= x"})
    assert not last.continued_by(grammar, data)  # a field that is not sampling alone is part of the head


def test_a_chat_never_continues_a_text_nor_ids_get_a_key() -> None:
    last, data = text({"prompt": "hello"})
    assert not last.continued_by(chat(user("hello")), data)
    ids = prompt.of("/completion", json.dumps({"prompt": [1, 2, 3]}).encode())
    assert isinstance(ids, prompt.Prompt)
    assert turns.of(ids) is None


def test_a_chat_that_shares_its_first_two_messages_is_the_same_conversation_another_on_the_system_prompt_is_not() -> (
    None
):
    slot = chat(SYSTEM, user("task"), assistant("ok"), user("go on"))
    assert slot.same_conversation(chat(SYSTEM, user("task"), assistant("ok"), user("go on"), assistant("x")))
    assert slot.same_conversation(chat(SYSTEM, user("task"), assistant("ok"), user("go on, with a reminder")))
    assert not slot.same_conversation(chat(SYSTEM, user("another task")))  # another agent on the system prompt
    assert not slot.same_conversation(chat(SYSTEM, user("task"), tools=[{"type": "function"}]))  # another head
