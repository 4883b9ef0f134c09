"""The prompt-reuse figure read from an answer (``sse.cached_tokens``), against the regular expression it replaced."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.proxy import sse

ORACLE = re.compile(rb'(?<!\\)"(?:cache_n|cached_tokens|cache_read_input_tokens)"\s*:\s*(\d+)')
"""The expression the relay used before: the last match is the figure."""


def oracle(data: bytes) -> int | None:
    found = ORACLE.findall(data)
    return int(found[-1]) if found else None


PIECES = st.sampled_from(
    [
        b'"cache_n"',
        b'"cached_tokens"',
        b'"cache_read_input_tokens"',
        b'\\"cache_n\\"',
        b"\\",
        b'"',
        b":",
        b" ",
        b"\n",
        b"7",
        b"42",
        b"x",
        b"{",
        b"}",
        b",",
        b"cache_n",
    ]
)


@settings(max_examples=3000)
@given(st.lists(PIECES, max_size=24))
def test_the_figure_is_the_last_one_the_old_expression_found(pieces: list[bytes]) -> None:
    data = b"".join(pieces)
    assert sse.cached_tokens(data) == oracle(data)


def test_a_whole_answer_gives_its_own_figure_not_one_in_its_text() -> None:
    # The prompt (echoed in /completion's answer) and the generated text hold figures of their own, escaped.
    answer = {
        "content": 'the log says "cache_n": 99',
        "prompt": 'earlier: {"cached_tokens": 12} ' + "word " * 6000,
        "timings": {"cache_n": 4096, "prompt_n": 12},
    }
    data = json.dumps(answer).encode()
    assert sse.cached_tokens(data) == 4096 == oracle(data)


def test_each_api_s_figure_is_read() -> None:
    chat = b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":310}},"timings":{"cache_n":311}}\n\n'
    anthropic = b'event: message_start\ndata: {"message":{"usage":{"cache_read_input_tokens":512}}}\n\n'
    responses = b'data: {"response":{"usage":{"input_tokens_details":{"cached_tokens":77}}}}\n\n'
    assert [sse.cached_tokens(d) for d in (chat, anthropic, responses)] == [311, 512, 77]


def test_an_answer_without_a_figure_gives_none() -> None:
    assert sse.cached_tokens(b'data: {"choices":[{"delta":{"content":"cache_n"}}]}\n\n') is None
    assert sse.cached_tokens(b"") is None
    assert sse.cached_tokens(b'"cache_n": none') is None
