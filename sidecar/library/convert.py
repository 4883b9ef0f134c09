"""The Anthropic Messages and OpenAI Responses requests as the Chat Completions body llama-server makes of them. Pure.

Ports of llama-server's own converters, so the library can have the server render the prompt it will
prefill; a request the server would refuse raises ``Refused`` and is forwarded as it came.

Invariants and trade-offs: docs/modules.md, `sidecar/library/convert.py`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

BILLING = "x-anthropic-billing-header:"
ANTHROPIC_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


class Refused(ValueError):
    """llama-server would answer this request with a 400."""


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _normalize_billing(text: str) -> str:
    """Claude Code's billing header changes its ``cch=`` stamp per request; the server blanks it."""
    if not text.startswith(BILLING):
        return text
    at = text.find("cch=", len(BILLING))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5 :]
    return text


def _image_url(source: dict[str, Any]) -> dict[str, Any] | None:
    kind = _str(source.get("type"))
    if kind == "base64":
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else "image/jpeg"
        url = f"data:{media};base64,{_str(source.get('data'))}"
    elif kind == "url":
        url = _str(source.get("url"))
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """The Chat Completions body llama-server makes of an Anthropic Messages request."""
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _anthropic_system(system)})
    if "messages" not in body:
        raise Refused("'messages' is required")
    given = body["messages"]
    for msg in given if isinstance(given, list) else ():
        messages.extend(_anthropic_message(msg))
    out: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [_anthropic_tool(tool) for tool in tools if isinstance(tool, dict)]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        out["tool_choice"] = choice
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body.get("max_tokens", 4096)
    for key in ANTHROPIC_PASSED:
        if key in body:
            out[key] = body[key]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        out["thinking_budget_tokens"] = thinking.get("budget_tokens", 10000)
    return out


def _anthropic_system(system: Any) -> str:
    if isinstance(system, str):
        return _normalize_billing(system)
    text = ""
    for block in system if isinstance(system, list) else ():
        if isinstance(block, dict) and block.get("type") == "text":
            text += _normalize_billing(_str(block.get("text")))
    return text


def _anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": _str(tool.get("name")),
            "description": _str(tool.get("description")),
            "parameters": tool.get("input_schema", {}),
        },
    }


def _tool_choice(choice: Any) -> str | None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind in ("any", "tool"):
        return "required"
    return None


def _anthropic_message(msg: Any) -> list[Any]:
    if not isinstance(msg, dict):
        return [msg]
    role = _str(msg.get("role"))
    if "content" not in msg:
        return [] if role == "assistant" else [msg]
    content = msg["content"]
    if not isinstance(content, list):
        return [msg]
    blocks = _Blocks()
    for block in content:
        if isinstance(block, dict):
            blocks.add(block)
    return blocks.messages(role)


@dataclasses.dataclass
class _Blocks:
    """An Anthropic message's content blocks, sorted into what its Chat Completions messages carry."""

    converted: list[Any] = dataclasses.field(default_factory=list)
    calls: list[Any] = dataclasses.field(default_factory=list)
    results: list[Any] = dataclasses.field(default_factory=list)
    reasoning: str = ""

    def add(self, block: dict[str, Any]) -> None:
        kind = _str(block.get("type"))
        if kind == "text":
            self.converted.append(block)
        elif kind == "thinking":
            self.reasoning += _str(block.get("thinking"))
        elif kind == "image":
            source = block.get("source")
            part = _image_url(source if isinstance(source, dict) else {})
            if part is not None:
                self.converted.append(part)
        elif kind == "tool_use":
            arguments = block.get("input", {})
            self.calls.append(
                {
                    "id": _str(block.get("id")),
                    "type": "function",
                    "function": {"name": _str(block.get("name")), "arguments": _dump(arguments)},
                }
            )
        elif kind == "tool_result":
            self.results.append(_tool_result(block))

    def messages(self, role: str) -> list[Any]:
        """The message of the text, reasoning and tool calls (if any), then one per tool result."""
        if not (self.converted or self.calls or self.reasoning):
            return list(self.results)
        new: dict[str, Any] = {"role": role, "content": self.converted if self.converted else ""}
        if self.calls:
            new["tool_calls"] = self.calls
        if self.reasoning:
            new["reasoning_content"] = self.reasoning
        return [new, *self.results]


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    call = _str(block.get("tool_use_id"))
    given = block.get("content")
    if isinstance(given, str):
        return {"role": "tool", "tool_call_id": call, "content": given}
    if not isinstance(given, list):
        return {"role": "tool", "tool_call_id": call, "content": ""}
    text = ""
    parts: list[Any] = []
    images = False
    for item in given:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text":
            text += _str(item.get("text"))
            parts.append({"type": "text", "text": _str(item.get("text"))})
        elif item.get("type") == "image":
            images = True
            source = item.get("source")
            part = _image_url(source if isinstance(source, dict) else {})
            if part is not None:
                parts.append(part)
    return {"role": "tool", "tool_call_id": call, "content": parts if images else text}


CANONICAL = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, sort_keys=True)
"""``nlohmann::json::dump()``: compact, keys sorted (its objects are ordered maps), non-ASCII kept; one
encoder made once (``json.dumps`` with options makes one per call)."""


def _dump(value: Any) -> str:
    return CANONICAL.encode(value)


def responses(body: dict[str, Any]) -> dict[str, Any]:
    """The Chat Completions body llama-server makes of an OpenAI Responses request (every other field kept)."""
    if "input" not in body:
        raise Refused("'input' is required")
    if _str(body.get("previous_response_id")):
        raise Refused("llama.cpp does not support 'previous_response_id'.")
    out = {k: v for k, v in body.items() if k != "input"}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _str(body["instructions"])})
        del out["instructions"]
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            # A shallow copy: only the item's own keys are set or dropped, and the lists it ends with are new.
            _responses_item(dict(item) if isinstance(item, dict) else {}, messages)
    else:
        raise Refused("'input' must be a string or array of objects")
    out["messages"] = messages
    if "tools" in body:
        tools = _responses_tools(body["tools"])
        del out["tools"]
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        del out["max_output_tokens"]
        out["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
        del out["reasoning"]
    return out


def _responses_tools(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list):
        raise Refused("'tools' must be an array of objects")
    tools = []
    for tool in given:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        tools.append({"type": "function", "function": function})
    return tools


def _responses_item(item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), str):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    content = item.get("content")
    if isinstance(content, list) and role in ("user", "system", "developer"):
        item["content"] = [_input_part(part) for part in content]
        item.pop("type", None)
        item.pop("status", None)
        messages.append(item)
    elif role == "assistant" and kind == "message":
        _assistant_message(item, content, messages, merge=merge)
    elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("arguments", "call_id", "name")):
        _function_call(item, messages, merge=merge)
    elif (
        kind == "function_call_output"
        and isinstance(item.get("call_id"), str)
        and isinstance(item.get("output"), str | list)
    ):
        output = item["output"]
        if isinstance(output, list):
            output = [_tool_output(part) for part in output]
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        content = item.get("content")
        if not isinstance(content, list) or not content or not isinstance(_get(content[0], "text"), str):
            raise Refused("a reasoning item needs content with text")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise Refused("Cannot determine type of 'item'")


def _assistant_message(item: dict[str, Any], content: Any, messages: list[dict[str, Any]], *, merge: bool) -> None:
    parts = [_output_part(part) for part in content] if isinstance(content, list) else []
    if merge:
        previous = messages[-1]
        held = previous.get("content")
        previous["content"] = [*(held if isinstance(held, list) else ()), *parts]
    else:
        item.pop("status", None)
        item.pop("type", None)
        item["content"] = parts
        messages.append(item)


def _function_call(item: dict[str, Any], messages: list[dict[str, Any]], *, merge: bool) -> None:
    call = {
        "function": {"arguments": item["arguments"], "name": item["name"]},
        "id": item["call_id"],
        "type": "function",
    }
    if merge:
        calls = messages[-1].get("tool_calls")
        messages[-1]["tool_calls"] = [*(calls if isinstance(calls, list) else ()), call]
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def _input_part(part: Any) -> dict[str, Any]:
    kind = _get(part, "type")
    if kind == "input_text":
        if "text" not in part:
            raise Refused("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise Refused("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    raise Refused("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_part(part: Any) -> dict[str, Any]:
    kind = _get(part, "type")
    if kind in ("output_text", "input_text"):
        if not isinstance(part.get("text"), str):
            raise Refused("'Output text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise Refused("'Refusal' requires 'refusal'")
        return {"refusal": part["refusal"], "type": "refusal"}
    raise Refused("'type' must be one of 'output_text' or 'refusal'")


def _tool_output(part: Any) -> Any:
    kind = _get(part, "type")
    if kind == "input_text":
        return {**part, "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise Refused("'image_url' is required")
        return {**part, "type": "image_url", "image_url": {"url": part["image_url"]}}
    raise Refused("Output of tool call should be 'Input text' or 'Input image'")


def has_media(chat: dict[str, Any]) -> bool:
    """Whether a Chat Completions body carries images or audio (the library indexes token ids only)."""
    for msg in chat.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
            _get(part, "type") in ("image_url", "input_audio", "input_image", "image") for part in content
        ):
            return True
    return False
