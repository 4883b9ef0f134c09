"""What the proxy writes into a stream it started itself: keep-alives, and an answer turned into the error event."""

from __future__ import annotations

import json

import pytest

from sidecar.proxy import sse


@pytest.mark.parametrize(
    ("body", "streamed"),
    [
        (b'{"stream": true, "prompt": "x"}', True),
        (b'{"prompt": "x", "stream":true}', True),
        (b'{"stream": false}', False),
        (b'{"prompt": "x"}', False),
        (b'{"prompt": "say \\"stream\\": true"}', False),  # in a string, not the field
        (b'{"options": {"stream": true}}', False),  # not at the top level
        (b'{"stream": true', False),  # not JSON: llama-server answers it 400, not a stream
        (b'[{"stream": true}]', False),
    ],
)
def test_only_a_top_level_stream_true_asks_for_a_stream(body: bytes, streamed: bool) -> None:
    assert sse.asks_stream(body) is streamed


def test_keep_alives_are_what_each_api_s_parsers_skip() -> None:
    assert sse.keep_alive(sse.Api.ANTHROPIC) == b'event: ping\ndata: {"type":"ping"}\n\n'
    for api in (sse.Api.OPENAI, sse.Api.RESPONSES):
        assert sse.keep_alive(api).startswith(b":")
        assert sse.keep_alive(api).endswith(b"\n\n")


def _data(event: bytes) -> dict[str, object]:
    lines = event.decode().splitlines()
    parsed: dict[str, object] = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    return parsed


def test_an_error_answer_becomes_the_error_event_of_its_api_with_its_message_and_type() -> None:
    answer = json.dumps({"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}})
    openai = sse.answer_as_event(sse.Api.OPENAI, 400, "Bad Request", answer.encode())
    assert _data(openai) == {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}
    anthropic = sse.answer_as_event(sse.Api.ANTHROPIC, 400, "Bad Request", answer.encode())
    assert anthropic.startswith(b"event: error\n")
    assert _data(anthropic) == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}
    responses = _data(sse.answer_as_event(sse.Api.RESPONSES, 503, "Service Unavailable", b"down for now"))
    assert responses["type"] == "error"
    assert responses["message"] == "down for now"
    assert responses["code"] == "server_error"
    overloaded = _data(sse.answer_as_event(sse.Api.ANTHROPIC, 503, "Service Unavailable", b""))
    assert overloaded["error"] == {"type": "overloaded_error", "message": "503 Service Unavailable"}


def test_a_comment_stays_on_one_line() -> None:
    written = sse.comment("X-Llama-Sidecar-Prefix", "source=slot;\nslot=0")
    assert written == b": X-Llama-Sidecar-Prefix: source=slot; slot=0\n\n"
