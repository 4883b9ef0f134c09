"""The conversation library's index: token chains recorded at commit, lookups, per-conversation retention."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from sidecar.core import events, outcomes
from sidecar.library import prompt, routing
from sidecar.save import policy
from sidecar.snapshots import manifest, slotfile, store
from tests.support import clocks
from tests.support.told import Told

FP = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 2, 8192, 1000, 10), n_ctx=4096)
BLOCK = slotfile.BLOCK_TOKENS


def after_real_time() -> clocks.FakeClock:
    """The wall clock, moved on a millisecond per reading: last use is kept as the manifest's real mtime."""
    last = [time.time()]

    def read() -> float:
        last[0] = max(last[0] + 0.001, time.time())
        return last[0]

    return clocks.reading(read)


def slot_file(ids: list[int]) -> bytes:
    """A slot file as llama-server writes it: header, packed token state, then KV bytes."""
    words = struct.pack("<iII", -1, slotfile.PACKED_VERSION, len(ids)) + slotfile.pack_ids(ids) + b"\0\0\0\0"
    return struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, len(words) // 4) + words + b"\x07" * 256


def conversation(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BLOCK + 5)]


@pytest.fixture
def snaps(tmp_path: Path) -> store.SnapshotStore:
    return store.SnapshotStore(tmp_path, clock=after_real_time())


def commit(snaps: store.SnapshotStore, data: bytes, slot: int = 0) -> manifest.Manifest:
    temp = snaps.writer.temp_name(slot)
    (snaps.dir / temp).write_bytes(data)
    return snaps.writer.commit(temp, slot=slot, tokens=300, written=len(data), task=9, fingerprint=FP)


def test_commit_records_token_count_and_chain_and_nothing_of_the_ids(snaps: store.SnapshotStore) -> None:
    ids = conversation(1, 3)
    record = commit(snaps, slot_file(ids))
    packed = slotfile.pack_ids(ids)
    assert record.index == manifest.Index(len(ids), BLOCK, slotfile.prefix_hashes(packed), slotfile.whole_hash(packed))
    text = (snaps.dir / record.file.replace(".bin", ".json")).read_text()
    assert json.loads(text)["index"]["chain"] == list(record.index.chain)
    assert str(ids[7]) not in text  # hashes only
    snaps.loader.scan(clean=False)
    assert snaps.snapshots()[0].index == record.index  # read back at start-up


def test_a_file_that_cannot_be_parsed_is_committed_unindexed_and_reported(tmp_path: Path) -> None:
    reports = Told()
    snaps = store.SnapshotStore(tmp_path, clock=after_real_time(), events=reports)
    told = reports.not_indexed
    record = commit(snaps, b"not a slot file at all" * 10)
    assert record.index is None
    assert snaps.snapshots() == [record]  # still restorable by slot
    assert snaps.library() == []
    assert [reason for _, reason in told] == ["magic"]


def test_best_finds_the_longest_shared_prefix_and_listeners_hear_each_commit(snaps: store.SnapshotStore) -> None:
    heard: list[str] = []
    snaps.subscribe(lambda record: heard.append(record.file))
    a = commit(snaps, slot_file(conversation(1, 2)))
    b = commit(snaps, slot_file(conversation(2, 4)))
    assert heard == [a.file, b.file]
    request = slotfile.prefix_hashes(slotfile.pack_ids(conversation(2, 6)))
    found = snaps.best(request)
    assert found is not None
    assert (found[0].file, found[1]) == (b.file, 4)
    assert snaps.best(slotfile.prefix_hashes(slotfile.pack_ids(conversation(3, 2)))) is None


def test_another_conversation_saved_from_the_same_slot_does_not_replace_the_first(snaps: store.SnapshotStore) -> None:
    first = commit(snaps, slot_file(conversation(1, 3)))
    other = commit(snaps, slot_file(conversation(2, 3)))
    doomed = policy.select_for_deletion(snaps.snapshots(), keep_per_slot=1, max_bytes=0, max_age=0, now=0)
    assert doomed == []
    # The same conversation grown by a turn supersedes its older snapshot.
    grown = commit(snaps, slot_file(conversation(2, 5)))
    doomed = policy.select_for_deletion(snaps.snapshots(), keep_per_slot=1, max_bytes=0, max_age=0, now=0)
    assert doomed == [(other, outcomes.GcReason.SUPERSEDED)]
    assert {first.file, grown.file} <= {s.file for s in snaps.snapshots()}


def test_unindexed_snapshots_keep_the_per_slot_rule(snaps: store.SnapshotStore) -> None:
    old = commit(snaps, b"x" * 100)
    commit(snaps, b"y" * 100)
    doomed = policy.select_for_deletion(snaps.snapshots(), keep_per_slot=1, max_bytes=0, max_age=0, now=0)
    assert doomed == [(old, outcomes.GcReason.KEEP)]


def test_a_conversation_in_use_is_never_evicted_and_the_least_recently_used_goes(
    snaps: store.SnapshotStore,
) -> None:
    a = commit(snaps, slot_file(conversation(1, 2)), slot=0)
    b = commit(snaps, slot_file(conversation(2, 2)), slot=0)
    c = commit(snaps, slot_file(conversation(3, 2)), slot=0)
    snaps.recency.touch(a.file)  # a was used last: b is the least recently used
    cap = a.bytes + c.bytes
    with snaps.recency.using(b.file):
        doomed = policy.select_for_deletion(
            snaps.snapshots(), keep_per_slot=1, max_bytes=cap, max_age=0, now=0,
            in_use=snaps.recency.in_use(), last_used=snaps.last_used,
        )  # fmt: skip
        assert doomed == [(a, outcomes.GcReason.BYTES)]  # b in use, c the slot's newest
    doomed = policy.select_for_deletion(
        snaps.snapshots(), keep_per_slot=1, max_bytes=cap, max_age=0, now=0, last_used=snaps.last_used
    )
    assert doomed == [(b, outcomes.GcReason.BYTES)]


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, prompt.Kind.CHAT),
        ("/chat/completions", {"messages": []}, prompt.Kind.CHAT),
        ("/completion", {"prompt": "text"}, prompt.Kind.TEXT),
        ("/v1/completions", {"prompt": ["text"]}, prompt.Kind.TEXT),
        ("/completion", {"prompt": [1, 2, 3]}, prompt.Kind.IDS),
        ("/v1/responses", {"input": "hi", "store": False}, prompt.Kind.CHAT),
        ("/responses", {"input": [{"type": "message", "role": "user", "content": "hi"}]}, prompt.Kind.CHAT),
    ],
)
def test_routed_requests_say_how_to_get_their_ids(path: str, body: dict[str, object], kind: prompt.Kind) -> None:
    got = prompt.of(path, json.dumps(body).encode())
    assert isinstance(got, prompt.Prompt)
    assert got.kind is kind
    assert got.pin is prompt.Pin.BODY
    pinned = prompt.pinned(got, 1)
    assert pinned is not None
    assert json.loads(pinned) == {**body, "id_slot": 1}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # The body as it came, the pin after its opening brace: spacing, key order and 1.0 stay as they were.
        (
            b' \n{ "prompt": "a\\u00e9b", "temperature": 1.0 }',
            b' \n{"id_slot":3, "prompt": "a\\u00e9b", "temperature": 1.0 }',
        ),
        (b'{"prompt":"\xc3\xa9"}', b'{"id_slot":3,"prompt":"\xc3\xa9"}'),
        # id_slot -1 of its own ("any slot"): a later key of that name would win, so the body is encoded anew.
        (b'{"prompt": "x", "id_slot": -1}', b'{"prompt":"x","id_slot":3}'),
        # A lone surrogate (json.loads lets it through) in a body encoded anew: escaped, where UTF-8 fails.
        (b'{"prompt": "\\ud800x", "id_slot": -1}', b'{"prompt":"\\ud800x","id_slot":3}'),
        # Not UTF-8 (Python reads UTF-16 JSON; llama-server does not): encoded anew, as UTF-8.
        ('{"prompt": "x"}'.encode("utf-16"), b'{"prompt":"x","id_slot":3}'),
    ],
)
def test_the_pin_is_written_into_the_body_as_it_came(raw: bytes, expected: bytes) -> None:
    got = prompt.of("/completion", raw)
    assert isinstance(got, prompt.Prompt)
    assert prompt.pinned(got, 3) == expected


def test_a_responses_request_is_converted_without_changing_the_body_it_came_in() -> None:
    body = {
        "input": [
            {"type": "message", "role": "user", "content": "list", "status": "completed"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}],
             "tool_calls": [{"id": "given"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "more"}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "f"},
        ],
    }  # fmt: skip
    raw = json.dumps(body).encode()
    got = prompt.of("/v1/responses", raw)
    assert isinstance(got, prompt.Prompt)
    assert got.body == json.loads(raw)  # the items the conversion merged into are copies
    assert got.chat is not None
    assert got.chat["messages"] == [
        {"role": "user", "content": [{"text": "list", "type": "text"}]},
        {"role": "assistant", "content": [{"text": "ok", "type": "text"}, {"text": "more", "type": "text"}],
         "tool_calls": [
             {"id": "given"}, {"function": {"arguments": "{}", "name": "ls"}, "id": "c1", "type": "function"}]},
        {"content": "f", "role": "tool", "tool_call_id": "c1"},
    ]  # fmt: skip
    pinned = prompt.pinned(got, 0)
    assert pinned is not None
    assert json.loads(pinned) == {**body, "id_slot": 0}


def test_an_anthropic_request_is_rendered_as_the_server_converts_it_and_placed_not_pinned() -> None:
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1; cch=a5145;You help."}],
        "max_tokens": 8,
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "ls", "input": {"b": 1, "a": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "f"}]}]},
        ],
    }  # fmt: skip
    got = prompt.of("/v1/messages", json.dumps(body).encode())
    assert isinstance(got, prompt.Prompt)
    assert got.pin is prompt.Pin.PLACED
    assert prompt.pinned(got, 1) is None  # the converter drops id_slot: the body goes as it came
    assert got.chat is not None
    assert got.chat["messages"] == [
        {"role": "system", "content": "x-anthropic-billing-header: cc=1; cch=fffff;You help."},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": '{"a":2,"b":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "f"},
    ]  # fmt: skip
    assert got.chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert got.chat["max_tokens"] == 8


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/v1/embeddings", b'{"input": "x"}', "embedding"),
        ("/v1/rerank", b'{"query": "x"}', "embedding"),
        ("/v1/audio/transcriptions", b"", "audio"),
        ("/infill", b'{"input_prefix": "x"}', "infill"),
        ("/completion", b'{"prompt": ["a", "b"]}', "body"),
        ("/completion", b'{"prompt": "x", "id_slot": 1}', "own_slot"),
        ("/v1/messages", b'{"messages": [], "id_slot": 0}', "own_slot"),
        ("/completion", b"[1, 2]", "body"),
        ("/completion", b"not json", "body"),
        ("/v1/chat/completions", b'{"messages": "x"}', "body"),
        ("/v1/responses", b'{"input": [{"role": "user"}]}', "body"),
        ("/v1/responses", b'{"model": "m"}', "body"),
        ("/v1/messages", b'{"model": "m"}', "body"),
        ("/completion", b'{"prompt": "x", "multimodal_data": ["aGk="]}', "media"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
            "media",
        ),
        (
            "/v1/messages",
            b'{"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]}',
            "media",
        ),
        (
            "/v1/responses",
            b'{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}',
            "media",
        ),
    ],
)
def test_requests_the_library_does_not_route_are_counted_by_reason(path: str, body: bytes, reason: str) -> None:
    assert prompt.of(path, body) == reason


def test_a_new_conversation_saves_a_changed_victim_first() -> None:
    slots = [routing.Held(0, ("a0",), False, 5.0, True), routing.Held(1, ("b0",), True, 1.0, True)]
    got = routing.route(("n0", "n1"), slots, [])
    assert (got.source, got.slot, got.save_first) == (outcomes.Source.COLD, 0, True)


def test_last_use_survives_a_restart_of_the_sidecar(snaps: store.SnapshotStore, tmp_path: Path) -> None:
    a = commit(snaps, slot_file(conversation(1, 2)))
    commit(snaps, slot_file(conversation(2, 2)))
    snaps.recency.touch(a.file)
    touched = snaps.last_used(a.file)
    again = store.SnapshotStore(tmp_path, clock=after_real_time())
    again.loader.scan(clean=False)
    assert again.last_used(a.file) == pytest.approx(touched, abs=0.01)
    assert again.last_used(a.file) > a.created


def test_a_text_too_short_to_fill_a_block_is_known_without_asking_the_server() -> None:
    short = prompt.of("/completion", json.dumps({"prompt": "é" * 50}).encode())
    long = prompt.of("/completion", json.dumps({"prompt": "x" * 200}).encode())
    chat = prompt.of("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert isinstance(short, prompt.Prompt)
    assert isinstance(long, prompt.Prompt)
    assert isinstance(chat, prompt.Prompt)
    assert prompt.shorter_than(short, BLOCK)  # 100 bytes: at most 100 tokens and a few specials
    assert not prompt.shorter_than(long, BLOCK)
    assert not prompt.shorter_than(chat, BLOCK)  # the template adds text: only the server knows
